"""What we set on accelerate's FSDP plugin, what we refuse before wrapping, and "did FSDP engage?"."""

from __future__ import annotations

import logging

import torch

from .dtypes import quant_storage_dtype, quantization_kind
from .errors import FSDPNotEngagedError, UnsupportedSetupError

__all__ = [
    "fsdp_version",
    "check_supported",
    "configure_plugin",
    "fsdp_engagement",
    "assert_fsdp_engaged",
]

logger = logging.getLogger(__name__)


def fsdp_version(plugin) -> int:
    return int(getattr(plugin, "fsdp_version", 1) or 1)


def check_supported(model, version: int) -> None:
    """Refuse, before any wrapping or collective, what cannot work under FSDP `version`.

    Raises:
        UnsupportedSetupError: an 8-bit base, or integer 4-bit storage under FSDP1.
    """
    kind = quantization_kind(model)
    if kind == "8bit":
        # FSDP1: "Cannot flatten integer dtype tensors"; FSDP2: "'Parameter' object has no attribute
        # 'CB'"; Trainer: "Only Tensors of floating point and complex dtype can require gradients".
        raise UnsupportedSetupError(
            "An 8-bit (load_in_8bit=True) base model cannot be sharded by FSDP: its int8 weights and their "
            "scales are not floating-point tensors FSDP can flatten or shard. Load the base in 4 bits instead: "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
            "bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16) "
            "(or hf_fsdp_qlora.load_qlora_model(path, dtype=torch.bfloat16)), or train 8-bit with DDP."
        )
    if kind == "4bit":
        storage = quant_storage_dtype(model)
        if not storage.is_floating_point and version == 1:
            raise UnsupportedSetupError(
                f"The 4-bit weights are stored as {storage} (bitsandbytes' default), which FSDP1 cannot flatten "
                "('Cannot flatten integer dtype tensors'). Set bnb_4bit_quant_storage to the compute dtype, e.g. "
                "BitsAndBytesConfig(..., bnb_4bit_compute_dtype=torch.bfloat16, "
                "bnb_4bit_quant_storage=torch.bfloat16), or use hf_fsdp_qlora.load_qlora_model(path, "
                "dtype=torch.bfloat16)."
            )
        if not storage.is_floating_point:
            logger.warning(
                "The 4-bit weights are stored as %s: accelerate's FSDP2 leaves them unsharded (a full copy on "
                "every GPU). Set bnb_4bit_quant_storage=torch.bfloat16 (the compute dtype) to shard them.",
                storage,
            )


def _mixed_precision_policy(version: int, dtype: torch.dtype):
    if version == 1:
        from torch.distributed.fsdp import MixedPrecision

        # buffer_dtype=None keeps buffers (rotary inv_freq) in their own dtype: FSDP1 would cast them
        # to bf16 and shift every output by ~1e-3 relative to an unsharded run.
        return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=None)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # No output_dtype: casting the model's outputs would round the fp32 loss transformers computes to bf16.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


def configure_plugin(plugin, model, dtype: torch.dtype) -> list[str]:
    """Make accelerate's FSDP plugin agree with the model's one training dtype.

    * mixed precision ``param_dtype`` = ``reduce_dtype`` = the 4-bit storage dtype: any other
      param_dtype casts the packed 4-bit bytes and corrupts the weights. transformers sets this under
      FSDP1 only (and casts buffers too); under FSDP2 nothing does. Later calls of
      ``plugin.set_mixed_precision`` (transformers' ``update_fsdp_plugin_peft``) are routed to the same
      rule, so the policy cannot be undone between here and wrapping;
    * FSDP1: ``use_orig_params=True``, because a unit that holds frozen base weights and trainable
      adapters fails with "Must flatten tensors with uniform requires_grad when use_orig_params=False".

    Returns:
        Human-readable notes of what was changed, for the log.
    """
    version = fsdp_version(plugin)
    notes = []
    policy = _mixed_precision_policy(version, dtype)
    old = plugin.mixed_precision_policy
    if getattr(old, "param_dtype", None) != dtype:
        old_dtype = getattr(old, "param_dtype", None)
        notes.append(f"FSDP mixed precision param_dtype {old_dtype} -> {dtype} (the 4-bit storage dtype)")
    plugin.mixed_precision_policy = policy

    def set_mixed_precision(mixed_precision, buffer_autocast=False, override=False):
        plugin.mixed_precision_policy = _mixed_precision_policy(version, dtype)

    # An instance attribute, not a patch of the class: only this run's plugin follows our rule.
    plugin.set_mixed_precision = set_mixed_precision

    if version == 1:
        requires_grad = {p.requires_grad for p in model.parameters()}
        if len(requires_grad) > 1 and not plugin.use_orig_params:
            plugin.use_orig_params = True
            notes.append("FSDP1 use_orig_params False -> True (frozen base and trainable adapters share units)")
    for note in notes:
        logger.info("hf_fsdp_qlora: %s", note)
    return notes


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
