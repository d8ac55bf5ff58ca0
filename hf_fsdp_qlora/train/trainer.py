"""`FSDPQLoRATrainer`: `transformers.Trainer` with FSDP-consistent QLoRA. Same constructor and arguments."""

from __future__ import annotations

from transformers import Trainer

from ._trainer_mixin import FSDPSaveMixin
from .trainer_hook import install_trainer_hook

# Our callbacks reach our trainers through the Trainer.__init__ hook, the same code every route uses.
install_trainer_hook()

__all__ = ["FSDPQLoRATrainer"]


class FSDPQLoRATrainer(FSDPSaveMixin, Trainer):
    """A drop-in `transformers.Trainer` for QLoRA under FSDP1 and FSDP2 (and on CPU, for rehearsal).

    Accepts a model from :func:`~hf_fsdp_qlora.load_qlora_model` or any peft/4-bit model you loaded
    yourself. Before accelerate wraps it, :class:`~hf_fsdp_qlora.FSDPQLoRACallback` (installed
    automatically) makes every FSDP unit dtype-consistent, refuses setups that cannot work with an error
    naming the setting and value to use, and after wrapping checks that FSDP engaged. ``save_model``
    gathers the adapter from every rank and writes a plain peft adapter. (Our callbacks are added by the
    ``Trainer.__init__`` hook of :mod:`hf_fsdp_qlora.train.trainer_hook`, the same code every route uses.)
    """
