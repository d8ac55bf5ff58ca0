"""Upstream lines that are noise in a normal run, filtered one by one; ``HF_FSDP_QLORA_VERBOSE=1`` shows them.

Each filter matches one message of one source (a named logger, or a warning's category + message + module) and
nothing else, so a real problem from the same library still gets through. They are installed when
``hf_fsdp_qlora`` is imported: bitsandbytes prints its line while being imported, and ``from transformers import
Trainer`` imports it, so a filter installed later (by our trainers or callback) would come too late. The
environment variable is read here, in one place, when the filters are installed; ``docs/quiet.md`` lists what is
suppressed and why.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

__all__ = ["NOISE", "VERBOSE_ENV", "quiet_upstream", "verbose_requested"]

VERBOSE_ENV = "HF_FSDP_QLORA_VERBOSE"


@dataclass(frozen=True)
class LoggedNoise:
    """A record of `logger` whose message starts with `starts` and contains every string of `contains`."""

    logger: str
    starts: str
    contains: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class WarnedNoise:
    """A ``warnings.warn`` of `category` whose message matches the regex `message`, raised in `module` (regex)."""

    category: type[Warning]
    message: str
    module: str
    why: str


NOISE: tuple[LoggedNoise | WarnedNoise, ...] = (
    LoggedNoise(
        logger="bitsandbytes.backends.cpu.ops",
        starts="Failed to load CPU gemm_4bit_forward from kernels-community",
        # only the "optional package not installed" case; any other failure to load the kernel is shown
        contains=("No module named 'kernels'",),
        why="bitsandbytes >= 0.50 on CPUs with AVX512-BF16 tries an optional hub kernel at import and warns on every "
        "rank when the optional `kernels` package is absent; its own CPU code is used instead (no loss for us: "
        "we train through the dequantizing path)",
    ),
    WarnedNoise(
        category=FutureWarning,
        message=r"`is_gradient_checkpointing` is deprecated",
        module=r"transformers\.modeling_utils",
        why="peft <= 0.21 (PeftModel.__init__) still reads transformers 5's deprecated alias on every get_peft_model; "
        "nothing for the user to change",
    ),
)


class _DropLogged(logging.Filter):
    def __init__(self, noise: LoggedNoise):
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.noise.starts) and all(part in message for part in self.noise.contains))


_FILTERS: list[tuple[logging.Logger, _DropLogged]] = []


def verbose_requested() -> bool:
    """True when the environment asks to see upstream noise (``HF_FSDP_QLORA_VERBOSE`` set to 1/true/yes/on)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_upstream() -> bool:
    """Install the filters of :data:`NOISE` (idempotent), unless :func:`verbose_requested`. Returns whether they
    are installed."""
    if verbose_requested():
        return False
    for noise in NOISE:
        if isinstance(noise, WarnedNoise):  # idempotent: warnings moves an equal entry to the front
            warnings.filterwarnings("ignore", message=noise.message, category=noise.category, module=noise.module)
        elif not any(drop.noise == noise for _, drop in _FILTERS):
            logger = logging.getLogger(noise.logger)  # the same object upstream gets when it is imported later
            drop = _DropLogged(noise)
            logger.addFilter(drop)
            _FILTERS.append((logger, drop))
    return True
