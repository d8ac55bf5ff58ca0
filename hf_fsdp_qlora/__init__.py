"""QLoRA fine-tuning under FSDP1/FSDP2 with the Hugging Face stack, that works the first time.

The public API is imported lazily so that the command-line tools start without importing torch.
Importing any training entry point (the trainers, the callback, the loader) also installs the CPU
rehearsal hook (see :mod:`hf_fsdp_qlora.cpu_rehearsal`), which acts only on machines without an
accelerator in a launch that asked for FSDP.
"""

from __future__ import annotations

import importlib

from . import _logging, _quiet
from . import distributed as _distributed

__version__ = "0.1.0.dev0"

# public name -> module that defines it
_EXPORTS = {
    "enable_cpu_fsdp": "cpu_rehearsal",
    "load_qlora_model": "loading.qlora",
    "FSDPQLoRATrainer": "train.trainer",
    "FSDPQLoRASFTTrainer": "train.sft_trainer",
    "FSDPQLoRACallback": "train.trainer_hook",  # importing it installs the Trainer hook
    "FSDPQLoRATrainingArguments": "train.training_args",
    "SampleGenerationsCallback": "train.generation",
    "PreemptionCallback": "train.trainer_hook",  # likewise: a Trainer given it gets our trainer's behaviour
    "PREEMPTED_EXIT_CODE": "train.preemption",
    "finish_distributed": "train.finish",
    "generate_under_fsdp": "train.generation",
    "prepare_for_evaluation": "train.generation",
    "save_adapter": "train.checkpoint",
    "DistinctBatchesCallback": "train.hygiene",
    "DuplicateBatchesError": "errors",
    "MemoryThroughputCallback": "train.hygiene",
    "LabelsCheckCallback": "train.hygiene",
    "NoLabelsError": "errors",
    "AdapterMismatchError": "errors",
    "FSDPNotEngagedError": "errors",
    "UnsupportedSetupError": "errors",
    "MergeError": "errors",
    "merge_adapters": "merge.pipeline",
    "export_gguf": "merge.gguf",
    "config_path": "configs",
    "list_configs": "configs",
    "check_setup": "doctor.checks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'hf_fsdp_qlora' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


_logging.configure()
# Precise filters (one message of one upstream logger or warning each; HF_FSDP_QLORA_VERBOSE=1 turns them off).
# Here, not in our trainers: `from transformers import Trainer` imports bitsandbytes, which prints while importing.
_quiet.quiet_upstream()

# A script launched for FSDP (`accelerate launch` with an FSDP config exports ACCELERATE_USE_FSDP) that only does
# `import hf_fsdp_qlora` gets the CPU rehearsal hook too: without it accelerate silently trains plain DDP on CPU
# ranks. Outside such a launch nothing heavy is imported here (the CLI starts without torch).
if _distributed.fsdp_requested_by_launch():
    from .cpu_rehearsal import enable_cpu_fsdp as _enable_cpu_fsdp

    _enable_cpu_fsdp()
