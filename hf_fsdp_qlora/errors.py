"""Exceptions raised by hf_fsdp_qlora. Every message names the problem, the setting and the value to use."""

from __future__ import annotations

__all__ = [
    "AdapterMismatchError",
    "DuplicateBatchesError",
    "FSDPNotEngagedError",
    "MergeError",
    "MergeUsageError",
    "NoLabelsError",
    "SetupInputError",
    "UnsupportedSetupError",
]


class UnsupportedSetupError(ValueError):
    """A configuration that cannot work under FSDP, detected before any wrapping or collective."""


class FSDPNotEngagedError(RuntimeError):
    """FSDP was asked for, but the prepared model is not FSDP-wrapped (accelerate fell back silently)."""


class MergeError(ValueError):
    """Merging adapters into a base model failed; nothing that looks like a finished model was left behind.

    `exit_code` is what the command line returns: 1 for a failed merge, 2 for a usage error.
    """

    exit_code = 1


class MergeUsageError(MergeError):
    """A merge or convert asked for in a way that cannot work (bad option, path or input file); exit status 2."""

    exit_code = 2


class SetupInputError(ValueError):
    """The doctor's input is unusable (not an accelerate config, unknown key, no config.json): exit status 2."""


class DuplicateBatchesError(RuntimeError):
    """Every rank draws the same samples: the data is not split across ranks."""


class NoLabelsError(ValueError):
    """Every label of a training batch is -100: the model would train on nothing at loss 0."""


class AdapterMismatchError(ValueError):
    """The adapter on disk was trained with a different configuration than the model it is loaded into."""
