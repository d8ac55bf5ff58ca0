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
forward does that inline), so its backbone here is the text model: a batch with images reaching it through the fused
head is refused by name (:data:`IMAGE_INPUTS`) rather than trained with the images dropped.

The same head adds the router load-balancing loss for a mixture of experts whose text config declares
``output_router_logits`` (trl turns it on when ``router_aux_loss_coef`` is set, 0.001 for Llama 4) and reads the expert
count as ``text_config.num_experts``; ``Llama4TextConfig`` names it ``num_local_experts``: "'Llama4TextConfig' object
has no attribute 'num_experts'". :func:`expose_text_backbone` gives such a config ``num_experts`` too.
"""

from __future__ import annotations

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
        if "." in path:  # under a composite with towers: the text model alone must not see images
            _refuse_images(inner.get_submodule(path), type(inner).__name__, path)
    expose_expert_count(inner)
    return path


def _refuse_images(backbone: nn.Module, cls: str, path: str) -> None:
    def refuse(module, args, kwargs):
        given = [k for k in IMAGE_INPUTS if kwargs.get(k) is not None]
        if given:
            raise ValueError(
                f"{cls}: image-text training through trl's SFTTrainer is not supported: trl's fused LM head runs the "
                f"text backbone ({path}), which would drop {given}; the class has no backbone that merges the image "
                "features (and Llama 4's image processor needs torchvision). Train it on text rows (the tokenizer as "
                "processing_class), or an image-text family whose backbone takes images (Gemma 3/4, Qwen3.5, Mllama)."
            )

    if not getattr(backbone, "_hf_fsdp_qlora_refuses_images", False):
        backbone.register_forward_pre_hook(refuse, with_kwargs=True)
        backbone._hf_fsdp_qlora_refuses_images = True


def expose_expert_count(model: nn.Module) -> None:
    """``num_experts`` on the text config of a mixture of experts that names it ``num_local_experts`` only (see the
    module docstring); the same value, so the saved config still loads as before."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is None or not hasattr(text, "output_router_logits") or hasattr(text, "num_experts"):
        return
    if isinstance(getattr(text, "num_local_experts", None), int):
        text.num_experts = text.num_local_experts
