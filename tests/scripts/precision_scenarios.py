"""Float32 master weights scenarios for train_scenarios.py (kinds ``precision_<route>_<adapter dtype>_<lr>``, with
``_ga2`` for gradient accumulation 2 on each rank, then ``_bf16`` or ``_fp32`` for ``bf16=True`` / ``False``), used
by tests/test_precision.py.

Each scenario trains the tiny Llama (NF4, LoRA r=4 on q/v) for STEPS steps in bf16 (``bf16=True``) at a constant
learning rate, micro-batches of BATCH on each of 2 ranks taken in order, from adapters every rank gets by our
broadcast, and saves the adapters before and after (gathered independently of the package) for the pytest side,
which replays the same micro-batches in one process with stock peft (fp32 adapters) and compares the updates.
Routes: ``ours`` (FSDPQLoRATrainer) and ``callback`` (a stock Trainer with FSDPQLoRACallback).
"""

from __future__ import annotations

import torch
import train_scenarios as base

STEPS = 8
SEQ = 16
BATCH = 2  # per rank; the single-process oracle runs the same micro-batches with gradient accumulation 2
TARGETS = ["q_proj", "v_proj"]


class OrderedTokens(torch.utils.data.Dataset):
    """STEPS x 2 ranks x BATCH rows of random ids, all of length SEQ (the mean loss of each rank is the global one):
    STEPS micro-batches per rank, whatever the gradient accumulation."""

    def __init__(self, vocab=256):
        gen = torch.Generator().manual_seed(4321)
        self.ids = torch.randint(3, vocab, (STEPS * 2 * BATCH, SEQ), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def lora_config():
    return base.lora_config(target_modules=TARGETS)


def training_args(cls, out, version, arch, lr, **kw):
    """train_scenarios' arguments (FSDP from TrainingArguments under torchrun, else the accelerate config) as `cls`,
    in bf16, sequential sampling (rank r's micro-batch of step s is rows (2s + r) * BATCH ..), no warmup or decay."""
    settings = {}
    if not base.LAUNCHED_BY_ACCELERATE:  # torchrun: FSDP from TrainingArguments, as train_scenarios does
        from tiny_models import DECODER_LAYER

        wrap = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": [DECODER_LAYER[arch]]}
        config = {"version": version, **wrap, "state_dict_type": "FULL_STATE_DICT", "sync_module_states": False}
        settings = {"fsdp": True, "fsdp_config": config}
    settings.update(
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=lr, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, dataloader_drop_last=True, bf16=True,
        train_sampling_strategy="sequential", lr_scheduler_type="constant",
    )  # fmt: skip
    return cls(**{**settings, **kw})


def accumulation(options) -> dict:
    """The arguments of a kind's options (``ga2``, ``bf16`` / ``fp32``): gradient accumulation 2 takes STEPS / 2
    optimizer steps (the same micro-batches), ``fp32`` turns ``bf16`` off."""
    accumulation = 2 if "ga2" in options else 1
    return {
        "gradient_accumulation_steps": accumulation,
        "max_steps": STEPS // accumulation,
        "bf16": "fp32" not in options,
    }


def run(name, path, out, version, arch, kind):
    from transformers import Trainer, TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRACallback, FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model

    _, route, adapter_dtype, lr, *options = kind.split("_")
    kw = accumulation(options)
    with (
        torch.random.fork_rng()
    ):  # the same adapters in every scenario (one oracle per lr); the launch's RNG untouched
        torch.manual_seed(0)
        model = load_qlora_model(path, lora_config=lora_config(), gradient_checkpointing=False)
    if route == "ours":
        args = training_args(
            FSDPQLoRATrainingArguments, out / name, version, arch, float(lr), adapter_dtype=adapter_dtype, **kw
        )
        trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=OrderedTokens())
    else:
        assert adapter_dtype == "float32", "a stock Trainer's arguments have no adapter_dtype: the default applies"
        args = training_args(TrainingArguments, out / name, version, arch, float(lr), **kw)
        trainer = Trainer(model=model, args=args, train_dataset=OrderedTokens(), callbacks=[FSDPQLoRACallback()])
    init = base.trainable_snapshot(trainer.model)
    result = {"scenario": name, "init_checksum": base.checksum(init)}
    result["dtypes_before_wrap"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    result["trainable_dtypes_before_wrap"] = sorted(
        {str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}
    )
    trainer.train()
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FSDPQLoRACallback))
    result["engagement"] = cb.engagement
    result["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
    result["mp_param_dtype"] = str(policy.param_dtype)
    result["mp_reduce_dtype"] = str(policy.reduce_dtype)
    result["gradient_accumulation_steps"], result["bf16"] = trainer.args.gradient_accumulation_steps, trainer.args.bf16
    result["trainable_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad})
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    result["optimizer_state_dtypes"] = sorted(
        {str(v.dtype) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
    )
    packed = [p for n, p in trainer.model.named_parameters() if n.endswith("base_layer.weight")]
    result["packed_dtypes"] = sorted({str(p.dtype) for p in packed})
    trained = base.full_trainable(trainer.model, version)
    if base.rank() == 0:
        torch.save({"init": init, "trained": trained}, out / name / "weights.pt")
    torch.distributed.barrier()
    base.reset_accelerate()
    return result
