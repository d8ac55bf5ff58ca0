"""The longest sequence that fits: the largest ``seq_len`` whose per-GPU plan the doctor's verdict calls "fits".

The plan (:func:`hf_fsdp_qlora.doctor.memory.plan_memory`) grows with the sequence through its activation and
logits terms only, so the total is non-decreasing in ``seq_len`` and a bisection finds the answer. Everything else
is the setup's own: checkpointing, offloading, the loss path, ``sp_size`` (each GPU holds ``1/sp_size`` of the
tokens) and the tiled MLP.

"Fits" is the verdict's: the plan within ``FIT_FRACTION`` (90%) of the GPU's memory, the rest left to the caching
allocator's fragmentation and the CUDA context. The 100% edge (the verdict's "tight" up to it) is a second figure,
never the answer: a run planned there is warned ``memory-tight``. The answer is also capped at the model's
``max_position_embeddings`` (:attr:`LongestAnswer.advised`), the memory's figure said beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_shapes import ModelShape
from .memory import FIT_FRACTION, plan_memory
from .setup import RunSetup

__all__ = ["MAX_SEQ_LEN", "LongestAnswer", "longest_answer", "longest_sequence"]

MAX_SEQ_LEN = 1 << 26  # 67M tokens: the search's ceiling


@dataclass(frozen=True)
class LongestAnswer:
    """The doctor's answer to "what is the longest sequence that fits" (tokens per sample)."""

    fits: int  # the longest whose plan the verdict calls "fits" (within FIT_FRACTION of the memory)
    edge: int  # the longest whose plan is within 100% of the memory (verdict "tight" above `fits`)
    max_positions: int | None  # the model's max_position_embeddings (None: no limit)

    @property
    def capped(self) -> bool:
        return self.max_positions is not None and self.fits > self.max_positions

    @property
    def advised(self) -> int:
        """The length to train at: `fits`, or the model's positions where the memory allows more."""
        return self.max_positions if self.capped else self.fits


def _fits(shape: ModelShape, setup: RunSetup, seq_len: int, fraction: float) -> bool:
    return plan_memory(shape, setup.replace(seq_len=seq_len)).total <= fraction * setup.gpu_memory


def longest_sequence(
    shape: ModelShape, setup: RunSetup, fraction: float = FIT_FRACTION, upper: int = MAX_SEQ_LEN
) -> int:
    """The largest ``seq_len`` (tokens per sample, ``batch_size`` samples per GPU), at most `upper`, whose plan is
    within `fraction` of ``setup.gpu_memory``: by default the verdict's "fits"; 1.0 for the 100% edge. 0 when not
    even one token fits. The model's positions do not bound it (see :func:`longest_answer`).

    Raises:
        ValueError: ``setup.gpu_memory`` is not set.
    """
    if not setup.gpu_memory:
        raise ValueError("longest_sequence needs the GPU's memory: set gpu_memory (the doctor's --gpu-memory 80GB).")
    low, high = 0, upper
    if _fits(shape, setup, high, fraction):
        return high
    while high - low > 1:  # invariant: low fits (or is 0), high does not
        middle = (low + high) // 2
        if _fits(shape, setup, middle, fraction):
            low = middle
        else:
            high = middle
    return low


def longest_answer(shape: ModelShape, setup: RunSetup) -> LongestAnswer:
    """The longest length that fits, the 100% edge, and the model's positions that cap the advice."""
    limit = shape.max_positions if shape.max_positions and shape.max_positions > 0 else None
    return LongestAnswer(longest_sequence(shape, setup), longest_sequence(shape, setup, fraction=1.0), limit)
