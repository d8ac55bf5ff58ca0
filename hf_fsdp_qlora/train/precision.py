"""What the optimizer steps: float32 master weights for the trainable tensors of an adapter run.

A bf16 weight has 8 bits of mantissa, so an Adam step smaller than half a unit in its last place is rounded away:
with bf16 adapters, lora_A's update after 8 steps at lr 1e-5 differed from stock peft's (fp32 adapters) by 0.99
relative, and DoRA's magnitudes (order 1) never moved. The trainable tensors (LoRA A/B, DoRA magnitudes, expert
LoRA, ``modules_to_save``, trained embeddings) are therefore kept in float32 - as FSDP's sharded parameters, so the
optimizer, its states, checkpoints and the saved adapter are float32 - while the frozen base keeps the one training
dtype (the 4-bit storage dtype, see :mod:`hf_fsdp_qlora.dtypes`) and the compute stays in that dtype:

* FSDP2 requires one dtype among the *trainable* parameters of a ``fully_shard`` group, not among all of them, so
  fp32 adapters share their decoder layer's group with the bf16 base. ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` gathers the adapters cast to bf16 (the bf16 base is not cast: its packed bytes are gathered
  as stored) and reduce-scatters their gradients in fp32. No new group, no new collective.
* FSDP1 needs one dtype per FlatParameter; transformers' Trainer installs peft's auto-wrap policy, which already
  makes every leaf module with a trainable weight (each lora_A / lora_B Linear, each DoRA magnitude) a unit of its
  own, so the fp32 adapters are alone in their units. ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``.
* No FSDP: fp32 adapters, as stock peft (``autocast_adapter_dtype=True``); autocast or peft's input cast computes.

Measured (tiny Llama, NF4, LoRA r=4 q/v, 2 ranks, 8 steps, bf16): the update equals single-process stock peft with
the same micro-batches bit for bit under FSDP1 and FSDP2 (docs in /work/notes/fp32_design.md).

``adapter_dtype="bfloat16"`` (FSDPQLoRATrainingArguments; ``HF_FSDP_QLORA_ADAPTER_DTYPE`` under
``-m hf_fsdp_qlora.run``) opts out: adapters in the training dtype, as torchtune's pure-bf16 recipes.
"""

from __future__ import annotations

import torch

from ..dtypes import resolve_dtype

__all__ = [
    "ADAPTER_DTYPE_CHOICES",
    "DEFAULT_ADAPTER_DTYPE",
    "adapter_dtype_for",
    "is_adapter_run",
    "keep_lora_inputs_in_compute_dtype",
    "keep_shared_unit_trainables_in",
    "keep_trainable_in_adapter_dtype",
    "prepare_fsdp1_float32_units",
    "reduce_every_micro_batch",
    "set_launch_adapter_dtype",
]

DEFAULT_ADAPTER_DTYPE = "float32"
ADAPTER_DTYPE_CHOICES = ("float32", "bfloat16", "float16")

# Set only by the launcher edge (`-m hf_fsdp_qlora.run` reads HF_FSDP_QLORA_ADAPTER_DTYPE); arguments win over it.
_launch_adapter_dtype: str | None = None


def check_adapter_dtype_name(name: str) -> str:
    """`name` if it is one of :data:`ADAPTER_DTYPE_CHOICES` (aliases like "bf16" accepted), else a ValueError."""
    try:
        dtype = resolve_dtype(name)
    except ValueError:
        dtype = None
    if dtype is None:
        raise ValueError(
            f"adapter_dtype={name!r} is not supported: use 'float32' (default: fp32 master weights, as stock peft) "
            "or 'bfloat16' / 'float16' (the training dtype: pure 16-bit adapters, small updates are rounded away)."
        )
    return str(dtype).removeprefix("torch.")


def set_launch_adapter_dtype(name: str | None) -> None:
    """The adapter dtype for trainers whose arguments do not say (stock TrainingArguments, trl's configs)."""
    global _launch_adapter_dtype
    _launch_adapter_dtype = None if name is None else check_adapter_dtype_name(name)


def adapter_dtype_for(args, training_dtype: torch.dtype) -> torch.dtype:
    """The dtype the trainable tensors are kept and stepped in: `args.adapter_dtype`, else the launcher's, else fp32.

    Raises:
        ValueError: for a 16-bit adapter dtype other than the training dtype (FSDP could not keep its units uniform).
    """
    name = getattr(args, "adapter_dtype", None) or _launch_adapter_dtype or DEFAULT_ADAPTER_DTYPE
    dtype = resolve_dtype(check_adapter_dtype_name(name))
    if dtype != torch.float32 and dtype != training_dtype:
        raise ValueError(
            f"adapter_dtype={name!r} but this model trains in {training_dtype} (its 4-bit storage / compute dtype). "
            f"Use adapter_dtype='float32' (default) or '{str(training_dtype).removeprefix('torch.')}'."
        )
    return dtype


def is_adapter_run(model) -> bool:
    """True for a peft model: the rule applies to adapters; a full fine-tune keeps the dtype it was loaded in."""
    from .checkpoint import unwrap_peft_model

    return unwrap_peft_model(model) is not None


@torch.no_grad()
def keep_trainable_in_adapter_dtype(model, args=None) -> list[str]:
    """Without FSDP: cast an adapter run's trainable floating tensors to the adapter dtype; frozen ones stay as they
    are. (Under FSDP, :func:`~hf_fsdp_qlora.train.consistency.make_fsdp_consistent` does this with the rest.)

    Returns:
        The names of the parameters cast.
    """
    from ..dtypes import training_dtype

    if not is_adapter_run(model):
        return []
    dtype = adapter_dtype_for(args, training_dtype(model))
    changed = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            changed.append(name)
    return changed


def keep_lora_inputs_in_compute_dtype(model) -> int:
    """FSDP1 with fp32 LoRA units: turn off peft's cast of each LoRA layer's input to ``lora_A.weight.dtype``.

    peft reads that dtype *outside* the lora_A unit (without CUDA autocast, i.e. on CPU or with ``bf16=False``),
    where FSDP1 shows either the fp32 sharded view or, once the unit is unsharded (a backward prefetch in the
    recomputation of activation checkpointing), the bf16 gathered weight. So the forward saved fp32 dropout inputs
    and the recomputation made bf16 ones: "CheckpointError: ... Recomputed values ... have different metadata"
    (reproduced with ``backward_prefetch=BACKWARD_PRE``, the shipped FSDP1 config, and not without it). Every fp32
    unit casts its own inputs to the compute dtype instead (``MixedPrecision(cast_forward_inputs=True)``, see
    :func:`~hf_fsdp_qlora.train.fsdp.configure_plugin`), the same values either way. ``cast_input_dtype_enabled`` is
    peft's public switch (``peft.helpers.disable_input_dtype_casting``).

    Returns:
        The number of LoRA layers changed.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "cast_input_dtype_enabled", False) and hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = False
            changed += 1
    return changed


def prepare_fsdp1_float32_units(model, version: int, adapter_dtype: torch.dtype, training_dtype: torch.dtype):
    """FSDP1 with adapters in a dtype other than the base's (float32 master weights): the one step that keeps every
    FlatParameter uniform and every fp32 unit's compute in `training_dtype`. Nothing to do otherwise.

    1. trainable tensors without a unit of their own stay in `training_dtype` (:func:`keep_shared_unit_trainables_in`);
    2. peft's cast of each LoRA input to ``lora_A.weight.dtype`` is turned off: each fp32 unit casts its own inputs
       (:func:`keep_lora_inputs_in_compute_dtype`);
    3. gradient accumulation reduces every micro-batch (:func:`reduce_every_micro_batch`).

    Returns:
        The names of the parameters cast.
    """
    if version != 1 or adapter_dtype == training_dtype:
        return []
    cast = keep_shared_unit_trainables_in(model, training_dtype)
    keep_lora_inputs_in_compute_dtype(model)
    reduce_every_micro_batch()
    return cast


def reduce_every_micro_batch() -> None:
    """FSDP1 with float32 adapters: gradient accumulation reduce-scatters each micro-batch's gradients (accelerate's
    ``sync_each_batch``, which transformers' Trainer reads) instead of skipping the reduction under ``no_sync``.

    Under ``no_sync`` FSDP1 keeps a micro-batch's unsharded gradient in the compute dtype (bf16) and adds the next
    one to it there, where one process accumulates its fp32 adapters' ``.grad`` in fp32: peft's FSDP+QLoRA recipe
    (gradient accumulation 2) ended 1.9e-3 (lora_A) from the one-process update. Reduced every micro-batch, the fp32
    sharded gradient accumulates them (equal to one process, tests/test_peft_recipe.py). The cost is one
    reduce-scatter of the trainable units per micro-batch (the adapters: frozen units have no gradient), and less
    memory (no unsharded gradient kept between micro-batches). ``accelerator_config={"gradient_accumulation_kwargs":
    {"sync_each_batch": True}}`` is the user-facing form of the same setting.
    """
    from accelerate.state import GradientState

    state = GradientState()
    state.plugin_kwargs = {**state.plugin_kwargs, "sync_each_batch": True}


def _has_unit_of_its_own(module) -> bool:
    """peft's FSDP1 wrap rule (``fsdp_auto_wrap_policy``, installed by transformers' Trainer): a leaf module whose
    ``weight`` is trainable is a unit of its own - each lora_A / lora_B Linear, DoRA magnitude, modules_to_save copy."""
    weight = getattr(module, "weight", None)
    return next(module.children(), None) is None and weight is not None and weight.requires_grad


@torch.no_grad()
def keep_shared_unit_trainables_in(model, dtype: torch.dtype) -> list[str]:
    """FSDP1 with float32 adapters: cast the trainable tensors that have no unit of their own to `dtype`.

    A trainable tensor outside peft's per-leaf units is flattened with its unit's frozen `dtype` tensors: peft's
    trainable tokens (``trainable_token_indices``: a ``trainable_tokens_delta`` beside the frozen embedding) would
    fail "Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32". They stay in the training
    dtype; with mixed precision on (``bf16=True``) accelerate upcasts every trainable FlatParameter to float32 after
    wrapping, so the optimizer still steps them in float32 there. FSDP2 keeps them float32 (one dtype per group is
    required among the trainable parameters only).

    Returns:
        The names of the parameters cast.
    """
    changed = []
    for module_name, module in model.named_modules():
        if _has_unit_of_its_own(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                changed.append(f"{module_name}.{name}" if module_name else name)
    if changed:
        import logging

        logging.getLogger(__name__).warning(
            "hf_fsdp_qlora: under FSDP1, %d trainable tensors share an FSDP unit with frozen %s weights (e.g. %s, "
            "trainable tokens) and are kept in %s, not float32 (float32 again after wrapping when mixed precision "
            "is on, bf16=True). FSDP2 (fsdp_version: 2) keeps them float32.",
            len(changed),
            dtype,
            changed[0],
            dtype,
        )
    return changed
