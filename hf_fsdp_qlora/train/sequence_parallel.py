"""Ulysses sequence parallelism under FSDP: ``sp_size`` ranks share each sequence, each holding 1/sp_size of its
tokens. ``FSDPQLoRATrainingArguments(sp_size=N)`` (accelerate's ``ParallelismConfig`` name; accelerate's own
``sp_backend`` is DeepSpeed only, so the setting lives in our arguments), or, for unchanged scripts run by
``python -m hf_fsdp_qlora.run`` (trl's ``sft.py``), the launcher's setting (:func:`set_launch_sp_size`: the accelerate
config's ``parallelism_config_sp_size`` or ``HF_FSDP_QLORA_SP_SIZE``), given to every trainer the script builds.

The layout: ranks ``[0, sp)``, ``[sp, 2 sp)``, ... form sequence-parallel groups; FSDP still shards the 4-bit base
over every rank. What this module owns, each a function below:

* the refusals, before the first step (:func:`check_sequence_parallel`): heads not divisible by ``sp_size``, an
  attention implementation other than SDPA, sliding-window or linear-attention layers, a world size not divisible;
  a trainer whose own loss the split is not proven with (:func:`_refuse_own_loss`: anything but transformers' causal-LM
  loss and trl's ``SFTTrainer`` loss);
* the setup (:func:`setup_sequence_parallel`): the process groups, the attention function of
  :mod:`hf_fsdp_qlora.train.ulysses` registered and selected;
* the data (:func:`shard_by_group`): the ranks of a group receive the same batches (the sampler shards over the
  ``world / sp_size`` groups, not over ranks; one group's last batch stays partial, as one process's);
* the split (:func:`split_batch`): labels shifted over the whole sequence first, so no target is lost at a shard
  boundary; global position ids (RoPE); the sequence padded to a multiple of ``sp_size`` with ignored targets;
  each rank keeps its contiguous chunk;
* the loss scale (:func:`compute_loss`): each rank's loss is the sum over its tokens divided by the whole batch's
  labelled-token count, times ``sp_size``: FSDP averages gradients over all ranks, and a group's ``sp_size`` ranks
  together hold one sequence, so the factor makes the average over data-parallel groups right for any
  ``sp_size`` up to the world size. trl's ``SFTTrainer`` normalises its loss like transformers' (by
  ``num_items_in_batch``, else its micro-batch's labelled tokens), so the same scale applies to it; its metrics
  (entropy, token accuracy) are sums over tokens and counts gathered over every rank, so they come out whole.
  A loss the Trainer computes from the logits (``compute_loss_func``, label smoothing) gets the whole sequence's
  logits and labels instead; each rank draws its own dropout masks and NEFTune noise
  (:mod:`hf_fsdp_qlora.train.sp_random`). What leaves the model (outputs, a router aux loss, evaluation's results)
  is made whole by :mod:`hf_fsdp_qlora.train.sp_outputs`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import UnsupportedSetupError
from ..sp_rules import local_attention_kinds, sequence_parallel_problem
from . import sp_outputs, sp_random, ulysses

__all__ = [
    "adopt_launch_sp_size",
    "check_sequence_parallel",
    "compute_loss",
    "set_launch_sp_size",
    "setup_sequence_parallel",
    "shard_by_group",
    "split_batch",
]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
_SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")
# trl's padding-free collator describes the packed documents of the whole row for varlen kernels (flash attention's
# cu_seq_lens, linear attention's per-token seq_idx). Neither kernel runs under sp_size (SDPA only; linear-attention
# layers are refused), and the Ulysses attention finds the documents from the global position ids: dropped.
_WHOLE_ROW_ONLY = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_SFT_TRAINER = ("trl.trainer.sft_trainer", "SFTTrainer")  # the one trainer with its own loss proven under sp_size

# The launcher's setting (hf_fsdp_qlora.run): sp_size and the words that name where it came from.
_LAUNCH = {"sp_size": 1, "source": None}


def set_launch_sp_size(sp_size: int, source: str | None = None) -> None:
    """The sp_size ``python -m hf_fsdp_qlora.run`` read (`source` names the setting, for the errors)."""
    _LAUNCH.update(sp_size=int(sp_size), source=source if sp_size > 1 else None)


def setting_name(sp_size: int) -> str:
    """The setting that asked for `sp_size`, as errors name it."""
    if _LAUNCH["source"] and _LAUNCH["sp_size"] == sp_size:
        return _LAUNCH["source"]
    return f"FSDPQLoRATrainingArguments(sp_size={sp_size})"


def adopt_launch_sp_size(args) -> None:
    """Give a trainer's arguments the launcher's sp_size (trl's SFTConfig has no such field), at the start of
    ``Trainer.__init__``, so every reader of ``args.sp_size`` sees it. Refuses a different sp_size > 1 set in the
    script's own arguments, and a trainer built without arguments (its defaults would silently drop the setting)."""
    sp_size, source = _LAUNCH["sp_size"], _LAUNCH["source"]
    if sp_size <= 1:
        return
    if args is None:
        raise UnsupportedSetupError(
            f"{source}: the script builds a Trainer without TrainingArguments, so sequence parallelism could not be "
            "applied to it. Pass args=TrainingArguments(...) (or trl's SFTConfig), or unset the launcher's sp_size."
        )
    own = sp_size_of(args)
    if own > 1 and own != sp_size:
        raise UnsupportedSetupError(
            f"{source}, but the script's arguments say sp_size={own}. Set one of them, or the same value in both."
        )
    args.sp_size = sp_size


def sp_size_of(args) -> int:
    return int(getattr(args, "sp_size", 1) or 1)


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_sequence_parallel(model, sp_size: int, world_size: int) -> str:
    """Refuse what cannot work under ``sp_size`` (before the first step). Returns the attention implementation.

    Raises:
        UnsupportedSetupError: naming the setting and what to use instead.
    """
    config = _text_config(model)
    impl = getattr(config, "_attn_implementation", None)
    found = sequence_parallel_problem(
        sp_size, world_size, getattr(config, "num_attention_heads", None), impl, local_attention_kinds(config),
        getattr(config, "sliding_window", None), wrapped_attention=ulysses.ATTENTION_NAME,
    )  # fmt: skip
    if found is not None:  # the doctor says the same before launch (rule sequence-parallel-refused)
        raise UnsupportedSetupError(f"{setting_name(sp_size)}{found.problem} {found.fix}")
    return impl


def _select_attention(model, sp_size: int) -> None:
    """The model's attention implementation set to the Ulysses function, or a refusal if the model cannot take it."""
    model.set_attn_implementation(ulysses.register_ulysses_attention())
    if _text_config(model)._attn_implementation != ulysses.ATTENTION_NAME:  # transformers only warns
        raise UnsupportedSetupError(
            f"{setting_name(sp_size)}: {type(model).__name__} does not take its attention "
            "function from transformers' attention interface, so the sequence-parallel attention would never run. "
            "Train this model with sp_size=1."
        )


def _own_loss_owner(trainer) -> type | None:
    """The class between our mixin and transformers.Trainer that defines compute_loss (None: transformers')."""
    from transformers import Trainer

    from .loss import _after_mixin

    for cls in _after_mixin(trainer):
        if "compute_loss" in vars(cls):
            return None if cls is Trainer else cls
    return None


def _sft_loss_refusal(trainer) -> str | None:
    """What makes trl's SFTTrainer compute a loss the split would get wrong (None: its default token loss).

    Read per batch: trl sets some of these after ``Trainer.__init__`` created the accelerator (and the groups)."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func (it gets one rank's logits and the whole sequence's labels)"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label_smoothing_factor > 0 (trl smooths over the full logits)"
    if getattr(trainer, "aux_loss_enabled", False):
        return "a mixture-of-experts router auxiliary loss (a mean over each rank's tokens, not additive)"
    if getattr(trainer.args, "use_liger_kernel", False):
        return "use_liger_kernel=True (Liger's fused loss sees one rank's tokens only)"
    return None


def _refuse_own_loss(trainer, sp_size: int) -> None:
    """Refuse a trainer with its own loss unless it is trl's SFTTrainer's token loss, which the split is proven with.

    Raises:
        UnsupportedSetupError: naming the trainer (or its setting) and what to use instead.
    """
    owner = _own_loss_owner(trainer)
    if owner is None:
        return
    if (owner.__module__, owner.__name__) != _SFT_TRAINER:
        raise UnsupportedSetupError(
            f"{setting_name(sp_size)} with {owner.__name__}, which computes its own loss: the sequence split and its "
            "loss scale are proven with transformers' causal-LM loss (FSDPQLoRATrainer) and trl's SFTTrainer only. "
            "Use one of those, or sp_size=1."
        )
    why = _sft_loss_refusal(trainer)
    if why is not None:
        raise UnsupportedSetupError(
            f"{setting_name(sp_size)} with SFTTrainer and {why}: under sequence parallelism SFTTrainer's own token "
            "loss is supported only. Drop that setting, or use sp_size=1."
        )


def _refuse_gather_object(args, sp_size: int) -> None:
    if getattr(args, "eval_use_gather_object", False):
        raise UnsupportedSetupError(
            f"{setting_name(sp_size)} with eval_use_gather_object=True: evaluation keeps one rank of each "
            "sequence-parallel group from gathered tensors, which Python objects gathered per rank do not allow. Set "
            "eval_use_gather_object=False, or use sp_size=1."
        )


def setup_sequence_parallel(trainer) -> ulysses.UlyssesGroup | None:
    """Check, create the groups and select the Ulysses attention; before accelerate wraps the model. Collective."""
    sp_size = sp_size_of(trainer.args)
    if sp_size <= 1:
        ulysses.set_active_group(None)
        return None
    _refuse_own_loss(trainer, sp_size)
    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedSetupError(
            f"{setting_name(sp_size)} in a single process: launch sp_size or more processes "
            "(torchrun / accelerate launch --num_processes)."
        )
    from .checkpoint import unwrap_peft_model

    model = unwrap_peft_model(trainer.model) or trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    impl = check_sequence_parallel(base, sp_size, dist.get_world_size())
    _refuse_gather_object(trainer.args, sp_size)
    sp_outputs.check_router_aux(base, setting_name(sp_size))
    sp_outputs.install_output_hook(base)  # whole outputs and router aux loss (train/sp_outputs.py)
    group, sp_rank, dp_index = ulysses.new_groups(sp_size)
    inner = impl if impl != ulysses.ATTENTION_NAME else "sdpa"
    state = ulysses.UlyssesGroup(sp_size=sp_size, group=group, inner=inner, sp_rank=sp_rank, dp_index=dp_index)
    _select_attention(base, sp_size)
    ulysses.set_active_group(state)
    logger.info(
        "hf_fsdp_qlora: sequence parallelism: sp_size=%d (this rank: token chunk %d of group %d), Ulysses around %s",
        sp_size,
        sp_rank,
        dp_index,
        inner,
    )
    return state


def shard_by_group(loader, sp_size: int):
    """Make the ranks of a sequence-parallel group draw the same batches (accelerate's sampler shards by rank)."""
    sampler = getattr(loader, "batch_sampler", None)
    if sp_size <= 1 or sampler is None or not hasattr(sampler, "process_index"):
        if sp_size > 1:
            raise UnsupportedSetupError(
                f"{setting_name(sp_size)} with a {type(loader).__name__} whose batches accelerate "
                "does not shard by a batch sampler (an IterableDataset or dispatch_batches=True): the ranks of a group "
                "must see the same batches. Pass a map-style Dataset (with __len__)."
            )
        return loader
    groups = dist.get_world_size() // sp_size
    sampler.num_processes = groups
    sampler.process_index = dist.get_rank() // sp_size
    if groups == 1:
        # accelerate completes a last, partial batch with samples from the start so that every process has as many
        # batches (even_batches); one group needs none, and one process's last batch is partial: a partial batch's
        # mean loss counts its own samples only, as with one process.
        sampler.even_batches = False
    return loader


def _refuse_padding(inputs: dict, sp_size: int) -> None:
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise UnsupportedSetupError(
            f"{setting_name(sp_size)} with a padded batch (attention_mask has zeros): the "
            "sequence-parallel attention builds the whole sequence's causal mask itself. Use padding-free batches "
            "(trl padding_free=True / packing, transformers DataCollatorWithFlattening) or equal-length samples."
        )
    length = inputs["input_ids"].shape[-1]
    for key, value in inputs.items():
        sequence_shaped = torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == length
        if sequence_shaped and key not in _SEQUENCE_KEYS + _WHOLE_ROW_ONLY:
            raise UnsupportedSetupError(
                f"{setting_name(sp_size)}: the batch has a per-token input {key!r} the "
                "sequence split does not know how to cut. Drop it from the collator's output or use sp_size=1."
            )


def split_batch(inputs: dict, sp_size: int, sp_rank: int) -> tuple[dict, torch.Tensor | None, torch.Tensor]:
    """(this rank's chunk of every sequence (see the module docstring), the global position ids when packed, the
    batch's labelled-token count).

    The labels are shifted over the whole sequence before the split and passed as ``shift_labels`` (and as
    ``labels``, so the model computes its loss; transformers' loss never shifts given shift_labels).
    """
    _refuse_padding(inputs, sp_size)
    ids = inputs["input_ids"]
    batch, length = ids.shape
    if inputs.get("shift_labels") is not None:
        shift = inputs["shift_labels"]
    else:
        shift = F.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
    given = inputs.get("position_ids")
    positions = torch.arange(length, device=ids.device) if given is None else given
    positions = positions.expand(batch, length)
    # transformers' rule (masking_utils): position ids describe packed sequences only without an attention mask
    packed = given is not None and inputs.get("attention_mask") is None and bool(ulysses.document_ids(positions).any())
    pad = -length % sp_size  # pad tokens go last: with a causal mask no real token attends to them
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        shift = F.pad(shift, (0, pad), value=IGNORE_INDEX)
        tail = positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)
        positions = torch.cat([positions, tail], dim=-1)
    chunk = (length + pad) // sp_size
    piece = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    local = {k: v for k, v in inputs.items() if k not in _SEQUENCE_KEYS + _WHOLE_ROW_ONLY}
    local.update(input_ids=ids[:, piece].contiguous(), position_ids=positions[:, piece].contiguous())
    mine = shift[:, piece].contiguous()  # transformers' loss views it flat
    local.update(labels=mine, shift_labels=mine)
    return local, (positions if packed else None), shift.ne(IGNORE_INDEX).sum()


def compute_loss(trainer, inner, model, inputs, return_outputs=False, num_items_in_batch=None):
    """`Trainer.compute_loss` under sequence parallelism: split, then `inner` (our chunked or the stock loss), scaled.

    FSDP averages gradients over all W ranks; a group's sp ranks hold one sequence, so each rank's loss must be
    sp x (its tokens' loss sum) / (labelled tokens of the batch it shares). The three cases of the Trainer:
    num_items_in_batch summed over every rank (average_tokens_across_devices) counts each sequence sp times, so it is
    divided by sp; num_items_in_batch of this rank alone counts its group's batch, so the loss is multiplied by sp;
    no num_items_in_batch (a mean per micro-batch), the local mean is rescaled to sp x sum / the batch's count.
    A loss computed by the Trainer from the logits (a compute_loss_func, label smoothing) gets the whole sequence's
    logits instead (:func:`hf_fsdp_qlora.train.sp_outputs.whole_logits_loss`).
    """
    state = ulysses.active_group()
    if state is None:
        return inner(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
    sp = state.sp_size
    _refuse_own_loss(trainer, sp)
    local, state.global_position_ids, count = split_batch(inputs, sp, state.sp_rank)
    state.length = inputs["input_ids"].shape[-1]
    averaged = num_items_in_batch is not None and trainer.args.average_tokens_across_devices
    if averaged:
        num_items_in_batch = num_items_in_batch // sp
    if sp_outputs.takes_logits(trainer) and inputs.get("labels") is not None:
        with sp_random.forward_draws(trainer, model, state):
            return sp_outputs.whole_logits_loss(
                trainer, inner, model, inputs, local, return_outputs, num_items_in_batch
            )
    if num_items_in_batch is not None:
        scale = 1.0 if averaged else float(sp)
    else:
        local_count = local["shift_labels"].ne(IGNORE_INDEX).sum()
        scale = sp * local_count.clamp(min=1).float() / count.clamp(min=1).float()
    # The model's router aux loss is recomputed over the whole sequence (train/sp_outputs.py) and divided by what
    # multiplies the model's loss here, so the group's ranks together add it once, as one process does.
    state.aux_divisor = float(sp) if num_items_in_batch is not None else scale
    # The global positions stay set after the call: an activation-checkpointed layer recomputes its attention in
    # backward, and needs the same mask; the next batch's split replaces them.
    with sp_random.forward_draws(trainer, model, state):
        result = inner(model, local, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
    if return_outputs:
        return result[0] * scale, result[1]
    return result * scale
