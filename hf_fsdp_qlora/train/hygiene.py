"""Training-hygiene callbacks, usable with any `transformers.Trainer`.

* :class:`DistinctBatchesCallback` - before the first step, checks from the sample indices each rank will
  draw that the data is split across ranks, and fails fast otherwise (a missing DistributedSampler makes
  every GPU train on the same data: N times the cost for one GPU's worth of progress, and nothing in the
  logs says so);
* :class:`LabelsCheckCallback` / :func:`check_labels` - stops a run whose first batch has no label to learn
  from (all -100: loss 0, nothing learned, no word);
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

from ..distributed import is_distributed
from ..errors import DuplicateBatchesError, NoLabelsError

__all__ = [
    "DistinctBatchesCallback",
    "DuplicateBatchesError",
    "LabelsCheckCallback",
    "MemoryThroughputCallback",
    "NoLabelsError",
    "check_labels",
    "peak_memory_bytes",
    "sample_indices",
]

logger = logging.getLogger(__name__)


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
    """A forward pre-hook that hands each call's input_ids (or, with `key`, that keyword) to `sink`."""

    def __init__(self, model, sink, key=None):
        def hook(module, args, kwargs):
            sink(kwargs.get(key) if key else _input_ids(args, kwargs))

        self.handle = _unwrap(model).register_forward_pre_hook(hook, with_kwargs=True)

    def remove(self):
        self.handle.remove()


def _all_gather_ints(values: list[int]) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [[int(v) for v in t.tolist()] for t in everyone]


def _digest_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:7], "little")


def _splits_by_itself(dataloader) -> bool:
    """Whether the dataloader is one accelerate splits across ranks by construction.

    A ``DataLoaderDispatcher`` has rank 0 draw whole batches and send each rank its slice, so the indices
    its batch sampler yields are the same on every rank by design; an ``IterableDatasetShard`` slices the
    stream per rank.
    """
    kinds = {type(dataloader).__name__, type(getattr(dataloader, "dataset", None)).__name__}
    return bool(kinds & {"DataLoaderDispatcher", "IterableDatasetShard"})


def sample_indices(dataloader, batches: int) -> list[list[int]] | None:
    """The dataset indices of the first `batches` batches `dataloader` will yield on this rank, or None.

    Read from a copy of its batch sampler (accelerate's ``BatchSamplerShard`` yields this rank's share; a
    plain ``BatchSampler`` over a ``RandomSampler`` yields the whole dataset's order) with torch's and
    Python's random states saved and restored, so the real iteration draws exactly what it would have.
    None for iterable datasets (no indices) or samplers that cannot be copied.
    """
    import copy
    import random

    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is None or isinstance(getattr(dataloader, "dataset", None), torch.utils.data.IterableDataset):
        return None
    torch_state, python_state = torch.random.get_rng_state(), random.getstate()
    try:
        if isinstance(dataloader, torch.utils.data.DataLoader):
            # A DataLoader's iterator draws its workers' base seed before the sampler draws its own: do the
            # same, so an unseeded RandomSampler's copy shuffles exactly as the real iteration will.
            torch.empty((), dtype=torch.int64).random_(generator=dataloader.generator)
        found = []
        for batch in copy.deepcopy(batch_sampler):
            found.append([int(i) for i in batch])
            if len(found) == batches:
                break
        return found
    except Exception:  # noqa: BLE001 - an exotic sampler: fall back to comparing content
        return None
    finally:
        torch.random.set_rng_state(torch_state)
        random.setstate(python_state)


class DistinctBatchesCallback(TrainerCallback):
    """Fail fast when every rank trains on the same samples.

    At the start of training each rank reads the dataset indices of its first `check_steps` batches from a
    copy of its batch sampler (nothing is drawn from the real one) and the ranks compare them. If every rank
    would draw the same indices - a dataloader without a DistributedSampler / accelerate sharding, where each
    GPU repeats the same work - :class:`DuplicateBatchesError` is raised on every rank before the first step.
    Identical *content* is not proof: an overfit-one-example run or a small synthetic set has identical rows
    under a correct split. Where no indices exist (an ``IterableDataset``), the ranks compare hashes of the
    ``input_ids`` they see in the first steps and only warn when all are identical.

    Args:
        check_steps: how many batches to check (default 2).
    """

    def __init__(self, check_steps: int = 2):
        self.check_steps = check_steps
        self._hook = None
        self._digest = hashlib.sha256()
        self._all_same = True
        self.checked = 0
        self.verdict = None  # "split", "duplicate" or "unknown", after on_train_begin

    def _record(self, ids):
        if ids is not None:
            self._digest.update(ids.detach().to("cpu").contiguous().numpy().tobytes())

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if not is_distributed() or self.check_steps <= 0:
            return
        indices = None if train_dataloader is None else sample_indices(train_dataloader, self.check_steps)
        by_itself = train_dataloader is not None and _splits_by_itself(train_dataloader)
        digest = _digest_int(repr(indices).encode()) if indices else 0
        everyone = _all_gather_ints([int(indices is not None), digest, int(by_itself)])
        if all(flag for flag, _, _ in everyone):
            same = len({d for _, d, _ in everyone}) == 1 and not any(b for _, _, b in everyone)
            self.verdict = "duplicate" if same else "split"
            if same:
                raise DuplicateBatchesError(
                    f"All {dist.get_world_size()} ranks would draw the same samples (dataset indices "
                    f"{indices[0][:8]}... in the first batch): the data is not split across ranks, so every GPU "
                    "repeats the same work. Let Trainer build the dataloader (pass a Dataset with __len__; do not "
                    "override get_train_dataloader without a DistributedSampler), or shard an IterableDataset per "
                    "rank (datasets.distributed.split_dataset_by_node)."
                )
            return
        self.verdict = "unknown"
        if model is not None:
            self._hook = _ForwardInputs(model, self._record)

    def on_step_end(self, args, state, control, **kwargs):
        if self._hook is None:
            return
        everyone = _all_gather_ints([_digest_int(self._digest.digest())])
        self._all_same &= len({e[0] for e in everyone}) == 1
        self._digest = hashlib.sha256()
        self.checked += 1
        if self.checked < self.check_steps:
            return
        self._hook.remove()
        self._hook = None
        if self._all_same and state.is_world_process_zero:
            # Identical content with no indices to look at: an iterable dataset not split per rank, or a data
            # set whose rows really are identical. Worth a word, never a stop.
            logger.warning(
                "hf_fsdp_qlora: all %d ranks saw identical input_ids in each of the first %d steps. If the "
                "dataset is an IterableDataset, make sure it is split per rank "
                "(datasets.distributed.split_dataset_by_node); if its rows are identical on purpose, ignore this.",
                dist.get_world_size(),
                self.checked,
            )


def check_labels(labels, *, where: str = "this batch") -> None:
    """Raise :class:`NoLabelsError` when every label in `labels` is -100 (nothing to learn from).

    transformers then computes a loss of 0 (or nan) and the optimizer steps on zero gradients: the run
    "trains" and learns nothing, with no word.
    """
    if labels is None or not torch.is_tensor(labels) or labels.numel() == 0:
        return
    if bool((labels == -100).all()):
        raise NoLabelsError(
            f"Every label in {where} is -100, so the loss is 0 (or nan) and nothing is learned. Usual causes: "
            "max_length (or max_seq_length) truncated the completion away - tokenize_completion_only keeps "
            "the prompt first, so a prompt longer than max_length leaves no completion token; a response "
            "template / assistant marker the collator did not find; or every example's completion is empty. "
            "Raise max_length, shorten the prompts, or check the template."
        )


class LabelsCheckCallback(TrainerCallback):
    """Stop at the first training batch when all its labels are -100 on every rank (see :func:`check_labels`).

    Checked in the model's first training forward; the ranks agree before raising, so no rank is left
    waiting in a collective.
    """

    def __init__(self):
        self._hook = None
        self._seen = None
        self.checked = False

    def _record(self, labels):
        if self._seen is None and labels is not None:
            self._seen = labels.detach()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self._hook = _ForwardInputs(model, self._record, key="labels")

    def on_step_end(self, args, state, control, **kwargs):
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        self.checked = True
        error = None
        try:
            check_labels(self._seen, where="the first training batch")
        except NoLabelsError as err:
            error = err
        if is_distributed():
            failed = _all_gather_ints([int(error is not None)])
            if error is None and all(f[0] for f in failed):
                error = NoLabelsError("Every label in the first training batch is -100 on every rank; see rank 0.")
            elif not all(f[0] for f in failed):
                error = None  # one rank's batch alone: unusual, not a broken setup
        if error is not None:
            raise error


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
        if state.is_world_process_zero:  # the figures are in the Trainer's own log line already
            logger.debug("hf_fsdp_qlora: %s", record)
        self._tokens, self._since = 0, time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
