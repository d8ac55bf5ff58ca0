"""Parameter names as files store them: without the segments that wrappers insert.

FSDP1 (``_fsdp_wrapped_module.``), activation checkpointing (``_checkpoint_wrapped_module.``) and
``torch.compile`` (``_orig_mod.``) add segments to the names a wrapped model reports; peft's saved keys and
every checkpoint file never carry them. Training (adapter gather) and merge (adapter reading) both use this.
"""

from __future__ import annotations

__all__ = ["WRAPPER_SEGMENTS", "clean_name"]

WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """`name` without FSDP1 / activation-checkpoint / compile wrapper segments."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name
