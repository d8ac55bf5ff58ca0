"""Give trl's fused LM head the text backbone of classes whose ``base_model`` is not one.

trl 1.16's ``SFTTrainer`` always patches the model's forward with a fused LM head (``trl.trainer.utils.
add_fused_lm_head``; no switch turns it off). On each call it runs ``model.base_model`` and reads the output's
``last_hidden_state``. transformers' ``base_model`` is ``getattr(model, model.base_model_prefix, model)``, which is the
whole model, LM head included, for three released classes:

* ``Llama4ForCausalLM`` and ``MllamaForCausalLM``: ``base_model_prefix`` is ``"language_model"`` (the composite's
  name for them) but the backbone is ``.model``;
* ``Llama4ForConditionalGeneration``: ``base_model_prefix`` is ``"model"`` but it holds no ``.model``; its text
  backbone is ``.language_model.model`` (``.language_model`` is a whole ``Llama4ForCausalLM``).

The fused forward then fails: ``'MoeCausalLMOutputWithPast' object has no attribute 'last_hidden_state'``.
:func:`expose_text_backbone` gives such a model (only such a model) a ``base_model`` that returns its text
backbone, looked up by attribute path on each access, so FSDP1's wrappers and peft's layers are followed.

``Llama4ForConditionalGeneration`` has no module that merges the image features and returns hidden states (its own
forward does that inline, then runs the whole ``Llama4ForCausalLM``), so its backbone here is the text model with a
forward pre-hook: a batch whose ``pixel_values`` reach it is turned into the ``inputs_embeds`` the class's forward
builds, through the class's own methods (``get_input_embeddings``, ``get_image_features``, ``multi_modal_projector``,
``get_placeholder_mask``), and the text model returns the final-norm hidden states the class's LM head would read.
Other image inputs (:data:`IMAGE_INPUTS`) that the class does not take are refused by name, never dropped.

The same head adds the router load-balancing loss for a mixture of experts whose text config declares
``output_router_logits`` (trl turns it on when ``router_aux_loss_coef`` is set, 0.001 for Llama 4) and reads the expert
count as ``text_config.num_experts``; ``Llama4TextConfig`` names it ``num_local_experts``: "'Llama4TextConfig' object
has no attribute 'num_experts'". :func:`expose_text_backbone` gives such a config ``num_experts`` too.
"""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["IMAGE_INPUTS", "expose_expert_count", "expose_text_backbone", "text_backbone_path"]

# the inputs a text backbone would drop
IMAGE_INPUTS = ("pixel_values", "pixel_values_videos", "input_features", "image_embeds")

_CLASSES: dict[type, type] = {}


def _has_lm_head(module: nn.Module) -> bool:
    head = getattr(module, "get_output_embeddings", None)
    return callable(head) and head() is not None


def text_backbone_path(model: nn.Module) -> str | None:
    """The dotted path of `model`'s text backbone when ``model.base_model`` is not one (it is the model itself or
    holds an LM head), else None (nothing to fix, or no backbone found)."""
    base = getattr(model, "base_model", model)
    if base is not model and not _has_lm_head(base):
        return None
    path, module = [], model
    for _ in range(3):  # composite -> causal LM -> backbone at most
        name = next((n for n in ("model", "language_model") if isinstance(getattr(module, n, None), nn.Module)), None)
        if name is None:
            return None
        path.append(name)
        module = getattr(module, name)
        if not _has_lm_head(module):
            return ".".join(path)
    return None


def _with_backbone(cls: type, path: str) -> type:
    """`cls` with ``base_model`` returning the module at `path` (a cached subclass of the same name)."""
    key = (cls, path)
    if key not in _CLASSES:

        def base_model(self):
            return self.get_submodule(path)

        namespace = {"base_model": property(base_model), "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}  # fmt: skip
        _CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _CLASSES[key]


def expose_text_backbone(model: nn.Module) -> str | None:
    """Make ``base_model`` of `model` (or of the transformers model under its peft wrapper) its text backbone where
    it is not one (see the module docstring). Returns the backbone's path, or None when nothing changed."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, nn.Module):
        return None
    path = text_backbone_path(inner)
    if path is not None:
        inner.__class__ = _with_backbone(type(inner), path)
        if "." in path:  # under a composite with towers: the text model alone must not drop the images
            _merge_images(inner.get_submodule(path), inner, path)
    expose_expert_count(inner)
    return path


def _image_embeds(composite: nn.Module, input_ids, pixel_values):
    """The ``inputs_embeds`` ``Llama4ForConditionalGeneration.forward`` hands its language model for `input_ids` with
    image tokens and `pixel_values`, built with the class's own methods in the order its forward calls them."""
    embeds = composite.get_input_embeddings()(input_ids)
    features = composite.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
    projected = composite.multi_modal_projector(features.reshape(-1, features.size(-1)))
    projected = projected.to(embeds.device, embeds.dtype)
    mask = composite.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=projected)
    return embeds.masked_scatter(mask, projected)


def _merges_images(composite: nn.Module) -> bool:
    methods = ("get_image_features", "multi_modal_projector", "get_placeholder_mask")
    tower = getattr(composite, "vision_model", None)
    return isinstance(tower, nn.Module) and all(callable(getattr(composite, name, None)) for name in methods)


def _merge_images(backbone: nn.Module, composite: nn.Module, path: str) -> None:
    """A forward pre-hook on the text `backbone` of `composite`: ``pixel_values`` become the merged ``inputs_embeds``
    (:func:`_image_embeds`); image inputs it cannot merge are refused by name."""
    cls, merges = type(composite).__name__, _merges_images(composite)
    owner = weakref.ref(composite)  # the composite holds the backbone, which holds this hook: no cycle through it

    def merge(module, args, kwargs):
        kwargs.pop("vision_feature_select_strategy", None)  # the class's forward takes and ignores it
        pixels = kwargs.pop("pixel_values", None) if merges else None
        given = [k for k in IMAGE_INPUTS if kwargs.get(k) is not None]
        if given:
            raise ValueError(
                f"{cls}: image-text training through trl's SFTTrainer is not supported for {given}: trl's fused LM "
                f"head runs the text backbone ({path}), which would drop them. Train it on text rows (the tokenizer "
                f"as processing_class){' or on pixel_values' if merges else ''}."
            )
        if pixels is None:
            return None
        ids = args[0] if args else kwargs.pop("input_ids", None)
        if ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError(f"{cls}: pass input_ids with the image tokens and pixel_values, not inputs_embeds")
        kwargs["inputs_embeds"] = _image_embeds(owner(), ids, pixels)
        return (None, *args[1:]) if args else args, kwargs

    if not getattr(backbone, "_hf_fsdp_qlora_merges_images", False):
        backbone.register_forward_pre_hook(merge, with_kwargs=True)
        backbone._hf_fsdp_qlora_merges_images = True


def expose_expert_count(model: nn.Module) -> None:
    """``num_experts`` on the text config of a mixture of experts that names it ``num_local_experts`` only (see the
    module docstring); the same value, so the saved config still loads as before."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is None or not hasattr(text, "output_router_logits") or hasattr(text, "num_experts"):
        return
    if isinstance(getattr(text, "num_local_experts", None), int):
        text.num_experts = text.num_local_experts
