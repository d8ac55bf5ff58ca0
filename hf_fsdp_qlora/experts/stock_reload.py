"""Adapters of mixture-of-experts models saved in a form stock peft reloads as trained.

peft 0.21 converts every LoRA config it injects on a model type transformers 5 converts (DeepSeek-V2/V3, GLM-4-MoE,
Qwen3-MoE, ...) as if it were written for transformers 4: each ``target_modules`` name ending in ``gate_proj`` /
``up_proj`` / ``down_proj`` (leaf, full name or regex alike) is moved onto the routed experts' fused parameters. An
all-linear adapter of such a model (LoRA on the dense first layers' MLPs and on the shared experts) reloaded through
``PeftModel.from_pretrained`` or ``load_adapter`` then puts LoRA on the routed experts and drops the dense and
shared-expert LoRA (only rank_pattern warnings; logits 0.7 off on a tiny DeepSeek-V3). No spelling of those names in
``target_modules`` escapes the conversion, but ``target_parameters`` are never converted: peft's LoRA on a
parameter (``ParamWrapper``) of a linear layer's 2-D ``weight`` adds ``scale x B A`` to it, the same update as LoRA on
the layer, under the same state-dict keys (``...mlp.gate_proj.lora_A.weight``) and shapes.

So the config a loaded model saves names those layers' weights in ``target_parameters`` (:func:`save_stock_form`),
and our loaders turn such names back into LoRA on the linear layers (:func:`linear_weights_as_modules`: a 4-bit
weight has no 16-bit tensor to add an update to). peft's ``ParamWrapper`` refuses ``lora_dropout != 0``: the saved
config says 0 (dropout acts only in training; the adapter's values are what was trained).
"""

from __future__ import annotations

import copy
import logging
import re
from contextlib import contextmanager

from torch import nn

__all__ = [
    "MARK",
    "keep_adapter_keys",
    "linear_weights_as_modules",
    "linear_weights_as_modules_within",
    "save_stock_form",
    "stock_form",
]

logger = logging.getLogger(__name__)

MARK = "hf_fsdp_qlora_linear_targets"  # on a config whose linear targets peft must not convert (experts.py)


def _linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of `model` by name, those an adapter already wraps included (peft's LoRA layer in their
    place, the linear layer its ``base_layer``): a second adapter on the same layers goes there too."""
    return {
        name: module
        for name, module in model.named_modules()
        if name and (isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear))
    }


def _converted_away(model: nn.Module, lora_config) -> list[str]:
    """The ``target_modules`` names peft's transformers-v5 conversion would move off the linear layers."""
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    names = list(lora_config.target_modules or [])
    probe = copy.deepcopy(lora_config)
    try:
        convert_peft_config_for_transformers(probe, model=model, conversions=None)
    except ValueError:  # peft refuses part of a fused pair: it would not reload such a config at all
        return names
    kept = set(probe.target_modules or [])
    return [name for name in names if name not in kept]


def stock_form(model: nn.Module, lora_config) -> dict | None:
    """Before peft injects `lora_config` (a list of linear targets, marked by ``lora_config_for_experts``) into
    `model`: the ``target_modules`` / ``target_parameters`` / ``lora_dropout`` its saved config needs so that stock
    peft reloads it as trained, or None where peft converts none of its names."""
    if not getattr(lora_config, MARK, False) or isinstance(lora_config.target_modules, str):
        return None
    away = _converted_away(model, lora_config)
    if not away:
        return None
    linear = _linear_modules(model)
    moved, kept = [], []
    for target in lora_config.target_modules:
        hits = [n for n in linear if n == target or n.endswith(f".{target}")]
        if target in away and hits:
            moved.extend(f"{n}.weight" for n in hits)
        else:
            kept.append(target)
    if not moved:
        return None
    params = sorted(set(lora_config.target_parameters or []) | set(moved))
    return {"target_modules": sorted(kept), "target_parameters": params, "lora_dropout": 0.0}


def save_stock_form(peft_config, form: dict | None) -> None:
    """Set `form` (:func:`stock_form`) on the live adapter's config after injection: what every save writes. The
    layers peft built keep their dropout; only the saved description changes."""
    if form is None:
        return
    for key, value in form.items():
        setattr(peft_config, key, value)
    logger.info(
        "hf_fsdp_qlora: the adapter's config names %d linear weights peft would move onto the routed experts in "
        "target_parameters (saved lora_dropout 0), so that stock peft reloads it as trained",
        len(form["target_parameters"]),
    )


def linear_weights_as_modules(model: nn.Module, lora_config) -> dict | None:
    """Before peft injects `lora_config` into `model`: ``target_parameters`` that name a linear layer's weight become
    ``target_modules`` (LoRA on the layer: the same update, and the only one a 4-bit layer can take), and the config
    is marked so that peft converts none of its names. Returns the saved form to put back after injection (a later
    save writes it again), or None where no such name is present."""
    params = list(getattr(lora_config, "target_parameters", None) or [])  # LoRA only (peft's other tuners lack it)
    if not params or isinstance(lora_config.target_modules, str):  # a regex: peft's own rules
        return None
    linear = _linear_modules(model)
    layers = [
        p.removesuffix(".weight") for p in params if p.endswith(".weight") and p.removesuffix(".weight") in linear
    ]
    if not layers:
        return None
    saved = {
        "target_modules": copy.copy(lora_config.target_modules),
        "target_parameters": copy.copy(lora_config.target_parameters),
        "lora_dropout": lora_config.lora_dropout,
    }
    lora_config.target_modules = sorted(set(lora_config.target_modules or []) | set(layers))
    rest = [p for p in params if p.removesuffix(".weight") not in set(layers)]
    lora_config.target_parameters = rest or None
    setattr(lora_config, MARK, True)
    return saved


@contextmanager
def linear_weights_as_modules_within(model: nn.Module, configs: dict):
    """Within (peft injecting an adapter into `model`): :func:`linear_weights_as_modules` on every adapter's config
    in `configs` (peft compares a new adapter's ``target_parameters`` with those of the adapters already there); on
    exit each config is its saved form again, so that a later save writes it."""
    saved = {name: linear_weights_as_modules(model, config) for name, config in configs.items()}
    try:
        yield
    finally:
        for name, form in saved.items():
            for key, value in (form or {}).items():
                setattr(configs[name], key, value)


@contextmanager
def keep_adapter_keys():
    """Within (peft loading a saved adapter): an adapter whose every LoRA key already names one of the model's LoRA
    tensors, as peft saves them, loads under those names. peft 0.21 runs every adapter's keys through transformers'
    renamings of the family's original checkpoint names, and some of those also match the model's own names:
    Laguna's ``mlp.shared_expert.`` (an unescaped dot) turns ``mlp.shared_experts.gate_proj`` into
    ``mlp.shared_experts..gate_proj``, Inkling 2's ``sconv.weight_proj`` gains a ``.weight``; those LoRA tensors
    then load nowhere, silently (stock peft on the 16-bit model too). Other adapters are converted as peft does."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_adapter_state_dict_for_transformers

    def convert(model, peft_config, adapter_state_dict, adapter_name="default"):
        names = {name for name, _ in model.named_parameters()}
        lora = [key for key in adapter_state_dict if ".lora_" in key]
        # peft's own step after this one: the adapter's name after each lora_* part of the key
        if lora and all(re.sub(r"(lora_[^.]*)", rf"\1.{adapter_name}", key) in names for key in lora):
            return adapter_state_dict
        return original(
            model=model, peft_config=peft_config, adapter_state_dict=adapter_state_dict, adapter_name=adapter_name
        )

    conversion.convert_peft_adapter_state_dict_for_transformers = convert
    try:
        yield
    finally:
        conversion.convert_peft_adapter_state_dict_for_transformers = original
