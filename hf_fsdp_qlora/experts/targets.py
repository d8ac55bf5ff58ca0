"""LoRA targets on a mixture-of-experts model: "all-linear" spelled out as its linear layers (never the routers,
the indexers or the experts), and peft's transformers-v5 target conversion kept off for such a config."""

from __future__ import annotations

import logging
from contextlib import contextmanager

from torch import nn

from .layouts import is_experts_module
from .quantized import QuantizedExperts
from .routers import router_layers

__all__ = ["MAMBA_REFUSED", "MAMBA_TYPES", "keep_linear_targets", "lora_config_for_experts"]

logger = logging.getLogger(__name__)

# peft (0.21) refuses LoRA on these layers of its Mamba-based model types ("Module 'out_proj' is incompatible with
# Mamba-based models"), also when they come from "all-linear"; our "all-linear" leaves them out there (Nemotron-H
# has experts too: lora_config_for_experts spells "all-linear" out for it).
MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})


def lora_config_for_experts(model: nn.Module, lora_config):
    """`lora_config` made to fit a mixture-of-experts model (4-bit or 16-bit experts), before ``get_peft_model``.

    "all-linear" means the model's linear layers (attention, dense MLPs, shared experts), named here; never the
    routers (:mod:`hf_fsdp_qlora.experts.routers`). peft 0.21's transformers-v5 conversion would otherwise turn it, and any target named
    ``gate_proj`` / ``up_proj`` / ``down_proj`` (full names too), into parameter targets on the routed experts: the
    dense layers lose their LoRA and the default dropout fails in ``ParamWrapper``. The returned config is marked so
    that :func:`keep_linear_targets` switches that conversion off while peft builds the adapter. LoRA on the experts
    is asked for by name (``target_parameters``).
    """
    if lora_config.target_modules != "all-linear" or not any(is_experts_module(m) or isinstance(m, QuantizedExperts)
                                                              for m in model.modules()):  # fmt: skip
        return lora_config
    import copy

    names = _linear_targets(model)
    if getattr(model.config, "model_type", None) in MAMBA_TYPES:
        names = [n for n in names if n.rsplit(".", 1)[-1] not in MAMBA_REFUSED]
    lora_config = copy.deepcopy(lora_config)
    lora_config.target_modules = names
    lora_config.hf_fsdp_qlora_linear_targets = True  # not a dataclass field: never saved
    logger.info("hf_fsdp_qlora: LoRA targets on this MoE model (its linear layers): %s", names)
    return lora_config


def _own_linear_forward(module: nn.Module) -> bool:
    """A modelling file's ``nn.Linear`` subclass with a forward of its own (DeepSeek-V4's grouped output projection
    ``DeepseekV4GroupedLinear``: per-group blocks of one weight): peft's LoRA would add ``x A^T B^T`` as for a plain
    linear layer and fail on its shapes. bitsandbytes' 4-bit layers are plain linear layers here."""
    for cls in type(module).__mro__:
        if cls is nn.Linear:
            return False
        if cls.__module__.startswith("transformers.") and "forward" in cls.__dict__:
            return True
    return False


def _linear_targets(model: nn.Module) -> list[str]:
    """The linear layers but the output head, the routers and sparse attention's indexers, as peft targets: a leaf
    name where it names such layers only, else the full names of the layers it names. An indexer (DeepSeek-V3.2,
    GLM-MoE-DSA, Hunyuan v4 ...) only picks the keys attention reads by top-k: LoRA there never gets a gradient."""
    out = model.get_output_embeddings()
    routers = router_layers(model)
    linear, other = {}, set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        indexer = ".indexer." in f".{name}."
        plain = isinstance(module, nn.Linear) and not _own_linear_forward(module)
        if plain and module is not out and "." in name and name not in routers and not indexer:
            linear.setdefault(leaf, []).append(name)
        elif name:
            other.add(leaf)
    names = []
    for leaf, full in sorted(linear.items()):
        names.extend([leaf] if leaf not in other else full)
    return names


@contextmanager
def keep_linear_targets(lora_config):
    """Within: peft does not convert a config from :func:`lora_config_for_experts` as if written for transformers 4
    (its ``convert_peft_config_for_transformers`` remaps ``gate_proj``/``up_proj``/``down_proj`` targets onto the
    routed experts); other configs are converted as peft does."""
    if not getattr(lora_config, "hf_fsdp_qlora_linear_targets", False):
        yield
        return
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original
