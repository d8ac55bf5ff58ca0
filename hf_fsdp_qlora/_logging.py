"""The package's logger, configured the way transformers configures its own.

transformers gives its library root logger a handler and a default level, so its messages are seen without the
user calling ``logging.basicConfig``. We do the same for ``hf_fsdp_qlora`` with INFO as the default, so the few
lines that say what we did (FSDP engaged, the activation checkpointing choice, parameters cast) are printed. INFO
lines are printed by the main process only (rank 0); warnings and errors by every rank. Users turn them down with
``logging.getLogger("hf_fsdp_qlora").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["configure", "human_size"]

_LIBRARY = "hf_fsdp_qlora"
_configured = False


class _MainProcessInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from .distributed import is_main_process

        return record.levelno >= logging.WARNING or is_main_process()


def _configure() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger(_LIBRARY)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        handler.addFilter(_MainProcessInfo())
        root.addHandler(handler)
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        root.propagate = False
    _configured = True


def human_size(nbytes: float) -> str:
    """Bytes for a log line, in binary units: ``1536`` -> ``"1.5 KB"``."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GB"


def configure() -> None:
    """Install the library's handler (idempotent). Called when ``hf_fsdp_qlora`` is imported; every module's
    ``logging.getLogger(__name__)`` is a child of the library logger and uses it."""
    _configure()
