"""Launch state, each piece read in one place: was FSDP asked for, is this a multi-process launch, which FSDP
version, which device collectives use, is this the main process.

What the launcher exported (``accelerate launch`` / ``torchrun`` environment variables) describes the launch
before any process group exists; once torch.distributed is initialised, it is the source of truth. torch is
imported lazily, so ``import hf_fsdp_qlora`` (and the command-line tools) stay light.
"""

from __future__ import annotations

import os

__all__ = [
    "fsdp_requested_by_launch",
    "launch_fsdp_version",
    "parallelism_config_requested",
    "started_by_launcher",
    "multi_process_launch",
    "is_distributed",
    "rank",
    "is_main_process",
    "collective_device",
]

_TRUE = ("1", "true")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def fsdp_requested_by_launch() -> bool:
    """Whether this process was launched for FSDP (``accelerate launch`` with ``distributed_type: FSDP``, or
    ``TrainingArguments(fsdp=...)``, both export ``ACCELERATE_USE_FSDP``)."""
    return _flag("ACCELERATE_USE_FSDP")


def launch_fsdp_version() -> int | None:
    """The FSDP version the launch asked for (``FSDP_VERSION``), or None when it did not say."""
    value = os.environ.get("FSDP_VERSION", "").strip()
    return int(value) if value.isdigit() else None


def parallelism_config_requested() -> bool:
    """Whether the launch set accelerate's parallelism config (HSDP and other multi-dimensional meshes)."""
    return _flag("ACCELERATE_USE_PARALLELISM_CONFIG")


def started_by_launcher() -> bool:
    """Whether a distributed launcher (torchrun, ``accelerate launch``) started this process, even as its only rank."""
    return int(os.environ.get("LOCAL_RANK", -1)) != -1 or int(os.environ.get("WORLD_SIZE", 1)) > 1


def multi_process_launch() -> bool:
    """Whether the launch has several ranks (``WORLD_SIZE`` > 1), before or after the process group exists."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1


def is_distributed() -> bool:
    """Whether torch.distributed is initialised with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank: the process group's once it exists, else the launcher's ``RANK`` (0 when alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def is_main_process() -> bool:
    """Whether this process is rank 0 (the one that writes files and prints INFO lines)."""
    return rank() == 0


def collective_device():
    """The device collectives move tensors on: the current GPU for NCCL (which only moves accelerator tensors),
    the CPU for gloo."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
