"""Upstream lines that are noise in a normal run, filtered one by one; ``HF_FSDP_QLORA_VERBOSE=1`` shows them.

Each filter matches one message of one source (a named logger, or a warning's category + message + module, and the
package whose code triggered it) and nothing else, so a real problem from the same library, and the same deprecation
triggered by the user's own code, still get through. Warnings are judged in ``warnings.showwarning`` (the stack
shows who triggered them; a warning filter sees only the module that raised them). They are installed when
``hf_fsdp_qlora`` is imported: bitsandbytes prints its line while being imported, and ``from transformers import
Trainer`` imports it, so a filter installed later (by our trainers or callback) would come too late. The
environment variable is read here, in one place, when the filters are installed; ``docs/quiet.md`` lists what is
suppressed and why.
"""

from __future__ import annotations

import logging
import os
import re
import sys
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
    """A ``warnings.warn`` of `category` whose message matches the regex `message`, raised in `module` (regex), and
    triggered by code of a package in `callers`: the first frame outside `module` (and outside generated code such
    as a dataclass ``__init__``) must belong to one of them. The same warning triggered by any other code, the
    user's own included, is shown."""

    category: type[Warning]
    message: str
    module: str
    callers: tuple[str, ...]
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
        module=r"transformers\.modeling_utils$",
        callers=("peft", "trl"),
        why="peft <= 0.21 (PeftModel.__init__) still reads transformers 5's deprecated alias on every get_peft_model, "
        "and trl <= 1.16 in unwrap_model_for_generation; nothing for the user to change",
    ),
    WarnedNoise(
        category=FutureWarning,
        message=r"`gradient_checkpointing` is deprecated",
        module=r"transformers\.training_args$",
        callers=("trl",),
        why="trl <= 1.16's configs default `gradient_checkpointing=True` (the deprecated alias of "
        "`activation_checkpointing`), so every trl config warns, trl's own scripts included; the user did not set it",
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


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "")


# Frames that only pass a call on, so the code above them is the trigger: any ``__getattr__`` (a PeftModel forwards
# reads to its base model), and our CPU rehearsal's wrapper of ``TrainingArguments.__post_init__``.
_FORWARDING = {("hf_fsdp_qlora.cpu_rehearsal", "__post_init__")}


def _trigger(noise: WarnedNoise, frame):
    """The frame of the code that triggered `noise`'s warning, or None when the warning was not raised in
    `noise.module`: the first frame, outward from the one that raised it, outside that module, a generated dataclass
    ``__init__`` and forwarding frames."""
    while frame is not None and _module(frame) in ("warnings", __name__):
        frame = frame.f_back
    if frame is None or not re.match(noise.module, _module(frame)):
        return None
    while frame is not None and (
        re.match(noise.module, _module(frame))
        or (frame.f_code.co_filename.startswith("<") and frame.f_code.co_name == "__init__")  # a dataclass's
        or (_module(frame), frame.f_code.co_name) in _FORWARDING
        or frame.f_code.co_name == "__getattr__"
    ):
        frame = frame.f_back
    return frame


_SHOWN: set[tuple[str, str, int]] = set()


def _show_unless_noise(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` with the noise of :data:`NOISE` dropped: called after the warning filters, while
    the frames that raised the warning are still on the stack, so it can see who triggered it."""
    text = str(message)
    for noise in NOISE:
        if not (
            isinstance(noise, WarnedNoise) and issubclass(category, noise.category) and re.match(noise.message, text)
        ):
            continue
        frame = _trigger(noise, sys._getframe(1))
        if frame is None:
            break
        caller = _module(frame)
        if any(caller == package or caller.startswith(package + ".") for package in noise.callers):
            return None
        # Our 'always' filter lets every occurrence reach this point, so that upstream's occurrence cannot use up
        # the location's 'default' (once per location) before the user's: show the user's once per calling line.
        key = (noise.message, frame.f_code.co_filename, frame.f_lineno)
        if key in _SHOWN:
            return None
        _SHOWN.add(key)
        break
    return _PREVIOUS_SHOWWARNING(message, category, filename, lineno, file, line)


_PREVIOUS_SHOWWARNING = warnings.showwarning


def quiet_upstream() -> bool:
    """Install the filters of :data:`NOISE` (idempotent), unless :func:`verbose_requested`. Returns whether they
    are installed."""
    global _PREVIOUS_SHOWWARNING
    if verbose_requested():
        return False
    for noise in NOISE:
        if isinstance(noise, WarnedNoise):
            # appended (after any filter the user set, which keeps precedence), and idempotent: an equal entry is
            # not appended twice. 'always' hands every occurrence to _show_unless_noise, which judges its caller.
            warnings.filterwarnings(
                "always", message=noise.message, category=noise.category, module=noise.module, append=True
            )
        elif not any(drop.noise == noise for _, drop in _FILTERS):
            logger = logging.getLogger(noise.logger)  # the same object upstream gets when it is imported later
            drop = _DropLogged(noise)
            logger.addFilter(drop)
            _FILTERS.append((logger, drop))
    if warnings.showwarning is not _show_unless_noise:
        _PREVIOUS_SHOWWARNING = warnings.showwarning
        warnings.showwarning = _show_unless_noise
    return True
