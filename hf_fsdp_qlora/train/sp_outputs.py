"""What leaves the model under sequence parallelism, made what one process gives: the model's outputs, its router
aux loss, and evaluation's losses and predictions.

Each rank of a sequence-parallel group runs the model on its chunk of every sequence
(:mod:`hf_fsdp_qlora.train.sequence_parallel`), so whatever the model returns per token is a chunk, and whatever it
computes over all tokens at once is this chunk's. Three things follow, each a function below:

* the outputs (:func:`_whole_outputs`): when asked (predictions, a loss the Trainer computes from the logits:
  :func:`whole_logits_loss`), the sequence-shaped outputs (logits, hidden states, router logits) are gathered along
  the sequence from the group;
* the router aux loss of a mixture of experts (:func:`_whole_router_aux`): a load-balancing loss is a product of two
  means over every token, not a sum over tokens, so each rank's chunk gives a different one. It is recomputed by the
  model's own ``load_balancing_loss_func`` from the router logits gathered over the group, replacing the chunk's in
  the model's loss (divided by the split's loss scale, so the group adds it once);
* evaluation (:func:`prediction_step`, :func:`group_gather`): every rank of a group returns the group's whole loss
  and outputs, and the Trainer's gather over all ranks keeps one rank per group, so its remainder trimming (the last,
  partial batch) counts samples, as with one process.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..errors import UnsupportedSetupError
from ..sp_rules import router_aux_kind, router_aux_problem
from . import ulysses

__all__ = [
    "check_router_aux",
    "group_gather",
    "install_output_hook",
    "prediction_step",
    "takes_logits",
    "whole_logits_loss",
]

_HOOK = "_hf_fsdp_qlora_sp_outputs_hook"


def _balancing_loss(model):
    """The model family's ``load_balancing_loss_func`` (transformers defines one per mixture-of-experts module)."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def _router_settings(model) -> tuple:
    """(experts, experts per token, aux coefficient): the model's attributes, else its text config's."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def first(*names):
        found = (getattr(model, n, None) for n in names)
        found = next((v for v in found if v is not None), None)
        return found if found is not None else next((getattr(config, n) for n in names if hasattr(config, n)), None)

    return first("num_experts", "num_local_experts"), first("num_experts_per_tok"), first("router_aux_loss_coef")


def check_router_aux(model, setting: str) -> None:
    """Refuse, before the first step, a router aux loss this module cannot recompute over the whole sequence (the
    rule is :func:`hf_fsdp_qlora.sp_rules.router_aux_problem`, the doctor's too).

    Raises:
        UnsupportedSetupError: naming output_router_logits and what to use instead.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    asked = bool(getattr(config, "output_router_logits", False))
    kind = router_aux_kind(type(model))
    if kind == "balancing" and asked and None in _router_settings(model):
        kind = "other"  # no experts count, top-k or coefficient to call it with
    found = router_aux_problem(type(model).__name__, asked, kind)
    if found is not None:
        raise UnsupportedSetupError(f"{setting}{found.problem} {found.fix}")


def install_output_hook(model) -> None:
    """Register (once per model) the forward hook that makes the outputs whole under sequence parallelism."""
    old = getattr(model, _HOOK, None)
    if old is not None:
        old.remove()
    setattr(model, _HOOK, model.register_forward_hook(_after_forward))


def _after_forward(model, args, output):
    state = ulysses.active_group()
    if state is None or state.length is None or not hasattr(output, "keys"):
        return output
    router = getattr(output, "router_logits", None)
    if router is not None and getattr(output, "aux_loss", None) is not None:
        _whole_router_aux(model, output, state)
    elif router is not None and state.gather_outputs:  # router logits without an aux loss, for predictions
        output.router_logits = tuple(_whole_rows(layer, state) for layer in router)
    if state.gather_outputs:
        _whole_outputs(output, state)
    return output


def _chunk(state) -> int:
    return (state.length + (-state.length % state.sp_size)) // state.sp_size


def _whole_rows(rows: torch.Tensor, state) -> torch.Tensor:
    """One layer's router logits, [batch x chunk, experts] (or [batch, chunk, experts]), as [batch x length,
    experts]: the rows of the whole sequence, in one process's order."""
    chunk, experts = _chunk(state), rows.shape[-1]
    per_token = rows.dim() == 2 and rows.shape[0] % chunk == 0 or rows.dim() == 3 and rows.shape[1] == chunk
    if not per_token:
        raise RuntimeError(
            f"hf_fsdp_qlora: router logits of shape {tuple(rows.shape)} are not per token of this rank's {chunk}-token "
            "chunk, so the router aux loss cannot be made whole. Set output_router_logits=False, or use sp_size=1."
        )
    whole = ulysses.gather_sequence(rows.reshape(-1, chunk, experts), state)
    return whole.reshape(-1, experts)


def _whole_router_aux(model, output, state) -> None:
    """Replace the chunk's router aux loss by the whole sequence's, in `output.aux_loss` and in `output.loss`."""
    balancing = _balancing_loss(model)
    experts, top_k, coef = _router_settings(model)
    logits = tuple(output.router_logits)
    mine = balancing(logits, experts, top_k, None)
    if not torch.allclose(mine.float(), output.aux_loss.float(), rtol=1e-5, atol=1e-7):  # never a wrong loss
        raise RuntimeError(
            f"hf_fsdp_qlora: {type(model).__name__}'s router aux loss is not load_balancing_loss_func(router_logits, "
            "num_experts, num_experts_per_tok), so it cannot be recomputed over the whole sequence under sp_size. "
            "Set output_router_logits=False in the model's config, or use sp_size=1."
        )
    whole = tuple(_whole_rows(layer, state) for layer in logits)
    aux = balancing(whole, experts, top_k, None)
    if output.loss is not None:  # the model added coef x the chunk's aux loss: take it out, add the whole's share
        output.loss = output.loss + coef * (aux / state.aux_divisor - output.aux_loss).to(output.loss.device)
    output.aux_loss = aux
    if state.gather_outputs:
        output.router_logits = whole


def _whole_outputs(output, state) -> None:
    """The sequence-shaped outputs ([batch, chunk, ...] tensors, alone or in tuples) gathered along the sequence."""
    chunk = _chunk(state)

    def whole(value):
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == chunk:
            return ulysses.gather_sequence(value, state)
        if isinstance(value, tuple):
            return tuple(whole(v) for v in value)
        return value

    for key in list(output.keys()):
        if key not in ("loss", "aux_loss", "router_logits", "past_key_values"):
            output[key] = whole(output[key])


def takes_logits(trainer) -> bool:
    """The Trainer computes the loss from the model's logits and the labels it pops before the forward."""
    return trainer.compute_loss_func is not None or getattr(trainer, "label_smoother", None) is not None


def whole_logits_loss(trainer, inner, model, inputs, local, return_outputs, num_items_in_batch):
    """A compute_loss_func or label smoothing: the Trainer shifts the labels itself and normalises as it likes, so it
    gets what one process gives it: the whole batch's labels and logits (gathered along the sequence from the group by
    :func:`_whole_outputs`). Every rank of the group computes the same loss; the gather's backward sums the group's
    gradients, so FSDP's average over the group's ranks is the one-process gradient."""
    state = ulysses.active_group()
    local = {k: v for k, v in local.items() if k != "shift_labels"}
    local["labels"] = inputs["labels"]  # popped by Trainer.compute_loss before the forward: the model computes none
    previous, state.gather_outputs = state.gather_outputs, True
    try:
        result = inner(model, local, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
    finally:
        state.gather_outputs = previous
    multiplied = (
        trainer.args.average_tokens_across_devices
        and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
        and num_items_in_batch is not None
    )
    if not multiplied:
        return result
    # Trainer.compute_loss multiplied by the number of processes, and the group's sp ranks each hold the whole loss.
    sp = state.sp_size
    return (result[0] / sp, result[1]) if return_outputs else result / sp


def prediction_step(trainer, stock, model, inputs, prediction_loss_only, ignore_keys=None, setting=""):
    """`Trainer.prediction_step` under sequence parallelism: the loss is the group's (the mean over its ranks of their
    scaled shares: :func:`hf_fsdp_qlora.train.sequence_parallel.compute_loss`), and the outputs are whole. `setting`
    names the sp_size setting, for the refusal."""
    state = ulysses.active_group()
    if state is None:
        return stock(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
    names = trainer.label_names or []
    if not names or any(inputs.get(name) is None for name in names):
        raise UnsupportedSetupError(
            f"{setting}: evaluate()/predict() on a batch without labels ({names or 'no label_names'}): the sequence is "
            "split where the loss is computed, so the model would run on whole sequences. Give the evaluation dataset "
            "labels, or evaluate with sp_size=1."
        )
    previous, state.gather_outputs = state.gather_outputs, not prediction_loss_only
    try:
        loss, logits, labels = stock(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
    finally:
        state.gather_outputs = previous
    if loss is not None:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=state.group)
        loss = loss / state.sp_size
    return loss, logits, labels


def group_gather(trainer):
    """The Trainer's ``gather_function`` for one evaluation: every rank's tensors gathered, one rank per group kept
    (its ranks hold the same whole results), and the last batch trimmed to its samples as ``gather_for_metrics``
    does (the dataloader, sharded over groups, counts the remainder over groups)."""
    from accelerate.utils import recursively_apply

    accelerator, sp = trainer.accelerator, ulysses.active_group().sp_size

    def one_per_group(tensor):
        if tensor.dim() == 0:
            return tensor
        rows = tensor.reshape(-1, sp, tensor.shape[0] // accelerator.num_processes, *tensor.shape[1:])
        return rows[:, 0].reshape(-1, *tensor.shape[1:])

    def gather(data, use_gather_object=False):
        data = recursively_apply(one_per_group, accelerator.gather(data))
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[: state.remainder], data)
        return data

    return gather
