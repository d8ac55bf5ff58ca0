"""Evaluation and generation on an FSDP-wrapped (sharded 4-bit) model, and sample generations during training.

* :func:`generate_under_fsdp` - greedy (or any) ``generate`` on an FSDP1 or FSDP2 wrapped model. Collective:
  every rank calls it, and every rank runs the same number of forward passes (``synced_gpus``), because each
  forward all-gathers the shards of every layer from all ranks.
* :func:`prepare_for_evaluation` - lets ``Trainer.evaluate()`` / ``predict()`` run on a trainer that has not
  trained yet under FSDP2 (upstream raises "When using FSDP2, a model and optimizer must be passed together
  to `Accelerator.prepare()`", huggingface/transformers#39961 and #48841).
* :class:`SampleGenerationsCallback` - every N steps, greedy generations of a few prompts, logged on the
  main process and into ``state.log_history``; training continues exactly as without it.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import TrainerCallback
from transformers.utils import logging

__all__ = ["SampleGenerationsCallback", "generate_under_fsdp", "prepare_for_evaluation"]

logger = logging.get_logger(__name__)


def _fsdp_root_kind(model) -> int | None:
    """1 for an FSDP1 root, 2 for an FSDP2 root module, None for a model FSDP does not manage."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return 1
    if isinstance(model, FSDPModule):
        return 2
    return None


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def _root_unsharded(model, kind):
    """Gather the parameters that belong to the root FSDP unit only (embeddings, final norm, LM head).

    ``generate`` calls the inner model's forward, not the wrapper's, so the root unit never gathers its own
    parameters: FSDP1 leaves them as empty views of the sharded flat parameter, FSDP2 as DTensor shards. The
    decoder layers are FSDP units themselves and gather (and free) their shards in their own forward, so only
    the root is gathered here: the memory cost is the root's parameters, not the whole model.
    """
    if kind == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            yield model.module
    elif kind == 2:
        model.unshard()
        try:
            yield model
        finally:
            model.reshard()
    else:
        yield model


def generate_under_fsdp(model, **kwargs):
    """``model.generate(**kwargs)`` on an FSDP1/FSDP2-wrapped model (or a plain one); returns the token ids.

    Collective under FSDP: call it on every rank. Prompts and ``max_new_tokens`` may differ between ranks:
    ``synced_gpus=True`` (the default here when several ranks share a sharded model) keeps a rank that has
    finished running forward passes until every rank has finished, as each forward needs every rank's shards.
    The model runs in eval mode under ``torch.no_grad()`` and is returned to the mode it was in.

    Args:
        model: the trainer's model (``trainer.model``, the FSDP-wrapped model after training started), a peft
            model, or any ``transformers`` model.
        **kwargs: passed to ``generate`` (``input_ids``, ``attention_mask``, ``max_new_tokens``, ...).
            Pass ``do_sample=False`` for greedy decoding that equals the unsharded model's.

    Returns:
        The tensor ``generate`` returns (prompt followed by the new tokens).
    """
    kind = _fsdp_root_kind(model)
    if kind is not None and _world_size() > 1:
        # transformers turns this on by itself only for its own FSDP2 (`_is_fsdp_managed_module`), not for a
        # model wrapped by accelerate: without it a rank that stops early leaves the others waiting forever.
        kwargs.setdefault("synced_gpus", True)
    _keep_4bit_layout(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _root_unsharded(model, kind) as inner:
            return inner.generate(**kwargs)
    finally:
        model.train(was_training)


def _keep_4bit_layout(model) -> None:
    """Stop bitsandbytes from repacking 4-bit weights in place at a no-grad forward on CPU.

    On CPUs with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad converts its weight, in place, to
    a CPU kernel layout (an instance flag set in ``__init__`` decides): afterwards the sharded bytes no longer
    match the other ranks' or the checkpoint's, gradients stop reaching the adapter and FSDP1 saves fail. The
    project fixes this globally elsewhere; evaluation and generation make sure of it themselves, as they are
    exactly the no-grad forwards that trigger it.
    """
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def prepare_for_evaluation(trainer) -> None:
    """Make ``evaluate()`` / ``predict()`` work under FSDP on a trainer that has not trained yet.

    Call it at the start of ``evaluation_loop`` (our trainers do). Collective under FSDP: every rank calls it.
    Upstream's ``evaluation_loop`` prepares the model alone on a fresh trainer: accelerate refuses that under
    FSDP2 ("a model and optimizer must be passed together", huggingface/transformers#39961, #48841), and under
    FSDP1 it wraps the model but leaves ``model_wrapped`` pointing at the unwrapped model, so a later ``train()``
    creates no optimizer (``'NoneType' object has no attribute 'param_groups'``).

    Here the model is sharded exactly as ``train()`` would shard it and both ``trainer.model`` and
    ``trainer.model_wrapped`` point at the wrapped model; a later ``train()`` finds it wrapped and builds its
    optimizer over the sharded parameters. FSDP2 needs an optimizer to prepare with: a placeholder, dropped
    afterwards. Activation checkpointing is applied here once; under FSDP2 the plugin then says it is done, as
    ``train()`` prepares the sharded model again and would look for the decoder layer class, which sharding
    renamed (FSDPLlamaDecoderLayer): "Could not find the transformer layer class ...".
    """
    _keep_4bit_layout(trainer.model)
    accelerator = getattr(trainer, "accelerator", None)
    if not getattr(trainer, "is_fsdp_enabled", False) or accelerator is None or accelerator._models:
        return
    if _fsdp_root_kind(trainer.model) is not None:
        return
    plugin = accelerator.state.fsdp_plugin
    if accelerator.is_fsdp2:
        params = [p for p in trainer.model.parameters() if p.requires_grad] or list(trainer.model.parameters())[:1]
        placeholder = torch.optim.SGD(params, lr=0.0)
        model, prepared = accelerator.prepare(trainer.model, placeholder)
        accelerator._optimizers = [opt for opt in accelerator._optimizers if opt is not prepared]
        plugin.activation_checkpointing = False
    else:
        from transformers.distributed.fsdp import update_fsdp_plugin_peft
        from transformers.trainer_utils import _is_peft_model

        if _is_peft_model(trainer.model):  # as train() does first: LoRA layers in their own units
            update_fsdp_plugin_peft(trainer.model, accelerator)
        model = accelerator.prepare(trainer.model)
    trainer.model = trainer.model_wrapped = model
    logger.info(
        "hf_fsdp_qlora: model wrapped with FSDP%d for evaluation before training", 2 if accelerator.is_fsdp2 else 1
    )


class SampleGenerationsCallback(TrainerCallback):
    """Every ``every_n_steps`` optimizer steps, greedy generations of a few prompts, logged on the main process.

    Runs under FSDP1, FSDP2 and without FSDP. Generation is collective under FSDP: every rank generates every
    prompt (one prompt at a time, so no padding), and only the main process logs. The texts (or token ids, without
    a tokenizer) go to the transformers log and into ``state.log_history`` as
    ``{"step": N, "sample_generations": [...]}``. The model returns to train mode and the RNG states are
    restored, so the run's losses equal those of a run without this callback.

    Args:
        prompts: strings (decoded with ``tokenizer``, or the trainer's ``processing_class``), or lists of token ids.
        every_n_steps: generate after every N-th optimizer step (and not at step 0).
        max_new_tokens: new tokens per prompt; every prompt gets exactly this many (no early stop at EOS), so
            runs are comparable from step to step.
        tokenizer: encodes string prompts and decodes the outputs; default: the trainer's ``processing_class``.

    Example::

        trainer = FSDPQLoRATrainer(..., callbacks=[SampleGenerationsCallback(["The capital of France is"],
                                                                             every_n_steps=50)])
    """

    def __init__(self, prompts, every_n_steps: int = 100, max_new_tokens: int = 32, tokenizer=None):
        if isinstance(prompts, (str, bytes)) or not prompts:
            raise ValueError(
                "SampleGenerationsCallback: prompts must be a non-empty list of strings or token-id lists"
            )
        if every_n_steps < 1 or max_new_tokens < 1:
            raise ValueError("SampleGenerationsCallback: every_n_steps and max_new_tokens must be at least 1")
        self.prompts = list(prompts)
        self.every_n_steps = every_n_steps
        self.max_new_tokens = max_new_tokens
        self.tokenizer = tokenizer
        self.history: list[dict] = []

    def _encode(self, prompt, tokenizer):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(
                    "SampleGenerationsCallback: string prompts need a tokenizer: pass tokenizer=... or give the "
                    "trainer a processing_class, or pass token-id lists"
                )
            return tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        return torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1)

    def generate(self, model, tokenizer=None) -> list:
        """Greedy generations of every prompt (collective under FSDP): texts with a tokenizer, else token ids."""
        tokenizer = tokenizer or self.tokenizer
        device = next(model.parameters()).device
        outputs = []
        for prompt in self.prompts:
            ids = self._encode(prompt, tokenizer).to(device)
            out = generate_under_fsdp(
                model,
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.max_new_tokens,
                pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            )
            new = out[0, ids.shape[1] :].tolist()
            outputs.append(tokenizer.decode(new, skip_special_tokens=False) if tokenizer is not None else new)
        return outputs

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if model is None or state.global_step % self.every_n_steps:
            return
        # Greedy decoding draws no random numbers, but restore the RNG states anyway: a run with this callback
        # must continue exactly as the same run without it (dropout masks, data order).
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            texts = self.generate(model, tokenizer=self.tokenizer or processing_class)
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        entry = {"step": state.global_step, "sample_generations": texts}
        self.history.append(entry)
        if state.is_world_process_zero:
            state.log_history.append(entry)
            lines = "\n".join(f"  [{i}] {self.prompts[i]!r} -> {text!r}" for i, text in enumerate(texts))
            logger.warning("hf_fsdp_qlora: sample generations at step %d:\n%s", state.global_step, lines)
