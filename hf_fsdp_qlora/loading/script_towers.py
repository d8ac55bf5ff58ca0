"""Multimodal towers for unchanged scripts under ``-m hf_fsdp_qlora.run`` (trl's ``sft.py --load_in_4bit
--use_peft``, or a script of yours building trl's ``SFTTrainer`` with a processor).

Such a script loads its model itself: trl's ``create_model_from_path`` calls ``<architectures[0]>.from_pretrained(
path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))``, the image-text class for a released
multimodal checkpoint. bitsandbytes would quantize every linear layer of its vision/audio towers and projectors, and
peft's ``all-linear`` (or a list such as ``q_proj,v_proj``) would put LoRA on them. Here, as in ``load_qlora_model``
(:mod:`hf_fsdp_qlora.towers`):

- :func:`keep_towers_of_script_loads` wraps ``PreTrainedModel.from_pretrained``: a 4-bit or 8-bit load of a class
  with towers adds them to ``llm_int8_skip_modules`` (after transformers' own list, which a given list replaces);
  every loaded model's ``_no_split_modules`` keeps only the classes it holds (:func:`~hf_fsdp_qlora.towers.
  keep_present_layer_classes`: FSDP's transformer wrap raises for the others);
- :func:`limit_script_lora_to_language_model` wraps peft's ``BaseTuner.inject_adapter``: the adapter's
  ``exclude_modules`` gains the towers, unless ``HF_FSDP_QLORA_LORA_ON_TOWERS=1`` (read by the launcher).

``load_qlora_model``'s own loads pass untouched (it does both itself).
"""

from __future__ import annotations

import copy
import functools
import logging

__all__ = ["keep_towers_of_script_loads", "limit_script_lora_to_language_model"]

logger = logging.getLogger(__name__)


def keep_towers_of_script_loads() -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` once (installed before the experts stream's wrapper, which then wraps
    this one and keeps its own settings on the outermost function)."""
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"].__func__
    if getattr(current, "hf_fsdp_qlora_towers", False):
        return

    @functools.wraps(current, updated=())  # not the stream wrapper's settings: they belong to its own function
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if not model_args:
            kwargs = _with_towers_kept(cls, pretrained_model_name_or_path, kwargs)
        loaded = current(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        from ..towers import keep_present_layer_classes

        # FSDP's transformer wrap refuses a listed class the model lacks (Gemma 3: SiglipTextEmbeddings)
        keep_present_layer_classes(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    from_pretrained.hf_fsdp_qlora_towers = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _with_towers_kept(cls, source, kwargs: dict) -> dict:
    """`kwargs` with the towers of the model `cls` builds added to the quantization's skip list (a copy); `kwargs`
    itself for any load without towers or without bitsandbytes quantization."""
    from ..experts.script_stream import loads_untouched

    quant = kwargs.get("quantization_config")
    if loads_untouched() or not (getattr(quant, "load_in_4bit", False) or getattr(quant, "load_in_8bit", False)):
        return kwargs
    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        try:
            from ._checkpoint import load_config

            config = load_config(source, bool(kwargs.get("trust_remote_code")))
        except Exception:  # noqa: BLE001 - transformers' own call says what is wrong with the path
            return kwargs
    if not any(getattr(config, f"{kind}_config", None) is not None for kind in ("vision", "audio")):
        return kwargs  # no tower in the config: no meta build needed
    from ..towers import meta_model, tower_modules
    from .int8 import modules_kept_16bit

    try:
        meta = meta_model(config, cls, _dtype(kwargs.get("dtype")))
    except Exception:  # noqa: BLE001 - no meta build: transformers' own skip list applies
        return kwargs
    towers = tower_modules(meta)
    if not towers:
        return kwargs
    given = list(quant.llm_int8_skip_modules or [])
    quant = copy.deepcopy(quant)
    quant.llm_int8_skip_modules = (
        [*given, *(t for t in towers if t not in given)]
        if given
        else modules_kept_16bit(config, towers, None, model=meta)
    )
    logger.info("hf_fsdp_qlora: %s.from_pretrained keeps its towers and projectors %s unquantized",
                cls.__name__, towers)  # fmt: skip
    return {**kwargs, "quantization_config": quant}


def _dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype, torch.float32) if isinstance(dtype, str) else torch.float32


def limit_script_lora_to_language_model(lora_on_towers: bool) -> None:
    """Wrap peft's ``BaseTuner.inject_adapter`` (outside the experts hook, so its adapter-config rewrite sees the
    towers left out): LoRA on the language model only, unless `lora_on_towers`. Later calls replace the setting."""
    from peft.tuners.tuners_utils import BaseTuner

    original = BaseTuner.inject_adapter
    settings = getattr(original, "hf_fsdp_qlora_towers", None)
    if settings is not None:
        settings["lora_on_towers"] = lora_on_towers
        return
    settings = {"lora_on_towers": lora_on_towers}

    @functools.wraps(original)  # keeps the experts hook's settings reachable from the outermost function
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        from ..towers import lora_config_for_towers

        config = self.peft_config[adapter_name]
        limited = lora_config_for_towers(model, config, settings["lora_on_towers"])
        if limited is not config:  # in place: peft keeps (and saves) this config object
            config.exclude_modules = limited.exclude_modules
        return original(self, model, adapter_name, *args, **kwargs)

    inject_adapter.hf_fsdp_qlora_towers = settings
    BaseTuner.inject_adapter = inject_adapter
