"""Training-hygiene callbacks, usable with any `transformers.Trainer`.

* :class:`DistinctBatchesCallback` - in the first steps, checks that ranks receive different batches
  and fails fast otherwise (a missing DistributedSampler makes every GPU train on the same data: N times
  the cost for one GPU's worth of progress, and nothing in the logs says so);
* :class:`MemoryThroughputCallback` - peak memory per rank and tokens per second at every logging step.
"""

from __future__ import annotations

import hashlib
import logging
import resource
import sys
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .rank_sync import is_distributed

__all__ = ["DistinctBatchesCallback", "DuplicateBatchesError", "MemoryThroughputCallback", "peak_memory_bytes"]

logger = logging.getLogger(__name__)


class DuplicateBatchesError(RuntimeError):
    """Every rank received the same batches: the data is not split across ranks."""


def _input_ids(args, kwargs):
    ids = kwargs.get("input_ids")
    if ids is None and args and torch.is_tensor(args[0]):
        ids = args[0]
    return ids


def _unwrap(model):
    # Hooks go on the innermost module: FSDP1/DDP wrappers forward to it with the same inputs.
    while hasattr(model, "module"):
        model = model.module
    return model


class _ForwardInputs:
    """A forward pre-hook that hands each call's input_ids to `sink`."""

    def __init__(self, model, sink):
        self.handle = _unwrap(model).register_forward_pre_hook(
            lambda module, args, kwargs: sink(_input_ids(args, kwargs)), with_kwargs=True
        )

    def remove(self):
        self.handle.remove()


class DistinctBatchesCallback(TrainerCallback):
    """Fail fast when every rank trains on the same batches.

    During the first `check_steps` optimizer steps each rank hashes the ``input_ids`` its model sees;
    the hashes are compared across ranks (one small all-gather per step). If every rank saw exactly the
    same data in every checked step, :class:`DuplicateBatchesError` is raised on every rank.

    Args:
        check_steps: how many optimizer steps to check (default 2).
    """

    def __init__(self, check_steps: int = 2):
        self.check_steps = check_steps
        self._hook = None
        self._digest = hashlib.sha256()
        self._all_same = True
        self.checked = 0

    def _record(self, ids):
        if ids is not None:
            self._digest.update(ids.detach().to("cpu").contiguous().numpy().tobytes())

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if is_distributed() and model is not None and self.check_steps > 0:
            self._hook = _ForwardInputs(model, self._record)

    def on_step_end(self, args, state, control, **kwargs):
        if self._hook is None:
            return
        value = int.from_bytes(self._digest.digest()[:7], "little")
        mine = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        self._all_same &= len({int(t.item()) for t in everyone}) == 1
        self._digest = hashlib.sha256()
        self.checked += 1
        if self.checked < self.check_steps:
            return
        self._hook.remove()
        self._hook = None
        if self._all_same:
            raise DuplicateBatchesError(
                f"All {dist.get_world_size()} ranks received identical batches in each of the first "
                f"{self.checked} steps: the data is not split across ranks, so every GPU repeats the same work. "
                "Let Trainer build the dataloader (pass a Dataset with __len__; do not override "
                "get_train_dataloader without a DistributedSampler), or shard an IterableDataset per rank "
                "(datasets.distributed.split_dataset_by_node)."
            )


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this process: CUDA max allocated on a GPU, peak RSS on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryThroughputCallback(TrainerCallback):
    """Log peak memory per rank and tokens per second (all ranks) at every logging step.

    Tokens are counted from the ``input_ids`` the model sees (padding included); the figures are added to
    the Trainer's logs (``peak_memory_gb_rank<N>``, ``tokens_per_second``) and kept in :attr:`history`.
    """

    def __init__(self):
        self.history: list[dict] = []
        self._tokens = 0
        self._since = None
        self._hook = None

    def _count(self, ids):
        if ids is not None:
            self._tokens += ids.numel()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self._hook = _ForwardInputs(model, self._count)
        self._since = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._since is None or logs is None or "loss" not in logs:
            return
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        device = getattr(args, "device", None)
        figures = torch.tensor([float(self._tokens), float(peak_memory_bytes(device))], dtype=torch.float64)
        if is_distributed():
            if dist.get_backend() == "nccl":
                figures = figures.cuda()
            everyone = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, figures)
        else:
            everyone = [figures]
        record = {"step": state.global_step, "tokens_per_second": sum(float(e[0]) for e in everyone) / elapsed}
        for rank, e in enumerate(everyone):
            record[f"peak_memory_gb_rank{rank}"] = float(e[1]) / 2**30
        self.history.append(record)
        logs.update({k: round(v, 4) for k, v in record.items() if k != "step"})
        if state.is_world_process_zero:
            logger.info("hf_fsdp_qlora: %s", record)
        self._tokens, self._since = 0, time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
