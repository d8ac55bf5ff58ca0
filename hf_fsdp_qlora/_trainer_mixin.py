"""What both of our trainer classes add to their upstream base: the callback, and FSDP-safe saving."""

from __future__ import annotations

import os

import torch

from .callbacks import FSDPQLoRACallback
from .checkpoint import save_adapter, unwrap_peft_model

TRAINING_ARGS_NAME = "training_args.bin"


def with_fsdp_callback(callbacks):
    """Our callback first, then the user's (skipping a duplicate instance of ours)."""
    callbacks = list(callbacks or [])
    if not any(isinstance(cb, FSDPQLoRACallback) or cb is FSDPQLoRACallback for cb in callbacks):
        callbacks.insert(0, FSDPQLoRACallback())
    return callbacks


class FSDPSaveMixin:
    """Overrides ``save_model`` so an FSDP-wrapped peft model saves its full adapter from all ranks."""

    @property
    def fsdp_callback(self) -> FSDPQLoRACallback | None:
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, FSDPQLoRACallback):
                return cb
        return None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        if not getattr(self, "is_fsdp_enabled", False) or unwrap_peft_model(self.model) is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Collective: every rank takes part in the gather; only the main process writes.
        save_adapter(self.model, output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
