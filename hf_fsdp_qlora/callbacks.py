"""`FSDPQLoRACallback`: our FSDP fixes for any `transformers.Trainer` (trl's DPO/GRPO/reward trainers,
your own subclass). Our trainer classes install this same callback: there is one implementation."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from .consistency import make_fsdp_consistent
from .cpu_rehearsal import enable_cpu_fsdp, fsdp_requested_by_launch
from .errors import FSDPNotEngagedError
from .fsdp import assert_fsdp_engaged, fsdp_version, guard_sharded_merge
from .low_ram import verify_partial_rows

__all__ = ["FSDPQLoRACallback"]

logger = logging.getLogger(__name__)

# Installed at import, before the user's TrainingArguments builds accelerate's state (see cpu_rehearsal).
enable_cpu_fsdp()


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

    * ``on_init_end`` (end of ``Trainer.__init__``, before the model is wrapped): refuses what cannot
      work, casts adapters and other floating parameters to the 4-bit storage dtype, sets FSDP's mixed
      precision to it (FSDP1 and FSDP2) and ``use_orig_params`` for FSDP1, and broadcasts the adapters
      from rank 0 so every rank starts identical;
    * ``on_train_begin`` (after wrapping): raises :class:`~hf_fsdp_qlora.FSDPNotEngagedError` if FSDP
      was requested but the model is not FSDP-wrapped.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[FSDPQLoRACallback()])

    For adapter saving under FSDP2 with a stock trainer, call :func:`hf_fsdp_qlora.checkpoint.save_adapter`
    (our trainers' ``save_model`` does).
    """

    def __init__(self):
        self.report = None
        self.engagement = None
        self._version = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        plugin = _active_fsdp_plugin()
        if plugin is None:
            if _fsdp_requested(args):
                raise FSDPNotEngagedError(
                    "FSDP was requested (accelerate config / TrainingArguments.fsdp) but accelerate set up "
                    "no FSDP state. On a machine without a GPU, import hf_fsdp_qlora before creating "
                    "TrainingArguments and launch with a CPU rehearsal config: accelerate launch "
                    "--config_file $(hf-fsdp-qlora config cpu_fsdp2_rehearsal) train.py"
                )
            return
        self._version = fsdp_version(plugin)
        if model is not None:
            self.report = make_fsdp_consistent(model, plugin)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._version is None or model is None:
            return
        self.engagement = assert_fsdp_engaged(model, self._version)
        verify_partial_rows(model)
        guard_sharded_merge(model)
        logger.info("hf_fsdp_qlora: FSDP%d engaged: %s", self._version, self.engagement)
