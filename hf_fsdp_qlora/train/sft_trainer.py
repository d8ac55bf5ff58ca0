"""`FSDPQLoRASFTTrainer`: trl's `SFTTrainer` with FSDP-consistent QLoRA. Same constructor and arguments."""

from __future__ import annotations

from trl import SFTTrainer

from ._trainer_mixin import FSDPSaveMixin
from .trainer_hook import install_trainer_hook

# Our callbacks reach our trainers through the Trainer.__init__ hook, the same code every route uses.
install_trainer_hook()

__all__ = ["FSDPQLoRASFTTrainer"]


class FSDPQLoRASFTTrainer(FSDPSaveMixin, SFTTrainer):
    """A drop-in `trl.SFTTrainer` for QLoRA under FSDP1 and FSDP2. See :class:`~hf_fsdp_qlora.FSDPQLoRATrainer`.

    A base model plus ``peft_config`` works too: trl builds the peft model inside ``__init__``, and our
    callback runs after that, before wrapping.
    """
