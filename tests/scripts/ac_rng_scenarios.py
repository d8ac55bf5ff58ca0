"""FSDP's activation checkpointing and dropout, for train_scenarios.py (kinds ``acrng_on`` / ``acrng_off``), used by
tests/test_precision.py.

Each scenario runs one step of the tiny Llama (NF4, float32, LoRA r=4 on every linear with ``lora_dropout=0.1``, the
same adapters and batches, the Trainer's seed 0) with FSDP's own activation checkpointing on (``acrng_on``: the
rehearsal config's ``fsdp_activation_checkpointing: true``) or off (``acrng_off``), and saves the first step's LoRA
gradients gathered whole. The recomputation in backward must draw the forward's dropout masks: then both gradients
are equal; accelerate 1.15's FSDP2 wrappers (``preserve_rng_state=False``) drew new ones.
"""

from __future__ import annotations

import os

import precision_scenarios as precision
import torch
import train_scenarios as base
from dist_utils import whole_grads

DROPOUT = 0.1


def _first_grads(seen):
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

            wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
            seen["checkpointed"] = len(wrappers)
            seen["preserve_rng_state"] = sorted(
                {str(getattr(m.checkpoint_fn, "keywords", {}).get("preserve_rng_state", "default")) for m in wrappers}
            )

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if "grads" not in seen:
                seen["grads"] = whole_grads(model)

    return FirstGrads()


def run(name, path, out, version, arch, kind):
    from hf_fsdp_qlora import FSDPQLoRACallback, FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model

    checkpointing = kind == "acrng_on"
    saved = os.environ.get("FSDP_ACTIVATION_CHECKPOINTING")
    if base.LAUNCHED_BY_ACCELERATE:  # the rehearsal config turns it on; accelerate's plugin reads it when built
        os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = str(checkpointing).lower()
    try:
        with torch.random.fork_rng():  # the same adapters in both scenarios; the launch's RNG untouched
            torch.manual_seed(0)
            lora = base.lora_config(init_lora_weights=False, lora_dropout=DROPOUT)
            model = load_qlora_model(path, dtype=torch.float32, lora_config=lora, gradient_checkpointing=False)
        args = precision.training_args(
            FSDPQLoRATrainingArguments, out / name, version, arch, 1e-3, max_steps=1, bf16=False, seed=0
        )
        seen = {}
        trainer = FSDPQLoRATrainer(
            model=model, args=args, train_dataset=precision.OrderedTokens(), callbacks=[_first_grads(seen)]
        )
        trainer.train()
    finally:
        if saved is not None:
            os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = saved
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FSDPQLoRACallback))
    if base.rank() == 0:
        (out / name).mkdir(parents=True, exist_ok=True)
        torch.save(seen.get("grads", {}), out / name / "grads.pt")
    torch.distributed.barrier()
    result = {
        "scenario": name,
        "engagement": cb.engagement,
        "distributed_type": str(trainer.accelerator.state.distributed_type),
        "plugin_checkpointing": bool(trainer.accelerator.state.fsdp_plugin.activation_checkpointing),
        "checkpointed": seen.get("checkpointed"),
        "preserve_rng_state": seen.get("preserve_rng_state"),
        "dropout": [float(m.p) for n, m in trainer.model.named_modules() if n.endswith("lora_dropout.default")][:1],
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    base.reset_accelerate()
    return result
