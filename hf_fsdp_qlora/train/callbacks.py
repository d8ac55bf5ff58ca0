"""`FSDPQLoRACallback`: our FSDP fixes for any `transformers.Trainer` (trl's DPO/GRPO/reward trainers,
your own subclass). Our trainer classes install this same callback: there is one implementation.

Import it as ``from hf_fsdp_qlora import FSDPQLoRACallback``: that name comes through
:mod:`~hf_fsdp_qlora.train.trainer_hook`, which also installs the ``Trainer.__init__`` hook a stock trainer needs.
This module stays below the hook (the hook and the trainer mixin import it, never the other way round).
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from .._bnb_cpu import disable_cpu_repack_in_model
from .._logging import human_size
from ..cpu_rehearsal import enable_cpu_fsdp
from ..distributed import fsdp_requested_by_launch
from ..errors import FSDPNotEngagedError
from ..loading.low_ram import verify_partial_rows
from ..quant_record import keep_live_record
from .accelerator_setup import preserve_checkpoint_rng_state
from .consistency import make_fsdp_consistent
from .fsdp import (
    assert_fsdp_engaged,
    fsdp_unit_kinds,
    fsdp_version,
    gather_every_unit_once,
    guard_sharded_merge,
    skip_frozen_embedding_backward_gather,
)
from .packing import check_padding_free
from .precision import keep_trainable_in_adapter_dtype

__all__ = ["FSDPQLoRACallback"]

logger = logging.getLogger(__name__)

# Installed at import, before the user's TrainingArguments builds accelerate's state (see cpu_rehearsal).
enable_cpu_fsdp()


def engagement_summary(model, version: int, found: dict) -> str:
    """One line for the log: what FSDP wrapped, and how many parameter bytes this rank holds of the whole."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    kinds = fsdp_unit_kinds(model)
    units = ", ".join(f"{count} {name}" for name, count in sorted(kinds.items(), key=lambda kv: -kv[1]))
    local = total = 0
    if version == 1:
        for module in model.modules():
            flat = getattr(module, "_flat_param", None) if isinstance(module, FSDP) else None
            if flat is not None:
                local += flat.numel() * flat.element_size()
                total += sum(getattr(flat, "_numels", (flat.numel() * world,))) * flat.element_size()
    else:
        for param in model.parameters():
            size = param.element_size()
            total += param.numel() * size
            local += (param.to_local().numel() if hasattr(param, "to_local") else param.numel()) * size
    from ..experts.quantized import packed_expert_bytes

    experts_local, experts_full = packed_expert_bytes(model)
    experts = (
        f"; 4-bit experts: this rank holds {experts_local} of {experts_full} packed bytes" if experts_full else ""
    )
    return (
        f"FSDP{version} engaged on {world} rank(s): {units or 'no'} units; this rank holds {human_size(local)} of "
        f"{human_size(total)} of parameters ({found.get('dtensor_params', 0)} DTensor parameters, "
        f"{found.get('flat_params', 0)} FlatParameters){experts}"
    )


def _fsdp_requested(args) -> bool:
    return bool(getattr(args, "fsdp", None)) or fsdp_requested_by_launch()


def _active_fsdp_plugin():
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    if getattr(state, "distributed_type", None) != DistributedType.FSDP:
        return None
    return getattr(state, "fsdp_plugin", None)


class FSDPQLoRACallback(TrainerCallback):
    """Make a QLoRA model FSDP-consistent before `prepare()` wraps it, and check FSDP engaged.

    * ``on_init_end`` (end of ``Trainer.__init__``, before the model is wrapped): keeps the quantization record
      of a bitsandbytes base on the model (written beside every adapter saved from it), refuses what cannot
      work, casts frozen floating parameters to the 4-bit storage dtype and the adapters to ``adapter_dtype``
      (float32 master weights by default), sets FSDP's mixed precision (FSDP1 and FSDP2) and ``use_orig_params``
      for FSDP1, and broadcasts the adapters from rank 0 so every rank starts identical; without FSDP it casts
      the adapters to ``adapter_dtype`` only;
    * ``on_train_begin`` (after wrapping): raises :class:`~hf_fsdp_qlora.FSDPNotEngagedError` if FSDP
      was requested but the model is not FSDP-wrapped, and makes FSDP's activation checkpointing recompute with the
      forward's dropout masks (accelerate's FSDP2 wrappers draw new ones).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[FSDPQLoRACallback()])

    For adapter saving under FSDP2 with a stock trainer, call :func:`hf_fsdp_qlora.train.checkpoint.save_adapter`
    (our trainers' ``save_model`` does).
    """

    def __init__(self):
        self.report = None
        self.engagement = None
        self._version = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:  # a model loaded before hf_fsdp_qlora was imported may repack at evaluation
            disable_cpu_repack_in_model(model)
            # Read before FSDP wraps it (its 4-bit weights lose their quant states there): every adapter saved from
            # this run (final save, checkpoints, FSDP or not) then carries what training quantized, for the merge.
            keep_live_record(model)
        plugin = _active_fsdp_plugin()
        if plugin is None:
            if _fsdp_requested(args):
                raise FSDPNotEngagedError(
                    "FSDP was requested (accelerate config / TrainingArguments.fsdp) but accelerate set up "
                    "no FSDP state. On a machine without a GPU, import hf_fsdp_qlora before creating "
                    "TrainingArguments and launch with a CPU rehearsal config: accelerate launch "
                    "--config_file $(hf-fsdp-qlora config cpu_fsdp2_rehearsal) train.py"
                )
            if model is not None:  # no FSDP: fp32 master weights all the same (train/precision.py)
                keep_trainable_in_adapter_dtype(model, args)
            return
        self._version = fsdp_version(plugin)
        if model is not None:
            self.report = make_fsdp_consistent(model, plugin, args)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        check_padding_free(model, kwargs.get("train_dataloader"))  # packed sequences must not see each other
        if self._version is None or model is None:
            return
        self.engagement = assert_fsdp_engaged(model, self._version)
        verify_partial_rows(model)
        guard_sharded_merge(model)
        skip_frozen_embedding_backward_gather(model)  # FSDP2: one gather of the frozen embedding per step, not two
        preserve_checkpoint_rng_state(model)  # FSDP2's checkpoint wrappers: recompute with the forward's dropout masks
        if self._version == 2:  # gradient accumulation must find every unit gathered once (see the function)
            gather_every_unit_once(model, getattr(_active_fsdp_plugin(), "mixed_precision_policy", None))
        logger.info("hf_fsdp_qlora: %s", engagement_summary(model, self._version, self.engagement))
