"""A causal-LM loss that never holds the full ``[batch x seq x vocab]`` logits (the "logits wall").

Used by our trainer mixin (so by our trainers, the callback route and ``python -m hf_fsdp_qlora.run``) wherever the
trainer keeps transformers' stock loss; a trainer with a loss of its own (trl's SFT and DPO trainers with their fused
LM head, a ``compute_loss_func``, label smoothing, Liger) keeps it.

How: the model is called as the stock Trainer calls it (labels included), and for the duration of that one call
its LM head's ``forward`` is replaced by a function that receives the final hidden states, drops every position
whose (shifted) label is -100, and runs the head and the cross-entropy ``loss_chunk_size`` tokens at a time
(:mod:`hf_fsdp_qlora.train.loss_kernel`), returning the 0-dim loss in place of the logits; the model's
``loss_function`` returns that loss unchanged. Whatever the model adds to its loss after ``loss_function`` (a mixture
of experts' ``router_aux_loss_coef * aux_loss``, under any attribute name) it adds to ours, in its own code. The head
is still called once, as a module, by the model's own forward, inside the root FSDP forward: FSDP1 (the head lives
in the root unit) and FSDP2 (accelerate gives the final norm and head a unit of their own,
``reshard_after_forward=False``) gather it once for all chunks, and its backward hooks run once. The head's sharded
weight is never touched.

Which path, decided once per trainer and said once (INFO for a choice, WARNING for a fallback):
:func:`hf_fsdp_qlora.loss_paths.loss_path` on the trainer's settings and the model's config (the doctor asks the
same predicate), then, once per mode (training, evaluation), a probe: one forward without gradients in which the
head gives the first position's real logits and ``loss_function`` records what reaches it. A model that transforms
its logits between the two (a soft cap, a scale, a slice, in place or not, under any config name), that computes
its loss without ``loss_function``, or that never calls its head keeps the stock loss: never a wrong loss.

Why not upstream's: transformers' ``ForCausalLMLoss`` needs the full logits; trl's fused head
(``add_fused_lm_head``) replaces the whole model forward, projects with the head's raw weight (a second gather of
it under FSDP2, LoRA or 4-bit heads bypassed), and is a private kernel of an optional dependency.

Normalisation is transformers': the sum over labelled tokens divided by ``num_items_in_batch`` when the Trainer
passes it (gradient accumulation across micro-batches and ranks), else their mean. A micro-batch without any
labelled token gives a loss of 0 connected to the whole model (every FSDP collective still runs), where the stock
mean gives NaN.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from ..loss_paths import DEFAULT_LOSS_CHUNK_SIZE, loss_path
from .loss_kernel import IGNORE_INDEX, head_loss

__all__ = [
    "chunked_loss_reason",
    "compute_chunked_loss",
    "compute_loss",
    "head_loss",
    "loss_only_prediction",
    "trainer_loss_path",
]

logger = logging.getLogger(__name__)


def _shift_labels(inputs: dict):
    if inputs.get("shift_labels") is not None:  # padding-free collators pass them already shifted
        return inputs["shift_labels"]
    return F.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)


def _head_of(trainer, model):
    """(the LM head, the causal-LM module whose forward calls it and its `loss_function`, the unwrapped model)."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    get = getattr(unwrapped, "get_output_embeddings", None)
    head = get() if get is not None else None
    from torch.distributed.fsdp import FullyShardedDataParallel

    causal = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    # An LM head wrapped as an FSDP1 unit of its own: patch the module inside, so FSDP1's forward still unshards.
    return (head.module if isinstance(head, FullyShardedDataParallel) else head), causal


# The trainer mixin (train/_trainer_mixin.py) imports this module; it is found in a trainer's MRO by its module.
_MIXIN_MODULE = __name__.rpartition(".")[0] + "._trainer_mixin"


def _after_mixin(trainer) -> tuple[type, ...]:
    """The classes of `trainer`'s MRO after our mixin (all of them when the mixin is absent)."""
    mro = type(trainer).__mro__
    at = next((i for i, cls in enumerate(mro) if cls.__module__ == _MIXIN_MODULE), -1)
    return mro[at + 1 :]


def _own_loss_class(trainer) -> str | None:
    """The class between our mixin and transformers.Trainer that defines its own compute_loss (trl's trainers)."""
    from transformers import Trainer

    for cls in _after_mixin(trainer):
        if "compute_loss" in vars(cls):
            return None if cls is Trainer else cls.__name__
    return None


def _facts(trainer) -> dict:
    """What :func:`hf_fsdp_qlora.loss_paths.loss_path` needs to know of a live trainer and its model."""
    args = trainer.args
    head, causal = _head_of(trainer, trainer.model)
    is_causal = head is not None and type(causal).__name__.endswith("ForCausalLM")
    config = getattr(causal, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {
        "trainer_class": _own_loss_class(trainer),
        "chunked_loss": getattr(args, "chunked_loss", True),
        "compute_loss_func": trainer.compute_loss_func is not None,
        "label_smoothing": trainer.label_smoother is not None,
        "liger": getattr(args, "use_liger_kernel", False),
        "causal_lm": is_causal,
        "config": text if is_causal else None,
    }


def _decisions(trainer) -> dict:
    # Decided once per trainer (settings and model do not change between micro-steps); the probe once per mode.
    return trainer.__dict__.setdefault("_hf_fsdp_qlora_loss", {"logged": set()})


def _static_path(trainer) -> tuple[str, str | None]:
    decided = _decisions(trainer)
    if "static" not in decided:
        decided["static"] = loss_path("hf_fsdp_qlora", **_facts(trainer))
    return decided["static"]


def _note(trainer, path: str, reason: str) -> None:
    """Say once per trainer why it does not take the chunked loss."""
    logged = _decisions(trainer)["logged"]
    if reason in logged:
        return
    logged.add(reason)
    chosen = reason == "chunked_loss=False" or path != "stock"  # the user's or the trainer's choice, not a fallback
    logger.log(
        logging.INFO if chosen else logging.WARNING,
        "hf_fsdp_qlora: %s computes the %s loss, not the chunked one (%s)%s",
        type(trainer).__name__,
        "stock (full logits)" if path == "stock" else f"trainer's own ({path})",
        reason,
        "" if chosen else "; plan its memory with `hf-fsdp-qlora doctor --loss-path stock`",
    )


def trainer_loss_path(trainer) -> str:
    """The :data:`~hf_fsdp_qlora.loss_paths.LOSS_PATHS` name of the loss `trainer` computes in training ("own" for
    another trainer with a loss of its own)."""
    path, _ = _static_path(trainer)
    if path == "ours" and _decisions(trainer).get(("probe", True)):
        return "stock"
    return path


def chunked_loss_reason(trainer, inputs: dict | None = None, return_outputs: bool = False) -> str | None:
    """Why this call keeps the stock loss (None: it takes the chunked path, unless the probe finds a transform)."""
    _, reason = _static_path(trainer)
    if reason is not None:
        return reason
    if return_outputs and not getattr(trainer, "hf_fsdp_qlora_loss_only", False):
        return "the caller asked for the outputs (logits)"
    if inputs is not None and inputs.get("labels") is None and inputs.get("shift_labels") is None:
        return "no labels"
    return None


@contextlib.contextmanager
def _replaced(module, name: str, value):
    """`module.<name>` = `value` for one model call (an instance attribute, restored after).

    ``loss_function`` is a property of transformers' models whose setter keeps the value in ``_loss_function``:
    that instance attribute is the one replaced and restored.
    """
    slot = "_loss_function" if name == "loss_function" else name
    had_own = slot in vars(module)
    original = vars(module).get(slot)
    setattr(module, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(module, slot, original)
        else:
            delattr(module, slot)


def _model_inputs(trainer, inputs: dict, num_items_in_batch) -> dict:
    # What Trainer.compute_loss passes: the labels too, so the model runs its own loss code (MoE router aux loss).
    call = {k: v for k, v in inputs.items() if k != "num_items_in_batch"}
    if trainer.model_accepts_loss_kwargs and num_items_in_batch is not None:
        call["num_items_in_batch"] = num_items_in_batch
    return call


def _probe(trainer, model, inputs: dict) -> str | None:
    """Why the chunked loss would be wrong for this model, found by running it (None: it is right).

    One forward without gradients (random state restored after, so dropout masks stay the stock run's), with the
    head computing the real logits of the first position only and the model's ``loss_function`` recording what it
    receives: the model must call its head and then its ``loss_function`` with those logits unchanged (an equal-valued
    cast allowed). A cap, scale or slice of the logits, under any name, fails the check; so does a loss computed
    without ``loss_function``. Every rank runs the same model and inputs' structure, so every rank decides alike.
    """
    head, causal = _head_of(trainer, model)
    seen: dict = {}
    original = head.forward

    def first_position(hidden_states, *args, **kwargs):
        logits = original(hidden_states[..., :1, :], *args, **kwargs)
        seen.setdefault("logits", logits.detach().clone())
        return logits

    def record(logits, *args, **kwargs):
        seen.setdefault("loss_input", logits.detach().clone())
        return logits.float().sum() * 0

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []  # dropout's generators
    with (
        _replaced(head, "forward", first_position),
        _replaced(causal, "loss_function", record),
        torch.no_grad(),
        torch.random.fork_rng(devices=devices),
    ):
        model(**_model_inputs(trainer, inputs, None))
    if "logits" not in seen:
        return "the model never calls its LM head"
    if "loss_input" not in seen:
        return "the model computes its loss without its `loss_function`"
    got, want = seen["loss_input"], seen["logits"]
    if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
        return "the model transforms its logits between the LM head and the loss (a cap, scale or slice)"
    return None


def compute_loss(trainer, stock, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
    """`Trainer.compute_loss` for our mixin: the chunked loss where it equals the stock one, else `stock` (the next
    class's compute_loss), with the reason logged once per trainer."""
    path, reason = _static_path(trainer)
    if reason is None:
        reason = chunked_loss_reason(trainer, inputs, return_outputs)
        if reason is None:
            decided, key = _decisions(trainer), ("probe", bool(model.training))
            if key not in decided:
                decided[key] = _probe(trainer, model, inputs)
            reason = decided[key]
            if reason is not None:
                _note(trainer, "stock", reason)
        if reason is None:
            return compute_chunked_loss(trainer, model, inputs, return_outputs, num_items_in_batch)
    else:
        _note(trainer, path, reason)
    return stock(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


@contextlib.contextmanager
def loss_only_prediction(trainer, prediction_loss_only):
    """Around `Trainer.prediction_step`: a loss-only evaluation takes the chunked loss; predict() / compute_metrics
    get the model's logits."""
    trainer.hf_fsdp_qlora_loss_only = bool(prediction_loss_only)
    try:
        yield
    finally:
        trainer.hf_fsdp_qlora_loss_only = False


@contextlib.contextmanager
def _fused_head(head, shift_labels, chunk_size, scale, found: dict):
    """Replace `head`'s forward, for one model call, by the chunked loss over its input (see the module docstring)."""
    original = head.forward

    def fused(hidden_states, *args, **kwargs):
        if args or kwargs or found or hidden_states.shape[:-1] != shift_labels.shape:
            return original(hidden_states, *args, **kwargs)  # not the call we expect: behave as the head
        loss, _ = head_loss(original, hidden_states, shift_labels.to(hidden_states.device), chunk_size, scale)
        found["loss"] = loss
        return loss  # returned through the module call, so FSDP's backward hooks attach to it

    with _replaced(head, "forward", fused):
        yield


def _passed_through(found: dict):
    """The model's `loss_function` for one call: the chunked loss that came out of the head, unchanged."""

    def loss_function(logits, *args, **kwargs):
        ours = found.get("loss")
        same = ours is not None and (
            logits is ours or (logits.dim() == 0 and torch.equal(logits.to(ours.dtype), ours))
        )
        if not same:  # the probe passed, so the model treats this batch differently: never return a wrong loss
            raise RuntimeError(
                "hf_fsdp_qlora: the model changed the chunked loss between its LM head and its loss function, so it "
                "would be wrong. Set FSDPQLoRATrainingArguments(chunked_loss=False) for this model."
            )
        return logits  # the tensor that came back through the model carries FSDP's hooks (and any fp32 cast)

    return loss_function


def compute_chunked_loss(trainer, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
    """`Trainer.compute_loss` through the chunked head (call only when :func:`chunked_loss_reason` is None).

    The model is called as the stock Trainer calls it, labels included, with its head replaced by the chunked loss
    and its ``loss_function`` returning that loss: whatever the model adds to its loss (a mixture of experts' router
    auxiliary loss) it adds to ours, in its own code.
    """
    shift_labels = _shift_labels(inputs)
    head, causal = _head_of(trainer, model)
    chunk = int(getattr(trainer.args, "loss_chunk_size", DEFAULT_LOSS_CHUNK_SIZE))
    # transformers' normalisation, known before the forward so the in-forward gradients are scaled like the stock ones
    by_items = trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
    denominator = num_items_in_batch if by_items else shift_labels.ne(IGNORE_INDEX).sum()
    denominator = torch.as_tensor(denominator, device=shift_labels.device).clamp(min=1).float()
    scale = 1.0 / denominator
    found: dict = {}
    with (
        _fused_head(head, shift_labels, chunk, scale, found),
        _replaced(causal, "loss_function", _passed_through(found)),
    ):
        outputs = model(**_model_inputs(trainer, inputs, num_items_in_batch))
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    if "loss" not in found or loss is None:
        raise RuntimeError(
            f"hf_fsdp_qlora: {type(causal).__name__} did not compute its loss through its LM head and loss function "
            "on this batch. Set FSDPQLoRATrainingArguments(chunked_loss=False) for this model."
        )
    if trainer.args.average_tokens_across_devices and by_items:
        # As Trainer.compute_loss: num_items_in_batch counts every rank's tokens, and the gradients are averaged.
        loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
    if isinstance(outputs, dict):
        outputs["logits"] = None
        outputs["loss"] = loss
    return (loss, outputs) if return_outputs else loss
