"""Every place this package works around, patches or leans on upstream internals - one entry each.

One module per upstream library, named for the library whose behaviour the entry works around (the first one its
``upstream`` names); ``multi`` holds an entry truly shared by several. The modules are only ever imported by their
full dotted name, so ``hf_fsdp_qlora._compat.torch`` never stands in for ``torch``.

The table is executable: ``tests/test_compat.py`` checks that every ``where`` resolves to our code, that every
``canary`` test exists, and that no new private access or patch of upstream appears in the package without an
entry here. A canary runs the STOCK upstream path and fails when upstream changes (fixed, or broken differently):
then read ``remove_when`` and drop or adapt the workaround. Import-light on purpose: no torch at import time.
"""

from __future__ import annotations

from hf_fsdp_qlora._compat import accelerate, bitsandbytes, multi, peft, torch, transformers, trl
from hf_fsdp_qlora._compat._entry import Workaround

__all__ = ["LIBRARIES", "WORKAROUNDS", "Workaround", "by_key"]

# The registry's modules, by the upstream library each covers.
LIBRARIES = {
    "accelerate": accelerate,
    "torch": torch,
    "bitsandbytes": bitsandbytes,
    "peft": peft,
    "transformers": transformers,
    "trl": trl,
    "multi": multi,
}

WORKAROUNDS: tuple[Workaround, ...] = tuple(entry for module in LIBRARIES.values() for entry in module.WORKAROUNDS)


def by_key(key: str) -> Workaround:
    """The entry named `key` (KeyError when there is none)."""
    for entry in WORKAROUNDS:
        if entry.key == key:
            return entry
    raise KeyError(key)
