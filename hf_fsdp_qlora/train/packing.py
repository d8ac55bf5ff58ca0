"""Padding-free packing (trl's ``padding_free=True``, ``packing=True`` with position ids): packed sequences stay apart.

A padding-free batch is one row holding several sequences back to back, with ``position_ids`` restarting at 0 for
each and no attention mask. Whether one sequence then attends to the ones before it depends on the attention path:

* flash attention (``flash_attention_2/3/4``, GPU only) reads the boundaries from the collator's ``cu_seq_lens`` /
  ``position_ids``;
* ``eager``, ``sdpa`` and ``flex_attention`` get a block-diagonal mask that transformers' ``create_causal_mask``
  builds from the ``position_ids`` - but only when the forward has no KV cache (the ``packed_mask_needs_no_cache``
  workaround in :mod:`hf_fsdp_qlora._compat`). ``Trainer`` sets ``config.use_cache`` from
  ``TrainingArguments.use_cache`` (default false); with ``use_cache=True`` (asked for by PEFT methods that read
  ``past_key_values``) and no gradient checkpointing (which switches the cache off), every training forward creates
  a cache and the mask is a plain causal mask over the whole row: each sequence sees all earlier ones and the loss is
  silently wrong. A padding-free batch is never one of those PEFT methods' inputs, so the cache is switched off here
  (``config.use_cache = False``);
* an attention function registered without a mask function (``AttentionInterface.register`` alone, or the
  ``paged|...`` generation kernels) gets no mask at all: no fix here, a clear error instead.

Decided once, at ``train()`` start (:class:`~hf_fsdp_qlora.FSDPQLoRACallback`'s ``on_train_begin``): nothing runs
per step.
"""

from __future__ import annotations

import logging

from ..errors import UnsupportedSetupError

__all__ = ["check_padding_free", "padding_free_collator"]

logger = logging.getLogger(__name__)


def padding_free_collator(collator) -> bool:
    """Whether `collator` packs each batch into one row without an attention mask (trl's and transformers')."""
    if collator is None:
        return False
    if getattr(collator, "padding_free", False):  # trl's DataCollatorForLanguageModeling (padding_free / bfd packing)
        return True
    return type(collator).__name__ == "DataCollatorWithFlattening"  # transformers' padding-free collator


def _config_of(model):
    seen = set()
    while model is not None and id(model) not in seen:  # FSDP1 / peft / checkpoint wrappers keep the config inside
        seen.add(id(model))
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config
        model = getattr(model, "module", None) or getattr(model, "base_model", None)
    return None


def check_padding_free(model, train_dataloader) -> str | None:
    """At ``train()`` start: make packed sequences invisible to each other, or refuse. Returns what was done, if any.

    Raises:
        UnsupportedSetupError: the model's attention implementation has no mask function, so transformers would
            give it no mask for a padding-free batch and packed sequences would attend to each other.
    """
    if not padding_free_collator(getattr(train_dataloader, "collate_fn", None)):
        return None
    config = _config_of(model)
    if config is None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    impl = config._attn_implementation
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise UnsupportedSetupError(
            f"Padding-free batches (trl padding_free=True or packing=True) with attn_implementation={impl!r}: "
            "transformers builds no attention mask for this implementation (it has no mask function registered), "
            "so every packed sequence would attend to the sequences packed before it and the loss would be wrong. "
            "Load the model with attn_implementation='flash_attention_2' (GPU) or 'sdpa' (any device), or set "
            "padding_free=False."
        )
    if getattr(config, "use_cache", False) and not impl.startswith("flash_attention"):
        # With a cache, create_causal_mask skips the packed-sequence mask (transformers' masking_utils).
        config.use_cache = False
        logger.info(
            "hf_fsdp_qlora: padding-free batches with attn_implementation=%r: model.config.use_cache set to False "
            "so transformers masks each packed sequence from the others (a KV cache is never read in training)",
            impl,
        )
        return "use_cache off"
    return "safe"
