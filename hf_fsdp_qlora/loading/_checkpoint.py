"""What a checkpoint is, read before any of its weights: its config, whether it is a causal LM, its own quantization
and whether it has fused MoE experts. The loader refuses what it cannot use here, before reading a weight."""

from __future__ import annotations

import torch

from ..causal_lm import causal_lm_fix, causal_lm_problem, refused_family
from ..errors import UnsupportedSetupError
from ..experts.detect import config_has_fused_experts
from ..model_config import load_config
from ..prequantized import checkpoint_quantization, quantized_bits, refuse_unviewable_storage

__all__ = [
    "load_config",
    "check_causal_lm",
    "check_checkpointing",
    "prequantized_check",
    "config_has_fused_experts",
    "supports_checkpointing",
]


def check_causal_lm(config) -> None:
    """Refuse a model with no causal-LM head: the loader fine-tunes for text generation only."""
    kind = causal_lm_problem(config)
    if kind is not None:
        raise UnsupportedSetupError(
            f"The model at this path is {kind}, which has no causal-LM head, so load_qlora_model cannot fine-tune "
            f"it for text generation. {causal_lm_fix(config)}"
        )
    refused = refused_family(config)
    if refused is not None:
        raise UnsupportedSetupError(f"load_qlora_model: {refused}")


def supports_checkpointing(model_or_class) -> bool:
    """Whether transformers' `gradient_checkpointing_enable` works on this model (class): a few families' classes
    (XLNet, OpenAI GPT, GPT-NeoX-Japanese) raise "does not support activation checkpointing"."""
    return bool(getattr(model_or_class, "supports_gradient_checkpointing", True))


def check_checkpointing(config, gradient_checkpointing, cls=None) -> None:
    """Refuse gradient_checkpointing=True on a family whose causal-LM class cannot checkpoint, naming it; `cls`: the
    built model's class, else the class transformers' auto mapping gives `config` (unknown: nothing to refuse)."""
    if gradient_checkpointing is not True:
        return
    if cls is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except (KeyError, ValueError):  # remote code, or no causal-LM class: decided once the model is built
            return
    if not supports_checkpointing(cls):
        raise UnsupportedSetupError(
            f"gradient_checkpointing=True, but {cls.__name__} (model type {config.model_type!r}) does not support "
            "activation checkpointing in transformers. Pass gradient_checkpointing=None (the default: off where the "
            "class cannot checkpoint) or False, and leave TrainingArguments.gradient_checkpointing off."
        )


def prequantized_check(config, dtype: torch.dtype, bits: int):
    """The checkpoint's own 4-bit quantization, refused before any weight is read if the run cannot use it."""
    saved_bits = quantized_bits(config)
    if bits == 8:
        if saved_bits == 4:
            raise UnsupportedSetupError(
                "bits=8 was asked for, but this checkpoint is pre-quantized in 4 bits (its config.json has "
                "quantization_config.load_in_4bit=true): its 4-bit weights cannot be turned back into 8 bits. Pass "
                "bits=4 to train it as it is, or load the original 16-bit checkpoint with bits=8."
            )
        checkpoint_quantization(config, allow_8bit=True)  # other methods are refused; a saved 8-bit base loads
        return None
    quant = checkpoint_quantization(config)
    if quant is not None and quant.storage != str(dtype).removeprefix("torch."):
        from ..errors import SetupInputError
        from ..model_shapes import model_shape  # the config's shapes, built on the meta device

        try:
            weights = {lin.name: lin.numel for lin in model_shape(config).linears if lin.quantized}
        except SetupInputError:  # no meta build from this config (remote code): from_pretrained will tell
            return quant
        refuse_unviewable_storage(quant, str(dtype), weights)
    return quant
