"""Workarounds shared by several upstream libraries at once (one filter for bitsandbytes', peft's and trl's noise)."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="upstream_noise",
        upstream=(
            "bitsandbytes 0.50 (warns at import), peft <= 0.21 (reads transformers 5's deprecated property), "
            "trl <= 1.16 (its configs pass the deprecated gradient_checkpointing)"
        ),
        works_around=(
            "upstream lines with nothing to act on, on every rank (the list: hf_fsdp_qlora._quiet.NOISE); the "
            "caller's frame (sys._getframe) tells upstream's trigger from the user's own"
        ),
        where=("hf_fsdp_qlora._quiet.quiet_upstream", "hf_fsdp_qlora._quiet._show_unless_noise"),
        remove_when="upstream stops printing an entry of NOISE (drop that entry)",
        canary="tests/test_quiet.py::test_quiet_by_default_and_verbose_shows_upstream",
    ),
)
