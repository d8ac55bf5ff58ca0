"""Is a transformers config a causal language model we can fine-tune? One rule for the loader and the doctor."""

from __future__ import annotations

__all__ = ["REFUSED_FAMILIES", "causal_lm_fix", "causal_lm_problem", "refused_family"]


def causal_lm_problem(config) -> str | None:
    """``None`` when `config` describes a causal LM with an LM head; otherwise what it is instead, for a message.

    A saved ``BertModel`` has a model type with a causal-LM class but its weights have no LM head, so the saved
    ``architectures`` must name a causal-LM class when they are given. An image-text class
    (``Qwen3_5ForConditionalGeneration``, ``MllamaForConditionalGeneration``, ...) has an LM head too: a multimodal
    checkpoint is accepted (its language model is what is fine-tuned; :mod:`hf_fsdp_qlora.towers`), and a family
    transformers maps only in ``AutoModelForImageTextToText`` loads through that. An encoder family (one with a masked-LM
    class: BERT, RoBERTa, ...) is a causal LM only when configured as a decoder; otherwise its "causal" class
    (``BertLMHeadModel``) attends both ways.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    causal = set()
    for names in (*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(), *MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()):
        causal.update([names] if isinstance(names, str) else names)
    architectures = getattr(config, "architectures", None) or []
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    generates = (
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        # a composite family's text model saved alone (MllamaForCausalLM writes model_type "mllama_text_model")
        or bool(architectures and all(a in causal for a in architectures))
    )
    if (
        encoder
        or not generates
        or (architectures and not any(a in causal or a.endswith("ForCausalLM") for a in architectures))
    ):
        return f"a {config.model_type!r} model ({', '.join(architectures) or 'no architectures'})"
    return None


def causal_lm_fix(config) -> str:
    """What to pass instead of the model `causal_lm_problem` refused: one sentence, for both messages."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return (
            f"{config.model_type!r} is an encoder family and this config has is_decoder=false, so its LM head "
            "attends both ways. Pass a causal language model (e.g. a Llama, Qwen2 or Mistral checkpoint), or, for a "
            f'{config.model_type!r} model trained as a decoder, set "is_decoder": true in its config.json.'
        )
    return "Pass a causal language model (e.g. a Llama, Qwen2 or Mistral checkpoint)."


# Families whose causal-LM class cannot be LoRA-fine-tuned on text, for a reason upstream (transformers 5.24, peft
# 0.21): model_type -> why, in words. Stock peft on the 16-bit model fails the same way.
REFUSED_FAMILIES = {
    "reformer": (
        "Reformer's reversible layers (ReformerModelWithLMHead) run in their own autograd function, whose output "
        "requires grad only through its inputs: with the base frozen, LoRA gets no gradient (stock peft on the "
        "16-bit model fails alike: 'element 0 of tensors does not require grad' at the first backward)"
    ),
    "git": (
        "GIT's causal-LM loss (GitForCausalLM) drops the logits of the image tokens it expects before the text even "
        "when no image is given, so on text alone the loss is misaligned with the labels (or empty: 'Expected input "
        "batch_size (0) to match target batch_size')"
    ),
}


def refused_family(config) -> str | None:
    """Why `config`'s family cannot be fine-tuned here (:data:`REFUSED_FAMILIES`), with what to do; else None."""
    reason = REFUSED_FAMILIES.get(getattr(config, "model_type", None))
    if reason is None:
        return None
    return (
        f"model type {config.model_type!r} is not supported: {reason}. This is a limit of the modelling code in "
        "transformers, not of the checkpoint. Fine-tune another causal language model (e.g. a Llama, Qwen2 or "
        "Mistral checkpoint)."
    )
