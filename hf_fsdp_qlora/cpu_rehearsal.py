"""CPU rehearsal: run accelerate's real FSDP code path on CPU processes over gloo.

accelerate (checked on 1.15) only takes its FSDP branch for GPU-like devices. On a CPU-only machine a
launch with ``distributed_type: FSDP`` + ``use_cpu: true`` silently becomes plain DDP (``MULTI_CPU``)
or single-process training - the run is green and proves nothing. torch itself runs FSDP1 and FSDP2
on CPU with gloo, so the only thing missing is accelerate's decision. This module supplies it:

* it wraps ``AcceleratorState.__init__`` so that a state built on CPU processes (``MULTI_CPU``) with an
  FSDP plugin becomes ``DistributedType.FSDP``. The wrap is re-applied on *every* state construction,
  because accelerate rebuilds its state (for instance when trl's ``SFTConfig`` turns bf16 on) and a
  one-off assignment would be silently undone;
* it wraps ``PartialState.__init__`` so that a process started by ``accelerate launch`` / ``torchrun``
  for FSDP on a machine without any accelerator joins the gloo process group as a CPU rank
  (``accelerate launch`` does not export ``ACCELERATE_USE_CPU`` to torchrun workers, so without this
  every rank would train alone);
* it sets the device to plain ``cpu``: FSDP1 refuses ``device_id=cpu:0`` with
  "Inconsistent compute device and `device_id` on rank 0: cpu vs cpu:0".

Nothing changes on a machine with an accelerator: the wrap only acts when accelerate itself chose
``MULTI_CPU``. A release of accelerate that runs FSDP on CPU by itself makes this module unnecessary; the
canary test named in ``_compat/accelerate.py`` (entry ``cpu_fsdp_decision``) fails then.
"""

from __future__ import annotations

import functools

import torch

from .distributed import fsdp_requested_by_launch, started_by_launcher

__all__ = ["enable_cpu_fsdp", "fsdp_requested_by_launch"]


_ENABLED = False


def _fsdp_requested(fsdp_plugin=None) -> bool:
    return fsdp_plugin is not None or fsdp_requested_by_launch()


def _no_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return not accelerator.is_available()
    return not torch.cuda.is_available()


def _promote_to_fsdp(state, fsdp_plugin) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if not _fsdp_requested(fsdp_plugin) or getattr(state, "fsdp_plugin", None) is not None:
        return
    # MULTI_CPU: accelerate's own choice for CPU ranks. FSDP on a cpu device: a state rebuilt after
    # AcceleratorState._reset_state(), which copies our FSDP choice from PartialState but, taking the
    # FSDP branch only for GPU-like types, attaches no plugin.
    on_cpu = state.distributed_type == DistributedType.MULTI_CPU or (
        state.distributed_type == DistributedType.FSDP
        and getattr(state, "device", None) is not None
        and state.device.type == "cpu"
    )
    if not on_cpu:
        return
    if fsdp_plugin is None:
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()
    if state._mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    state.distributed_type = DistributedType.FSDP
    cpu = torch.device("cpu")
    state.device = cpu
    # AcceleratorState copies PartialState's dict on construction; keep both views in agreement so a
    # later PartialState() (Trainer, TrainingArguments) sees FSDP on plain `cpu` too.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["device"] = cpu


def enable_cpu_fsdp() -> None:
    """Let accelerate run FSDP1/FSDP2 on CPU processes (gloo). Idempotent, safe on GPU machines.

    Our trainers and :class:`~hf_fsdp_qlora.FSDPQLoRACallback` call this before accelerate builds its
    state, so users never need to; call it yourself before ``Accelerator(...)`` in a plain accelerate
    script.
    """
    global _ENABLED
    if _ENABLED:
        return
    from ._bnb_cpu import prevent_cpu_weight_repack

    prevent_cpu_weight_repack()  # an evaluate() would otherwise repack 4-bit weights in place (see _bnb_cpu)
    from accelerate.state import AcceleratorState, PartialState

    original_partial_init = PartialState.__init__

    @functools.wraps(original_partial_init)
    def partial_init(self, cpu: bool = False, **kwargs):
        if not PartialState._shared_state and _fsdp_requested() and _no_accelerator() and started_by_launcher():
            cpu = True
        original_partial_init(self, cpu, **kwargs)

    original_init = AcceleratorState.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        was_initialized = bool(AcceleratorState._shared_state)
        original_init(self, *args, **kwargs)
        if not was_initialized:
            _promote_to_fsdp(self, kwargs.get("fsdp_plugin"))

    PartialState.__init__ = partial_init
    AcceleratorState.__init__ = __init__
    _honour_use_cpu_in_training_arguments()
    if _rehearsing_on_cpu():
        import atexit

        atexit.register(_destroy_process_group_at_exit)
    _ENABLED = True


def _destroy_process_group_at_exit() -> None:
    # A gloo job whose script returns without destroy_process_group() aborts at interpreter teardown about one run
    # in four ("terminate called without an active exception"), and `accelerate launch` reports a failure after a
    # successful run. No barrier here: a rank that failed would leave the others waiting.
    # (`python -m hf_fsdp_qlora.run` goes further and skips the teardown altogether.)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _rehearsing_on_cpu() -> bool:
    return _fsdp_requested() and _no_accelerator() and started_by_launcher()


def _honour_use_cpu_in_training_arguments() -> None:
    """A CPU rehearsal launch is a CPU run: make ``TrainingArguments.use_cpu`` say so.

    transformers refuses ``bf16=True`` on a machine without a GPU unless ``use_cpu=True`` ("Your setup doesn't
    support bf16/gpu"), and trl's configs default to ``bf16=True``: an unchanged trl script would need an extra
    ``--use_cpu`` on the laptop that it must not have on the cluster. The rehearsal configs already say
    ``use_cpu: true``; this applies it to the training arguments too, only inside such a launch.
    """
    from transformers import TrainingArguments

    original = TrainingArguments.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if not self.use_cpu and _rehearsing_on_cpu():
            self.use_cpu = True
        original(self, *args, **kwargs)

    TrainingArguments.__post_init__ = __post_init__
