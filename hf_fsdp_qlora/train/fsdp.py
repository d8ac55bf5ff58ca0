"""What we set on accelerate's FSDP plugin, and "did FSDP engage?". (What we refuse before wrapping lives
with the doctor's rules, :mod:`hf_fsdp_qlora.doctor._rules`, so the CLI and the trainer share one source.)"""

from __future__ import annotations

import logging

import torch

from ..errors import FSDPNotEngagedError, UnsupportedSetupError
from .dora import size_dora_identity_from_layer

__all__ = [
    "assert_fsdp_engaged",
    "configure_plugin",
    "fsdp_engagement",
    "fsdp_unit_kinds",
    "fsdp_version",
    "gather_every_unit_once",
    "guard_sharded_merge",
    "match_amp_forward",
    "skip_frozen_embedding_backward_gather",
]

logger = logging.getLogger(__name__)


def fsdp_version(plugin) -> int:
    return int(getattr(plugin, "fsdp_version", 1) or 1)


def _mixed_precision_policy(version: int, dtype: torch.dtype, reduce_dtype: torch.dtype | None = None):
    # reduce_dtype: the trainable tensors' dtype (float32 master weights, train/precision.py): their gradients
    # are reduced in it, as a single process accumulates them in the fp32 .grad of fp32 adapters.
    reduce_dtype = dtype if reduce_dtype is None else reduce_dtype
    if version == 1:
        from torch.distributed.fsdp import MixedPrecision

        # buffer_dtype=None keeps buffers (rotary inv_freq) in their own dtype: FSDP1 would cast them
        # to bf16 and shift every output by ~1e-3 relative to an unsharded run.
        # cast_forward_inputs: every fp32 lora_A / lora_B is a unit of its own, and peft casts the layer input to
        # `lora_A.weight.dtype` read outside that unit (the fp32 shard): the unit casts it back to `dtype`, or the
        # matmul fails without autocast ("expected m1 and m2 to have the same dtype").
        return MixedPrecision(
            param_dtype=dtype, reduce_dtype=reduce_dtype, buffer_dtype=None, cast_forward_inputs=reduce_dtype != dtype
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # No output_dtype: casting the model's outputs would round the fp32 loss transformers computes to bf16.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)


def match_amp_forward(model, mixed_precision: str | None = None) -> bool:
    """Under FSDP2, wrap `model`'s forward as accelerate does for DDP and FSDP1 when mixed precision is on.

    With ``bf16=True`` / ``fp16=True`` (trl's DPO/ORPO/CPO configs default to bf16), accelerate's
    ``prepare_model`` runs the DDP and FSDP1 model's forward under autocast and converts its floating outputs
    to fp32 (``convert_outputs_to_fp32``); its FSDP2 path skips both. A trainer then sees bf16 logits under
    FSDP2 and fp32 logits elsewhere, and losses computed from them differ (CPO's step-1 margin -0.039
    under FSDP2 against -0.028 under DDP and FSDP1). FSDP2's ``MixedPrecisionPolicy(output_dtype=...)`` is no
    substitute: the policy applies to every wrapped layer, not only the model's outputs, and a bf16
    output dtype would round the fp32 loss transformers computes. So the same wrap accelerate uses elsewhere
    is applied here, before wrapping (FSDP2 keeps the module object and calls its forward between its hooks).
    Upcasting bf16 logits to fp32 is exact; an fp32 loss passes unchanged.

    Args:
        model: the model about to be wrapped by FSDP2.
        mixed_precision: accelerate's setting ("no", "bf16", "fp16"); default: the current AcceleratorState's.

    Returns:
        True when the forward was wrapped.
    """
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.modeling import get_mixed_precision_context_manager

    if mixed_precision is None:
        from accelerate.state import AcceleratorState

        mixed_precision = getattr(AcceleratorState(), "mixed_precision", "no")
    if mixed_precision not in ("bf16", "fp16") or getattr(model, "_original_forward", None) is not None:
        return False
    # As accelerate's Accelerator.prepare_model, so unwrap_model(keep_fp32_wrapper=False) restores it too.
    model._original_forward = model.forward
    autocast = get_mixed_precision_context_manager(True)
    if not hasattr(model.forward, "__func__"):
        model.forward = convert_outputs_to_fp32(autocast(model.forward))
    else:
        model.forward = MethodType(autocast(model.forward.__func__), model)
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    return True


def configure_plugin(plugin, model, dtype: torch.dtype, reduce_dtype: torch.dtype | None = None) -> list[str]:
    """Make accelerate's FSDP plugin agree with the model's one training dtype.

    * mixed precision ``param_dtype`` = the 4-bit storage dtype: any other param_dtype casts the packed 4-bit
      bytes and corrupts the weights; ``reduce_dtype`` = the trainable tensors' dtype (`reduce_dtype`, float32 by
      default: :mod:`hf_fsdp_qlora.train.precision`). transformers sets this under
      FSDP1 only (and casts buffers too); under FSDP2 nothing does. Later calls of
      ``plugin.set_mixed_precision`` (transformers' ``update_fsdp_plugin_peft``) are routed to the same
      rule, so the policy cannot be undone between here and wrapping;
    * FSDP1: ``use_orig_params=True``, because a unit that holds frozen base weights and trainable
      adapters fails with "Must flatten tensors with uniform requires_grad when use_orig_params=False";
    * FSDP1 with DoRA: DoRA's layers size their identity matrix from ``lora_A``'s layer, not from its weight,
      which is a flat shard outside its own unit (:mod:`hf_fsdp_qlora.train.dora`).

    Returns:
        Human-readable notes of what was changed, for the log.
    """
    version = fsdp_version(plugin)
    notes = []
    policy = _mixed_precision_policy(version, dtype, reduce_dtype)
    old = plugin.mixed_precision_policy
    if getattr(old, "param_dtype", None) != dtype:
        old_dtype = getattr(old, "param_dtype", None)
        notes.append(f"FSDP mixed precision param_dtype {old_dtype} -> {dtype} (the 4-bit or 8-bit storage dtype)")
    plugin.mixed_precision_policy = policy

    def set_mixed_precision(mixed_precision, buffer_autocast=False, override=False):
        plugin.mixed_precision_policy = _mixed_precision_policy(version, dtype, reduce_dtype)

    # An instance attribute, not a patch of the class: only this run's plugin follows our rule.
    plugin.set_mixed_precision = set_mixed_precision

    if version == 2 and match_amp_forward(model):
        notes.append("FSDP2 forward under autocast with fp32 outputs, as accelerate does for DDP and FSDP1")
    if version == 1:
        requires_grad = {p.requires_grad for p in model.parameters()}
        if len(requires_grad) > 1 and not plugin.use_orig_params:
            plugin.use_orig_params = True
            notes.append("FSDP1 use_orig_params False -> True (frozen base and trainable adapters share units)")
        dora_layers = size_dora_identity_from_layer(model)
        if dora_layers:
            notes.append(f"FSDP1 DoRA: {dora_layers} layers read lora_A's width from the layer, not its flat shard")
    for note in notes:
        logger.info("hf_fsdp_qlora: %s", note)
    return notes


def skip_frozen_embedding_backward_gather(model) -> list[str]:
    """Under FSDP2, stop all-gathering a frozen input embedding again in the backward.

    accelerate's ``fsdp2_prepare_model`` gives the input embedding its own unit with the config's
    ``reshard_after_forward`` (true in the shipped configs), so its weight is freed after the forward and
    gathered again in the backward: by layer 0's backward prefetch, or by the unit's own pre-backward hook
    when its output requires grad (``enable_input_require_grads``). Either one alone gathers it. A frozen
    embedding needs no weight in the backward (its input is integer ids: there is no input gradient, and no
    weight gradient), so that gather is pure traffic - the size of the whole embedding, per step (2.1 GB for
    a 70B Llama's 128256 x 8192 bf16 table). ``set_unshard_in_backward(False)`` is torch's switch for exactly
    this case; nothing is kept gathered longer, so memory is unchanged, and the weights used are the same
    bytes, so numerics are unchanged. Units holding anything trainable (LoRA on the embedding, trained or
    resized embeddings) or anything besides embeddings (tied weights share the LM head's unit) are left alone.

    Returns:
        The names of the units changed.
    """
    from torch.distributed.fsdp import FSDPModule

    changed = []
    for name, module in model.named_modules():
        if not (isinstance(module, FSDPModule) and isinstance(module, torch.nn.Embedding)):
            continue
        if any(p.requires_grad for p in module.parameters()):
            continue
        module.set_unshard_in_backward(False)
        changed.append(name)
    if changed:
        logger.info("hf_fsdp_qlora: FSDP2 frozen embedding not re-gathered in backward: %s", ", ".join(changed))
    return changed


def _casts_gradients(policy) -> bool:
    """True for an FSDP2 policy whose gradients are reduced in another dtype than the parameters are gathered in
    (our float32 adapters: ``param_dtype=bf16, reduce_dtype=fp32``); torch clamps an equal reduce dtype to none."""
    reduce_dtype = getattr(policy, "reduce_dtype", None)
    return reduce_dtype is not None and reduce_dtype != getattr(policy, "param_dtype", None)


def gather_every_unit_once(model, policy) -> list[str]:
    """Under FSDP2 with gradients reduced in their own dtype, all-gather (and free) every unit once after wrapping,
    so gradient accumulation does not crash on a unit that the forward never gathered.

    In a micro-batch without gradient sync (``gradient_accumulation_steps > 1``: accelerate turns it off for all
    but the last), torch 2.13's post-backward casts every parameter's unsharded gradient to ``reduce_dtype`` and
    reads the gathered parameter to do so - which exists only once its unit has been all-gathered. A unit that the
    forward bypasses never is: trl's SFTTrainer projects with ``lm_head.weight.full_tensor()`` without calling the
    head's unit, and a vision tower skips text-only batches. Every rank then fails at the first backward with
    "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'" (torch's post-backward checks for it
    only when it reduces; pytorch/pytorch#194058 proposed the missing check). The policy with ``reduce_dtype=param_dtype``
    (bf16 adapters) skips that cast, which is why float32 adapters (train/precision.py) exposed it. One gather per
    unit, one unit at a time, through torch's public ``unshard``/``reshard``: what stays is torch's record of the
    gathered parameter (its memory freed), so the cast finds no gradient and returns. Weights are not changed.

    Returns:
        The names of the units gathered (none when the policy reduces in the gather dtype, or without FSDP2).
    """
    from torch.distributed.fsdp import FSDPModule

    if not _casts_gradients(policy):
        return []
    gathered = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()
            gathered.append(name)
    return gathered


def fsdp_engagement(model) -> dict:
    """What FSDP wrapping is visible on `model`: FSDP1 units and FlatParameters, FSDP2 modules and DTensors."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    modules = list(model.modules())
    return {
        "fsdp1_units": sum(isinstance(m, FSDP) for m in modules),
        # With use_orig_params=True the FlatParameter is not registered as a module parameter: each FSDP1
        # unit keeps it on its handle.
        # (FlatParameter is a Parameter tagged `_is_flat_param`; its type name is plain "Parameter".)
        "flat_params": sum(
            bool(getattr(getattr(m, "_flat_param", None), "_is_flat_param", False))
            for m in modules
            if isinstance(m, FSDP)
        ),
        "fsdp2_modules": sum(isinstance(m, FSDPModule) for m in modules),
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
    }


def fsdp_unit_kinds(model) -> dict[str, int]:
    """How many FSDP1 / FSDP2 units wrap each module class of `model` ({"LlamaDecoderLayer": 32, ...})."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (FSDP, FSDPModule)):
            inner = module.module if isinstance(module, FSDP) else module
            name = type(inner).__name__.removeprefix("FSDP")
            kinds[name] = kinds.get(name, 0) + 1
    return kinds


def assert_fsdp_engaged(model, version: int) -> dict:
    """Raise unless `model` is really wrapped by FSDP `version`; return what was found.

    Raises:
        FSDPNotEngagedError: accelerate fell back to DDP or to single-process training.
    """
    found = fsdp_engagement(model)
    ok = (found["fsdp1_units"] > 0 and found["flat_params"] > 0) if version == 1 else found["fsdp2_modules"] > 0
    if not ok:
        raise FSDPNotEngagedError(
            f"FSDP{version} was requested but the prepared model is not FSDP-wrapped ({found}); accelerate "
            "fell back silently (it does so on machines without a GPU). Launch with `accelerate launch "
            "--config_file $(hf-fsdp-qlora config cpu_fsdp2_rehearsal)` on CPU, and import hf_fsdp_qlora "
            "before creating TrainingArguments so the CPU rehearsal hook is installed in time."
        )
    return found


_MERGE_METHODS = ("merge_and_unload", "merge_adapter", "unload")


def guard_sharded_merge(model) -> int:
    """Make merging an FSDP-wrapped peft model fail with a clear error instead of a crash or a silent no-op.

    On a sharded model peft's ``merge_and_unload`` fails with "'DTensor' object has no attribute
    'quant_state'" (FSDP2) or merges into one rank's shard (FSDP1). The methods are replaced on this model
    object only (not on the class) by ones that say how to merge instead.

    Returns:
        How many methods were guarded.
    """
    from .checkpoint import unwrap_peft_model

    peft_model = unwrap_peft_model(model)
    if peft_model is None:
        return 0

    def refuse(*args, **kwargs):
        raise UnsupportedSetupError(
            "This peft model is sharded by FSDP, so its LoRA weights cannot be merged in place (each rank holds "
            "a slice; peft fails with \"'DTensor' object has no attribute 'quant_state'\"). Save the adapter - "
            "trainer.save_model(out_dir), which gathers it from every rank - then merge it into the 16-bit base: "
            "merge-adapters --base BASE_MODEL_DIR --adapter out_dir --output merged_dir"
        )

    count = 0
    for name in _MERGE_METHODS:
        if hasattr(peft_model, name):
            setattr(peft_model, name, refuse)
            count += 1
    return count
