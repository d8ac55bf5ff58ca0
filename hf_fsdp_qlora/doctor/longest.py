"""The longest sequence that fits: the largest ``seq_len`` whose per-GPU plan stays within the GPU's memory.

The plan (:func:`hf_fsdp_qlora.doctor.memory.plan_memory`) grows with the sequence through its activation and
logits terms only, so the total is non-decreasing in ``seq_len`` and a bisection finds the answer. Everything else
is the setup's own: checkpointing, offloading, the loss path, ``sp_size`` (each GPU holds ``1/sp_size`` of the
tokens) and the tiled MLP.
"""

from __future__ import annotations

from ..model_shapes import ModelShape
from .memory import plan_memory
from .setup import RunSetup

__all__ = ["MAX_SEQ_LEN", "longest_sequence"]

MAX_SEQ_LEN = 1 << 26  # 67M tokens: the search's ceiling


def _fits(shape: ModelShape, setup: RunSetup, seq_len: int) -> bool:
    return plan_memory(shape, setup.replace(seq_len=seq_len)).total <= setup.gpu_memory


def longest_sequence(shape: ModelShape, setup: RunSetup) -> int:
    """The largest ``seq_len`` (tokens per sample, ``batch_size`` samples per GPU) that fits ``setup.gpu_memory``;
    0 when not even one token fits.

    Raises:
        ValueError: ``setup.gpu_memory`` is not set.
    """
    if not setup.gpu_memory:
        raise ValueError("longest_sequence needs the GPU's memory: set gpu_memory (the doctor's --gpu-memory 80GB).")
    low, high = 0, MAX_SEQ_LEN
    if _fits(shape, setup, high):
        return high
    while high - low > 1:  # invariant: low fits (or is 0), high does not
        middle = (low + high) // 2
        if _fits(shape, setup, middle):
            low = middle
        else:
            high = middle
    return low
