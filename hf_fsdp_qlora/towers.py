"""Multimodal checkpoints (Gemma 3/4, Qwen3.5, Mllama, Llama 4, ...): the language model is quantized and adapted,
the vision/audio towers and the projectors beside it are not.

transformers builds every image-text class the same way: one module named ``language_model`` (a text model, or for
Llama 4 a whole causal LM) and, beside it in the same parent, the towers and projectors (``vision_tower``,
``vision_model``, ``visual``, ``audio_tower``, ``multi_modal_projector``, ``embed_vision``, ...). Those siblings are
what this module calls the towers. Why they stay out of 4 bits and out of ``"all-linear"``:

- they are small (a 400M SigLIP beside a 27B language model) and their inputs are not text: NF4 error there shifts
  every image token, and users expect the released tower untouched;
- a LoRA on a tower trains image features, which is a choice (``lora_on_towers=True``), not a default;
- ``merge-adapters`` then leaves every tower tensor byte-identical.

A text-only class (``Qwen3_5ForCausalLM``, ``MllamaForCausalLM``, ...) has no ``language_model`` module and no towers.
"""

from __future__ import annotations

import copy
import logging
import re

from torch import nn

__all__ = [
    "auto_class_for",
    "concrete_class",
    "image_text_class",
    "keep_present_layer_classes",
    "lora_config_for_towers",
    "meta_model",
    "tower_modules",
    "tower_pattern",
]

logger = logging.getLogger(__name__)
# a sub-config whose name says it configures a non-text encoder
MEDIA = re.compile(r"vision|visual|image|audio|speech")


def tower_modules(model: nn.Module) -> list[str]:
    """The names of `model`'s towers and projectors: the modules holding parameters beside its (shallowest)
    ``language_model``. Empty for a model without one."""
    names = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "language_model"]
    if not names:
        return _nested_towers(model)
    language_model = min(names, key=lambda n: n.count("."))
    parent_name = language_model.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    prefix = f"{parent_name}." if parent_name else ""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None  # beside the language model in some classes: not a tower
    return [
        f"{prefix}{child}"
        for child, module in parent.named_children()
        if f"{prefix}{child}" != language_model and module is not head and any(True for _ in module.parameters())
    ]


def _nested_towers(model: nn.Module) -> list[str]:
    """Towers of a class without a ``language_model`` module (Phi-4-multimodal, GIT): every sub-model built from one of
    the root's vision/audio sub-configs (``vision_config``, ``audio_config``), widened to its highest ancestor that holds
    neither the input embeddings nor the decoder layers (Phi-4's ``embed_tokens_extend``: the image and audio
    encoders with their projections, which text never reaches)."""
    from transformers import PreTrainedModel

    media = _media_config_types(getattr(model, "config", None))
    found = [
        name
        for name, module in model.named_modules()
        if name and isinstance(module, PreTrainedModel) and type(getattr(module, "config", None)) in media
    ]
    if not found:
        return []
    text_modules = _text_path_modules(model)
    towers = {_widest_text_free(model, name, text_modules) for name in found}
    return sorted(t for t in towers if not any(t.startswith(f"{other}.") for other in towers))


def _media_config_types(config) -> set[type]:
    """The classes of `config`'s vision/audio sub-configs (``vision_config``, ``audio_config``, ...). Other
    sub-configs (BLT's byte encoder and decoder, an encoder-decoder's halves) are text: never towers."""
    if config is None:
        return set()
    return {
        type(value)
        for key, value in vars(config).items()
        if key.endswith("_config") and MEDIA.search(key) and hasattr(value, "to_dict")
    }


def _text_path_modules(model: nn.Module) -> set[int]:
    """ids of the modules text flows through: the input embeddings and the base model's decoder layers."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    return {id(m) for m in (embeddings, layers) if m is not None}


def _widest_text_free(model: nn.Module, name: str, text_modules: set[int]) -> str:
    """`name`, or its highest ancestor below the root none of whose submodules is on the text path."""
    best = name
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:depth])
        module = model.get_submodule(ancestor)
        if module is getattr(model, "base_model", None) or any(id(m) in text_modules for m in module.modules()):
            break
        best = ancestor
    return best


def keep_present_layer_classes(model: nn.Module) -> list[str]:
    """Drop from `model`'s ``_no_split_modules`` (and its sub-models') the classes it does not contain; returns them.

    FSDP's transformer wrap (accelerate's, and peft's under FSDP1) takes those names as the blocks to wrap and raises
    "Could not find the transformer layer class SiglipTextEmbeddings in the model" for a name the model lacks: Gemma 3
    inherits SigLIP's list, text embeddings included, but holds only SigLIP's vision tower. The classes it does hold,
    the towers' blocks among them (``SiglipEncoderLayer``), stay: each tower block is an FSDP unit of its own."""
    present = {type(m).__name__ for m in model.modules()}
    dropped = set()
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names and not isinstance(names, str) and set(names) - present:
            dropped |= set(names) - present
            module._no_split_modules = [n for n in names if n in present]  # this instance only, not its class
    return sorted(dropped)


def tower_pattern(towers: list[str]) -> str:
    """A regex (peft's ``exclude_modules`` fullmatch, transformers' skip-module match) for every module inside
    `towers`, the towers themselves included."""
    return rf"({'|'.join(re.escape(t) for t in towers)})(\..+)?"


def auto_class_for(config):
    """The auto class ``load_qlora_model`` loads `config` with: ``AutoModelForCausalLM`` where transformers maps the
    family there (Gemma 3 to its composite class, Qwen3.5/Mllama/Llama 4 to their text-only classes), else
    ``AutoModelForImageTextToText`` (image-text families with no causal-LM mapping)."""
    from transformers import AutoModelForCausalLM

    cls = image_text_class(config) or saved_text_class(config)
    return AutoModelForCausalLM if cls is None else cls


def saved_text_class(config):
    """The causal-LM class a composite family's text model was saved with (``MllamaForCausalLM`` writes model_type
    ``mllama_text_model``, which no auto class maps); None for a model type the auto classes know."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    known = {
        n
        for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        for n in ([names] if isinstance(names, str) else names)
    }
    architectures = [a for a in getattr(config, "architectures", None) or [] if a in known]
    return getattr(transformers, architectures[0], None) if architectures else None


def image_text_class(config):
    """``AutoModelForImageTextToText`` for a family transformers maps there but not in ``AutoModelForCausalLM``;
    None otherwise."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def concrete_class(model_class, config):
    """The model class `model_class` (an auto class, or a model class itself) builds for `config`; None if unknown."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    try:
        return mapping[type(config)]
    except (KeyError, ValueError):  # remote code, or no class for this config
        return None


def meta_model(config, model_class, dtype, trust_remote_code: bool = False):
    """`model_class` (an auto class or a model class) built from `config` on the meta device: nothing allocated."""
    import torch

    from .experts.dbrx import fuse_dbrx_experts

    with torch.device("meta"):
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        else:
            model = model_class._from_config(config, dtype=dtype)
    fuse_dbrx_experts(model)  # the experts as the loader holds them (DBRX's in transformers' layout)
    return model


def lora_config_for_towers(model: nn.Module, lora_config, lora_on_towers: bool = False):
    """`lora_config` limited to the language model: ``"all-linear"``, a list of layer names (or none: peft's default
    list for the family) leave the towers out
    (a list's ``q_proj`` would otherwise match SigLIP's too). A regex string is the caller's exact choice and is kept;
    so is everything with `lora_on_towers`."""
    towers = tower_modules(model)
    targets = lora_config.target_modules
    # None: peft's per-family default list (filled in later, inside inject_adapter), left out of the towers too
    if not towers or lora_on_towers or isinstance(targets, str) and targets != "all-linear":
        return lora_config
    lora_config = copy.deepcopy(lora_config)
    lora_config.exclude_modules = _with_exclusion(lora_config.exclude_modules, tower_pattern(towers))
    logger.info(
        "hf_fsdp_qlora: LoRA %r on %s leaves out its towers %s (16-bit, frozen; lora_on_towers=True adapts them)",
        targets, type(model).__name__, towers,
    )  # fmt: skip
    return lora_config


def _with_exclusion(exclude, pattern: str) -> str:
    """peft's ``exclude_modules`` (None, a regex fullmatched against each name, or a list of name suffixes) with the
    regex `pattern` added."""
    if not exclude:
        return pattern
    if isinstance(exclude, str):
        return f"(?:{exclude})|(?:{pattern})"
    suffixes = "|".join(re.escape(e) for e in exclude)
    return rf"(?:(.*\.)?({suffixes}))|(?:{pattern})"
