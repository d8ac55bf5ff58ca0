"""Old module paths that keep working after the modules moved into ``train/``, ``loading/`` and ``merge/``.

``from hf_fsdp_qlora.checkpoint import save_adapter`` (documented before the move) and ``training_args.bin``
files pickled with ``hf_fsdp_qlora.training_args.FSDPQLoRATrainingArguments`` still resolve. Importing an old
path (only then: a finder on ``sys.meta_path``, so tools that scan ``sys.modules`` never import the targets)
gives a light module that forwards attribute access to the new module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# old path -> new path, for the modules that were public (no leading underscore) before the move
MOVED = {
    "hf_fsdp_qlora.trainer": "hf_fsdp_qlora.train.trainer",
    "hf_fsdp_qlora.sft_trainer": "hf_fsdp_qlora.train.sft_trainer",
    "hf_fsdp_qlora.callbacks": "hf_fsdp_qlora.train.callbacks",
    "hf_fsdp_qlora.trainer_hook": "hf_fsdp_qlora.train.trainer_hook",
    "hf_fsdp_qlora.consistency": "hf_fsdp_qlora.train.consistency",
    "hf_fsdp_qlora.fsdp": "hf_fsdp_qlora.train.fsdp",
    "hf_fsdp_qlora.checkpoint": "hf_fsdp_qlora.train.checkpoint",
    "hf_fsdp_qlora.training_args": "hf_fsdp_qlora.train.training_args",
    "hf_fsdp_qlora.hygiene": "hf_fsdp_qlora.train.hygiene",
    "hf_fsdp_qlora.generation": "hf_fsdp_qlora.train.generation",
    "hf_fsdp_qlora.low_ram": "hf_fsdp_qlora.loading.low_ram",
}


class _Forwarding(types.ModuleType):
    """An old module path: attribute access goes to the module's new home, imported on first use."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"Moved to {new}; this name forwards to it.")
        self.__moved_to__ = new

    def __getattr__(self, name: str):
        if name.startswith("__"):  # tools probing every module in sys.modules (inspect, pickle) import nothing
            raise AttributeError(name)
        return getattr(importlib.import_module(self.__moved_to__), name)

    def __dir__(self):
        return dir(importlib.import_module(self.__moved_to__))


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _Forwarding(spec.name, MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
