"""Linear layers that some families' forward never runs as layers, so neither 4 bits nor LoRA can apply there.

- Cross-attention of the decoder of an encoder-decoder family (BART, Marian, Whisper, ProphetNet, TrOCR, ...): their
  causal-LM classes (``BartForCausalLM``, ...) are the decoder alone, and its cross-attention layers attend to
  ``encoder_hidden_states``, which a causal-LM forward never has. They are skipped, so LoRA there would train nothing
  (no gradient, and an adapter that claims layers it never changed): our ``"all-linear"`` leaves them out.
- Weights the forward reads directly instead of calling the layer (Mamba's ``dt_proj``: ``dt_proj.weight @ x``):
  bitsandbytes' packed 4-bit bytes cannot be read so, and a LoRA on the layer would be bypassed. They stay 16-bit,
  ``"all-linear"`` leaves them out, and LoRA named on them is refused.
"""

from __future__ import annotations

import copy
import logging

from torch import nn

from ..errors import UnsupportedSetupError

__all__ = [
    "CROSS_ATTENTION",
    "READ_AS_WEIGHT",
    "cross_attention_modules",
    "family_skip_modules",
    "lora_config_for_family",
]

logger = logging.getLogger(__name__)

# transformers' names for a decoder layer's attention over the encoder's output
CROSS_ATTENTION = ("encoder_attn", "cross_attn", "crossattention")
# model_type -> linear layers its forward reads as `.weight` (modeling_mamba.py: `self.dt_proj.weight @ time_step`)
READ_AS_WEIGHT = {"mamba": ("dt_proj",)}


def cross_attention_modules(model: nn.Module) -> list[str]:
    """The names of `model`'s cross-attention modules (empty for a decoder-only family)."""
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in CROSS_ATTENTION]


def family_skip_modules(config) -> tuple[str, ...]:
    """The layers of this family that must stay 16-bit (its forward reads their weight directly)."""
    return READ_AS_WEIGHT.get(getattr(config, "model_type", None), ())


def lora_config_for_family(model: nn.Module, lora_config):
    """`lora_config` with ``"all-linear"`` leaving out the layers above (explicit targets are checked instead; a
    config with its own ``exclude_modules`` is left as given)."""
    direct = family_skip_modules(model.config)
    targets = lora_config.target_modules
    if isinstance(targets, (list, set, tuple)) and direct:
        named = sorted(set(targets) & set(direct))
        if named:
            raise UnsupportedSetupError(
                f"LoRA target_modules names {named} of this {model.config.model_type!r} model: its forward reads "
                f"{named[0]}.weight directly instead of running the layer, so a LoRA there would never train (and "
                f"the layer stays 16-bit). Leave {named} out of target_modules, or use 'all-linear'."
            )
    if targets != "all-linear" or getattr(lora_config, "exclude_modules", None):
        return lora_config
    left_out, patterns = list(direct), [rf"(.*\.)?({'|'.join(direct)})"] if direct else []
    if cross_attention_modules(model):
        left_out += list(CROSS_ATTENTION)
        patterns.append(rf".*\.({'|'.join(CROSS_ATTENTION)})\..+")  # the linear layers inside them
    if not left_out:
        return lora_config
    lora_config = copy.deepcopy(lora_config)
    lora_config.exclude_modules = "|".join(patterns)  # peft: re.fullmatch against each module's full name
    logger.info(
        "hf_fsdp_qlora: all-linear on %s leaves out %s (cross-attention: a causal-LM forward has no encoder output; "
        "dt_proj: read as a weight, not run as a layer)",
        type(model).__name__,
        left_out,
    )
    return lora_config
