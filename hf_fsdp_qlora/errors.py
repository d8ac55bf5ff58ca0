"""Exceptions raised by hf_fsdp_qlora. Every message names the problem, the setting and the value to use."""

from __future__ import annotations

__all__ = ["UnsupportedSetupError", "FSDPNotEngagedError"]


class UnsupportedSetupError(ValueError):
    """A configuration that cannot work under FSDP, detected before any wrapping or collective."""


class FSDPNotEngagedError(RuntimeError):
    """FSDP was asked for, but the prepared model is not FSDP-wrapped (accelerate fell back silently)."""
