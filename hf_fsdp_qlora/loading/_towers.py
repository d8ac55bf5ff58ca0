"""The loader's multimodal steps (:mod:`hf_fsdp_qlora.towers` says what the towers are and why they stay 16-bit)."""

from __future__ import annotations

import logging

from ..errors import UnsupportedSetupError
from ..towers import meta_model, tower_modules

__all__ = ["refuse_low_ram_class", "towers_of"]

logger = logging.getLogger("hf_fsdp_qlora.loading.qlora")  # the loader's log lines, under one name


def towers_of(config, model_class, dtype, trust_remote_code: bool):
    """(the model `model_class` builds from `config` on the meta device, the names of its towers), or (None, ())
    where no meta build is possible (remote code that needs weights: transformers' own skip list then applies)."""
    try:
        meta = meta_model(config, model_class, dtype, trust_remote_code)
    except Exception:  # noqa: BLE001 - no meta build: from_pretrained says what is wrong, if anything
        return None, ()
    towers = tower_modules(meta)
    if towers:
        logger.info("hf_fsdp_qlora: %s: towers and projectors %s stay in %s (not quantized, frozen)",
                    type(meta).__name__, towers, dtype)  # fmt: skip
    return meta, tuple(towers)


def refuse_low_ram_class(model_class, low_cpu_ram: bool) -> None:
    """low_cpu_ram builds the other ranks' skeletons through ``AutoModelForCausalLM`` only."""
    from transformers import AutoModelForCausalLM

    if low_cpu_ram and model_class is not AutoModelForCausalLM:
        name = getattr(model_class, "__name__", repr(model_class))
        raise UnsupportedSetupError(
            f"low_cpu_ram=True with model_class={name}: the rank-0-reads loader builds AutoModelForCausalLM's class "
            "only. Pass low_cpu_ram=False (every rank reads the checkpoint), or load the family's "
            "AutoModelForCausalLM class (model_class=None) to train on text."
        )
