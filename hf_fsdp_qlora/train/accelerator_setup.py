"""Around the Trainer's `create_accelerator_and_postprocess`: the two settings transformers refuses under FSDP that
we handle (set aside while it runs), activation checkpointing applied exactly once after the plugin exists, and
FSDP's checkpoint wrappers made to recompute with the forward's dropout masks."""

from __future__ import annotations

import contextlib
import functools
import logging

__all__ = ["preserve_checkpoint_rng_state", "resolve_activation_checkpointing", "set_aside_refused_settings"]

logger = logging.getLogger(__name__)


def _set_trainer_checkpointing(args, value: bool) -> None:
    # `gradient_checkpointing` is transformers 5's deprecated alias of `activation_checkpointing`; trl reads both.
    args.activation_checkpointing = value
    if hasattr(args, "gradient_checkpointing"):
        args.gradient_checkpointing = value


def _trainer_checkpointing(args) -> bool:
    # transformers 5.17 (our floor) has only `gradient_checkpointing`; later 5.x add `activation_checkpointing`.
    value = getattr(args, "activation_checkpointing", None)
    return bool(getattr(args, "gradient_checkpointing", False) if value is None else value)


@contextlib.contextmanager
def set_aside_refused_settings(args):
    """Turn off, while transformers creates the accelerator, what it refuses under FSDP but we handle; restore both.

    transformers refuses save_only_model with SHARDED_STATE_DICT because its FSDP model save needs the sharded
    format; ours writes the gathered adapter, so the combination is fine and is how a user turns optimizer state off
    in checkpoints. It also refuses FSDP's activation checkpointing together with the Trainer's, which trl's configs
    turn on by default: the choice is made after the plugin exists (:func:`resolve_activation_checkpointing`).
    """
    save_only_model = args.save_only_model
    if save_only_model and args.load_best_model_at_end:
        raise ValueError("save_only_model=True cannot be combined with load_best_model_at_end=True under FSDP.")
    wants_checkpointing = _trainer_checkpointing(args)
    args.save_only_model = False
    _set_trainer_checkpointing(args, False)
    try:
        yield
    finally:
        args.save_only_model = save_only_model
        _set_trainer_checkpointing(args, wants_checkpointing)


def _stop_forcing_input_grads(model) -> bool:
    """Remove the hook that makes the input embeddings' output require grad (``enable_input_require_grads``: set by
    ``load_qlora_model`` and trl's SFTTrainer with gradient checkpointing). Only reentrant checkpointing needs it;
    FSDP's own is non-reentrant (accelerate's ``checkpoint_wrapper``). Left on, every step back-propagates into the
    frozen embedding through the first layer: its input gradient, and under bitsandbytes three more 4-bit matmuls
    forward and backward (the first layer's q/k/v take the autograd path): 6 of ~56 per step measured on a 4-layer
    Llama, where the stock Trainer under FSDP2 runs none. Returns True when a hook was removed."""
    hooked = any(
        getattr(m, "_require_grads_hooks", None) or getattr(m, "_require_grads_hook", None) for m in model.modules()
    )
    disable = getattr(model, "disable_input_require_grads", None)
    if not hooked or disable is None:
        return False
    disable()
    return True


def _model_checkpointing(model) -> bool:
    # transformers 5 names it is_activation_checkpointing; reading the old alias there warns (FutureWarning)
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def resolve_activation_checkpointing(trainer) -> str:
    """Apply activation checkpointing exactly once, and say which in one line. Returns "fsdp", "trainer",
    "model" or "none".

    Three switches can each turn it on: FSDP's own (``fsdp_activation_checkpointing``, which wraps every
    transformer layer), the Trainer's ``activation_checkpointing``/``gradient_checkpointing`` (trl's configs
    default to True) and the model's own (``load_qlora_model`` and ``prepare_model_for_kbit_training`` enable it).
    With two on, transformers raises, or each layer's forward runs three times per step. FSDP's own is kept when
    the accelerate config asks for it (transformers' advice under FSDP: the Trainer's adds a redundant all-gather
    in backward); the others are turned off.
    """
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    model = trainer.model
    model_on = _model_checkpointing(model)
    trainer_on = _trainer_checkpointing(trainer.args)
    if plugin is not None and plugin.activation_checkpointing:
        off = []
        if trainer_on:
            _set_trainer_checkpointing(trainer.args, False)
            off.append("TrainingArguments.gradient_checkpointing=True")
        if model_on:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()
            off.append("the model's gradient checkpointing")
        if _stop_forcing_input_grads(model):
            off.append("the input embeddings' requires_grad hook")
        logger.info(
            "hf_fsdp_qlora: activation checkpointing: FSDP's own (fsdp_activation_checkpointing: true), once per "
            "layer%s",
            f"; turned off {' and '.join(off)} so it is not applied twice" if off else "",
        )
        return "fsdp"
    if trainer_on or model_on:
        logger.info(
            "hf_fsdp_qlora: activation checkpointing: %s",
            "TrainingArguments.gradient_checkpointing=True" if trainer_on else "the model's gradient checkpointing",
        )
        return "trainer" if trainer_on else "model"
    logger.info("hf_fsdp_qlora: activation checkpointing: off")
    return "none"


def preserve_checkpoint_rng_state(model) -> int:
    """Make every torch ``CheckpointWrapper`` in `model` recompute its forward with the forward's random state.

    accelerate 1.15's FSDP2 activation checkpointing (``fsdp_activation_checkpointing: true``) wraps each layer with
    ``checkpoint_wrapper(layer, preserve_rng_state=False)``: the recomputation in backward then draws new dropout
    masks (LoRA's ``lora_dropout``, attention dropout), and the gradient is not the gradient of the loss the forward
    computed. Measured on the tiny Llama (2 ranks, float32, ``lora_dropout=0.1``): the first step's LoRA gradients
    differed from the same run without checkpointing by up to 2.65x their norm. torch's default (which transformers'
    gradient checkpointing and accelerate's FSDP1 wrappers keep) stashes the RNG state with the forward and restores
    it for the recomputation: each wrapper's ``checkpoint_fn`` (a partial of torch's ``checkpoint``) is rebuilt with
    the same keywords and ``preserve_rng_state=True``. Call after wrapping, before the first training forward. The
    sequence-parallel ranks' own random streams (``train/sp_random.py``) are stashed and restored the same way.

    Returns:
        How many wrappers were changed.
    """
    import torch.utils.checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    changed = 0
    for module in model.modules():
        fn = getattr(module, "checkpoint_fn", None) if isinstance(module, CheckpointWrapper) else None
        if not isinstance(fn, functools.partial) or fn.func is not torch.utils.checkpoint.checkpoint:
            continue  # a custom checkpoint function: the user's choice
        if fn.keywords.get("preserve_rng_state", True):
            continue
        module.checkpoint_fn = functools.partial(fn.func, *fn.args, **{**fn.keywords, "preserve_rng_state": True})
        changed += 1
    if changed:
        logger.info(
            "hf_fsdp_qlora: activation checkpointing: %d checkpoint wrappers recompute with the forward's random "
            "state (dropout masks), as torch's default does; accelerate's FSDP2 wrappers turn it off",
            changed,
        )
    return changed
