"""Linear layers that some families' forward never runs as layers, so neither 4 bits nor LoRA can apply there.

- Cross-attention of the decoder of an encoder-decoder family (BART, Marian, Whisper, ProphetNet, TrOCR, ...): their
  causal-LM classes (``BartForCausalLM``, ...) are the decoder alone, and its cross-attention layers attend to
  ``encoder_hidden_states``, which a causal-LM forward never has. They are skipped, so LoRA there would train nothing
  (no gradient, and an adapter that claims layers it never changed): our ``"all-linear"`` leaves them out.
- Weights the forward reads directly instead of calling the layer (Mamba's ``dt_proj``: ``dt_proj.weight @ x``;
  Gemma 3n's AltUp coefficients):
  bitsandbytes' packed 4-bit bytes cannot be read so, and a LoRA on the layer would be bypassed. They stay 16-bit,
  ``"all-linear"`` leaves them out, and LoRA named on them is refused.
- Linear layers inside a module whose forward runs without autograd (``@torch.no_grad()``): the sparse-attention
  indexers of DeepSeek-V3.2 and GLM-MoE-DSA, whose scores only pick the top-k tokens. A LoRA there never gets a
  gradient (it would stay at its initial value and claim layers it never changed): ``"all-linear"`` leaves them out.
- Linear layers that share one weight (Zamba's attention block, tied across its hybrid layers): peft gives each its
  own LoRA, which no merge can fold into the one stored weight; ``"all-linear"`` leaves them out.
- Linear layers the modelling code itself freezes when it builds the model (BLT's entropy patcher, whose output only
  sets the patch lengths): no gradient reaches them either, and ``"all-linear"`` leaves them out.
"""

from __future__ import annotations

import copy
import logging
import re

from torch import nn

from ..errors import UnsupportedSetupError

__all__ = [
    "CROSS_ATTENTION",
    "READ_AS_WEIGHT",
    "cross_attention_modules",
    "family_skip_modules",
    "float32_linear_layers",
    "frozen_by_model",
    "lora_config_for_family",
    "no_grad_linear_layers",
    "tied_linear_layers",
]

logger = logging.getLogger(__name__)

# transformers' names for a decoder layer's attention over the encoder's output
CROSS_ATTENTION = ("encoder_attn", "cross_attn", "crossattention")
# model_type -> linear layers its forward reads as `.weight` (modeling_mamba.py: `self.dt_proj.weight @ time_step`)
# (Gemma 3n's AltUp: `self.correction_coefs.weight.clamp(...)`, and `self.prediction_coefs.weight.data.clamp_(...)`
# in training, which on packed 4-bit bytes would silently rewrite them). falcon_mamba and jamba read dt_proj.weight
# too, but run the layer instead when the model is quantized: not listed.
_ALTUP = ("correction_coefs", "prediction_coefs")
# LongCat-Flash's router: `F.linear(hidden_states.float(), self.classifier.weight.float())`.
READ_AS_WEIGHT = {"mamba": ("dt_proj",), "gemma3n": _ALTUP, "gemma3n_text": _ALTUP, "longcat_flash": ("classifier",)}


def cross_attention_modules(model: nn.Module) -> list[str]:
    """The names of `model`'s cross-attention modules (empty for a decoder-only family)."""
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in CROSS_ATTENTION]


def _runs_without_grad(forward) -> bool:
    """True for a forward decorated with ``torch.no_grad()`` / ``torch.inference_mode()``: torch's decorator wraps
    it in a function whose closure holds the context manager's factory (the bound ``clone`` of an instance)."""
    import torch

    while forward is not None:
        for cell in getattr(forward, "__closure__", None) or ():
            try:
                owner = getattr(cell.cell_contents, "__self__", None)
            except ValueError:  # an empty cell
                continue
            if isinstance(owner, (torch.no_grad, torch.inference_mode)) and getattr(owner, "mode", True):
                return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def no_grad_linear_layers(model: nn.Module) -> list[str]:
    """The full names of the linear layers inside modules whose forward runs without autograd."""
    names = []
    for name, module in model.named_modules():
        if name and _runs_without_grad(type(module).forward):
            names += [f"{name}.{n}" for n, m in module.named_modules() if n and isinstance(m, nn.Linear)]
    return sorted(set(names))


def tied_linear_layers(model: nn.Module) -> list[str]:
    """The full names of the linear layers whose weight is one tensor with another linear layer's."""
    by_weight: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear):
            by_weight.setdefault(id(module.weight), []).append(name)
    return sorted(name for names in by_weight.values() if len(set(names)) > 1 for name in set(names))


def frozen_by_model(model: nn.Module) -> list[str]:
    """The full names of the linear layers that `model`'s class freezes in its own ``__init__``, read from a fresh
    instance on the meta device (nothing allocated); built only where the class's module freezes anything."""
    import inspect
    import sys

    import torch

    source = sys.modules.get(type(model).__module__)
    try:
        text = inspect.getsource(source) if source is not None else ""
    except (OSError, TypeError):  # no source to read (compiled, or built in a notebook)
        return []
    if "requires_grad = False" not in text and "requires_grad_(False)" not in text:
        return []
    try:
        with torch.device("meta"):
            fresh = type(model)._from_config(model.config)
    except Exception:  # noqa: BLE001 - a class that cannot be built from its config alone: nothing is known
        return []
    return [n for n, m in fresh.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]


def family_skip_modules(config) -> tuple[str, ...]:
    """The layers of this family that must stay 16-bit (its forward reads their weight directly)."""
    return READ_AS_WEIGHT.get(getattr(config, "model_type", None), ())


def float32_linear_layers(model: nn.Module | None, dtype) -> list[str]:
    """The full names of `model`'s linear layers whose weight transformers loads in float32 into a `dtype` model
    (``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` under float16: its dtype plan, matched as it
    matches it): kept out of 4-bit quantization, as their class computes them in float32 (HY-V4's indexer
    ``weights_proj``). `model`: built on the meta device (None: nothing is known)."""
    import torch

    plan = getattr(model, "_get_dtype_plan", None)
    try:
        keys = [k for k, v in (plan(dtype) if plan else {}).items() if v == torch.float32]
    except Exception:  # noqa: BLE001 - a transformers without the plan: its bitsandbytes rules alone apply
        return []
    if not keys:
        return []
    pattern = re.compile("|".join(f"(?:{k.replace('*', '.*')})" for k in keys))  # transformers' glob alternation
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and pattern.search(f"{n}.weight"))


def lora_config_for_family(model: nn.Module, lora_config):
    """`lora_config` with ``"all-linear"`` leaving out the layers above (explicit targets are checked instead; a
    config with its own ``exclude_modules`` is left as given). A target list that lora_config_for_experts resolved
    from ``"all-linear"`` on an MoE model counts as ``"all-linear"``."""
    direct = family_skip_modules(model.config)
    targets = lora_config.target_modules
    resolved = targets == "all-linear" or getattr(lora_config, "hf_fsdp_qlora_linear_targets", False)
    if isinstance(targets, (list, set, tuple)) and direct and not resolved:
        named = sorted(set(targets) & set(direct))
        if named:
            raise UnsupportedSetupError(
                f"LoRA target_modules names {named} of this {model.config.model_type!r} model: its forward reads "
                f"{named[0]}.weight directly instead of running the layer, so a LoRA there would never train (and "
                f"the layer stays 16-bit). Leave {named} out of target_modules, or use 'all-linear'."
            )
    if not resolved or getattr(lora_config, "exclude_modules", None):
        return lora_config
    left_out, patterns = _left_out(model, direct)
    if not left_out:
        return lora_config
    lora_config = copy.deepcopy(lora_config)
    lora_config.exclude_modules = "|".join(patterns)  # peft: re.fullmatch against each module's full name
    logger.info(
        "hf_fsdp_qlora: all-linear on %s leaves out %s (cross-attention: a causal-LM forward has no encoder output; "
        "dt_proj: read as a weight, not run as a layer; layers run without grad or frozen by the model: their LoRA would "
        "never train; layers sharing a weight: their LoRAs could not be merged into it)",
        type(model).__name__,
        left_out,
    )
    return lora_config


def _left_out(model: nn.Module, direct: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """What all-linear leaves out of `model`, in words, and as peft ``exclude_modules`` patterns."""
    left_out, patterns = list(direct), [rf"(.*\.)?({'|'.join(direct)})"] if direct else []
    no_grad = sorted({*no_grad_linear_layers(model), *frozen_by_model(model)})
    if no_grad:
        left_out.append(f"{len(no_grad)} layers no gradient reaches (e.g. {no_grad[0]})")
        patterns.append("|".join(re.escape(n) for n in no_grad))
    tied = tied_linear_layers(model)
    if tied:
        left_out.append(f"{len(tied)} layers sharing one weight (e.g. {tied[0]})")
        patterns.append("|".join(re.escape(n) for n in tied))
    if cross_attention_modules(model):
        left_out += list(CROSS_ATTENTION)
        patterns.append(rf".*\.({'|'.join(CROSS_ATTENTION)})\..+")  # the linear layers inside them
    return left_out, patterns
