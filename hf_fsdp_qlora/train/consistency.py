"""The one pre-wrapping pass: refuse what cannot work, then make every FSDP unit dtype-consistent.

Used by :class:`~hf_fsdp_qlora.FSDPQLoRACallback`, and so by both trainers, which install it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..doctor.checks import check_setup, raise_for_errors
from ..dtypes import harmonize_dtypes, training_dtype, view_packed_storage_as
from ..loading.int8 import convert_int8_layers
from ..rank_sync import agree_on_failure, broadcast_trainable_parameters
from .fsdp import configure_plugin, fsdp_version
from .precision import adapter_dtype_for, is_adapter_run, prepare_fsdp1_float32_units

__all__ = ["ConsistencyReport", "follow_wrapping", "make_fsdp_consistent"]

logger = logging.getLogger(__name__)


@dataclass
class ConsistencyReport:
    """What :func:`make_fsdp_consistent` found and changed."""

    fsdp_version: int
    dtype: torch.dtype
    cast_parameters: list[str] = field(default_factory=list)
    plugin_changes: list[str] = field(default_factory=list)
    broadcast_parameters: int = 0
    viewed_storage: int = 0
    int8_layers: int = 0
    # What the optimizer steps: float32 master weights by default (train/precision.py), or `dtype` (opt-out).
    adapter_dtype: torch.dtype = torch.float32


def make_fsdp_consistent(model, plugin, args=None) -> ConsistencyReport:
    """Prepare `model` and accelerate's FSDP `plugin` for wrapping. Collective (call on every rank).

    1. :func:`_checked_dtypes`: integer-stored 4-bit weights viewed as the training dtype, 8-bit layers converted,
       the doctor's checks refused on every rank if any rank refuses, the training and adapter dtypes chosen;
    2. cast every frozen non-quantized floating parameter (norms, biases, embeddings) to the one training dtype,
       the 4-bit storage dtype, and an adapter run's trainable tensors to the adapter dtype (float32 master weights
       by default, :mod:`hf_fsdp_qlora.train.precision`; FSDP1's fp32 units: :func:`prepare_fsdp1_float32_units`);
    3. set FSDP's mixed precision (param_dtype: that training dtype; reduce_dtype: the adapter dtype) and, for
       FSDP1, ``use_orig_params=True``;
    4. broadcast trainable parameters from rank 0, so every rank starts from the same adapters.

    Raises:
        UnsupportedSetupError: for a setup FSDP cannot run, with the setting and value to use.
    """
    report = _checked_dtypes(model, plugin, args)
    dtype, adapter_dtype = report.dtype, report.adapter_dtype
    report.cast_parameters = harmonize_dtypes(model, dtype, trainable_dtype=adapter_dtype)
    if report.cast_parameters:
        logger.info(
            "hf_fsdp_qlora: cast %d parameters (frozen to %s, trainable to %s) so each FSDP unit has one dtype "
            "(e.g. %s)",
            len(report.cast_parameters),
            dtype,
            adapter_dtype,
            report.cast_parameters[0],
        )
    report.cast_parameters += prepare_fsdp1_float32_units(model, report.fsdp_version, adapter_dtype, dtype)
    report.plugin_changes = configure_plugin(plugin, model, dtype, reduce_dtype=adapter_dtype)
    report.broadcast_parameters = broadcast_trainable_parameters(model)
    return report


def _checked_dtypes(model, plugin, args) -> ConsistencyReport:
    """View integer-stored 4-bit weights as the training dtype (same bytes), turn bitsandbytes' 8-bit layers into
    :class:`~hf_fsdp_qlora.loading.int8.Int8Linear`, run the doctor's checks (:func:`hf_fsdp_qlora.check_setup`, as
    ``hf-fsdp-qlora doctor``) on the live model and plugin and refuse their errors (8-bit base, a spreading
    device_map, a missing wrap class, ...) on every rank if any rank refuses, before any other collective.

    Returns:
        The report, with the FSDP version, the training dtype, the adapter dtype and what was viewed / converted.
    """
    # Integer-stored 4-bit weights (bitsandbytes' default uint8, what trl's `--load_in_4bit` gives) cannot be
    # flattened by FSDP1 ("Cannot flatten integer dtype tensors") and stay out of FSDP2 sharding (a full copy per
    # GPU): view their bytes as the training dtype so they shard like everything else. No value is converted, so
    # the logits are bit for bit those of the unwrapped model. Done first, so the checks below see the result.
    # An 8-bit base (load_in_8bit, trl's --load_in_8bit): bitsandbytes' Int8Params cannot be flattened (FSDP1)
    # and lose their scales when FSDP2 shards them; the same int8 codes and scales, held as FSDP needs them.
    error, findings, report = None, [], None
    try:
        viewed = view_packed_storage_as(model, training_dtype(model))
        int8_layers = convert_int8_layers(model, training_dtype(model))
        findings = check_setup(model, fsdp_plugin=plugin)
        raise_for_errors(findings)
        dtype = training_dtype(model)
        adapter_dtype = adapter_dtype_for(args, dtype) if is_adapter_run(model) else dtype
        report = ConsistencyReport(
            fsdp_version=fsdp_version(plugin),
            dtype=dtype,
            viewed_storage=viewed,
            int8_layers=int8_layers,
            adapter_dtype=adapter_dtype,
        )
    except Exception as err:  # noqa: BLE001 - re-raised on this rank by agree_on_failure
        error = err
    agree_on_failure(error)
    for finding in findings:
        level = logging.WARNING if finding.severity == "warning" else logging.INFO
        logger.log(level, "hf_fsdp_qlora: [%s] %s", finding.id, finding.message)
    if report.viewed_storage:
        logger.info(
            "hf_fsdp_qlora: viewed %d integer-stored 4-bit weights as %s so FSDP%d can %s them (bytes unchanged)",
            report.viewed_storage,
            report.dtype,
            report.fsdp_version,
            "flatten" if report.fsdp_version == 1 else "shard",
        )
    return report


@torch.no_grad()
def keep_trainable_in_training_dtype(model, dtype: torch.dtype) -> int:
    """Undo accelerate's fp32 upcast of FSDP1's trainable FlatParameters when the adapters train in `dtype`, a 16-bit
    dtype (``adapter_dtype="bfloat16"``); with float32 adapters (the default) there is nothing to undo.

    With mixed precision on (``bf16=True``, trl's default), accelerate (<= 1.15) upcasts each FSDP1 FlatParameter
    that requires grad to float32 right after wrapping. FSDP2 keeps them as they are. Under FSDP1 the LoRA weights
    then run in float32 when non-reentrant activation checkpointing recomputes a layer, while the forward saved
    bfloat16 - the backward fails with "CheckpointError: ... Recomputed values ... have different metadata". Cast
    back before FSDP's lazy initialisation (the first forward), the same way accelerate cast up; the optimizer holds
    the original parameters, whose views FSDP rebuilds over the re-typed FlatParameter.

    Returns:
        How many FlatParameters were cast back.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count = 0
    for module in FSDP.fsdp_modules(model):
        flat = getattr(module, "_flat_param", None)
        handle = getattr(module, "_handle", None)
        if flat is None or handle is None or not flat.requires_grad or flat.dtype == dtype:
            continue
        if flat.dtype != torch.float32 or getattr(handle, "_orig_param_dtype", None) != torch.float32:
            continue
        flat.data = flat.data.to(dtype)
        handle._orig_param_dtype = dtype
        count += 1
    if count:
        logger.info(
            "hf_fsdp_qlora: kept %d trainable FSDP1 FlatParameters in %s (accelerate had upcast them to float32 "
            "under mixed precision)",
            count,
            dtype,
        )
    return count


def follow_wrapping(trainer) -> None:
    """Run our after-wrap fix-ups the moment accelerate wraps the model - before a resume loads weights into it
    or an evaluation runs it (either would start FSDP's lazy initialisation with the wrong dtypes)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return
    accelerator, prepare_model = trainer.accelerator, trainer.accelerator.prepare_model

    def prepare_model_then_fix(model, *args, **kwargs):
        wrapped = prepare_model(model, *args, **kwargs)
        callback = trainer.fsdp_callback
        report = getattr(callback, "report", None)
        if report is not None and report.fsdp_version == 1:
            keep_trainable_in_training_dtype(wrapped, report.adapter_dtype)
        return wrapped

    # An instance attribute: only this trainer's accelerator is affected.
    accelerator.prepare_model = prepare_model_then_fix
