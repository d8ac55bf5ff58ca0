"""The one pre-wrapping pass: refuse what cannot work, then make every FSDP unit dtype-consistent.

Used by :class:`~hf_fsdp_qlora.FSDPQLoRACallback`, and so by both trainers, which install it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .dtypes import harmonize_dtypes, training_dtype
from .fsdp import check_supported, configure_plugin, fsdp_version
from .rank_sync import agree_on_failure, broadcast_trainable_parameters

__all__ = ["ConsistencyReport", "make_fsdp_consistent"]

logger = logging.getLogger(__name__)


@dataclass
class ConsistencyReport:
    """What :func:`make_fsdp_consistent` found and changed."""

    fsdp_version: int
    dtype: torch.dtype
    cast_parameters: list[str] = field(default_factory=list)
    plugin_changes: list[str] = field(default_factory=list)
    broadcast_parameters: int = 0


def make_fsdp_consistent(model, plugin) -> ConsistencyReport:
    """Prepare `model` and accelerate's FSDP `plugin` for wrapping. Collective (call on every rank).

    1. refuse unsupported setups (8-bit base, integer 4-bit storage under FSDP1) on every rank before any
       collective - if any rank refuses, every rank raises;
    2. cast every non-quantized floating parameter (adapters, norms, biases, embeddings) to the one
       training dtype, the 4-bit storage dtype;
    3. set FSDP's mixed precision to that dtype and, for FSDP1, ``use_orig_params=True``;
    4. broadcast trainable parameters from rank 0, so every rank starts from the same adapters.

    Raises:
        UnsupportedSetupError: for a setup FSDP cannot run, with the setting and value to use.
    """
    version = fsdp_version(plugin)
    error = None
    try:
        check_supported(model, version)
        dtype = training_dtype(model)
    except Exception as err:  # noqa: BLE001 - re-raised on this rank by agree_on_failure
        error = err
    agree_on_failure(error)

    report = ConsistencyReport(fsdp_version=version, dtype=dtype)
    report.cast_parameters = harmonize_dtypes(model, dtype)
    if report.cast_parameters:
        logger.info(
            "hf_fsdp_qlora: cast %d parameters to %s so each FSDP unit has one dtype (e.g. %s)",
            len(report.cast_parameters),
            dtype,
            report.cast_parameters[0],
        )
    report.plugin_changes = configure_plugin(plugin, model, dtype)
    report.broadcast_parameters = broadcast_trainable_parameters(model)
    return report
