"""Padding-free packing scenarios for train_scenarios.py (kinds ``pack_<route>_<attention>``), used by tests/test_packing.py.

Each scenario trains the same sequences of different lengths twice from the same adapters, with trl's collator
packing each micro-batch into one row (``padding_free=True``) and padding it (``padding_free=False``), and records
every micro-batch's loss on each rank: the two lists must agree. Routes: ``ours`` (FSDPQLoRATrainer and its chunked
loss, trl's collator passed as data_collator) and ``sft`` (FSDPQLoRASFTTrainer, trl's own loss, SFTConfig.padding_free).
A ``_cache`` suffix trains with ``TrainingArguments(use_cache=True)``. Attention ``custom``: sdpa registered under a new name without a mask function; training must refuse at start.
Float32 weights, so the comparison is not blurred by bf16 rounding of different matmul shapes.
"""

from __future__ import annotations

import torch
import train_scenarios as base

LENGTHS = (5, 12, 7, 16, 9, 3, 14, 6, 11, 8, 4, 13, 10, 15, 2, 9)  # 16 sequences: 2 steps of 2 ranks x 2 x 2 accum


def dataset(vocab=256):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(7)
    return Dataset.from_dict({"input_ids": [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]})


def register_custom_attention() -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("custom_sdpa", sdpa_attention_forward)  # no AttentionMaskInterface entry
    return "custom_sdpa"


def _train(path, out, version, arch, route, impl, packed, use_cache=False):
    from trl import SFTConfig
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.train.loss import trainer_loss_path

    torch.manual_seed(0)  # the same adapters for the packed and the padded run
    model = load_qlora_model(
        path, dtype=torch.float32, lora_config=base.lora_config(), gradient_checkpointing=False,
        attn_implementation=impl,
    )  # fmt: skip
    settings = {"steps": 2, "gradient_accumulation_steps": 2, "seed": 3}
    if version is None:  # single process, in the test's own process
        from transformers import TrainingArguments

        args = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=base.BATCH, max_steps=2, learning_rate=1e-2,
            gradient_accumulation_steps=2, seed=3, report_to=[], save_strategy="no", use_cpu=True,
            dataloader_drop_last=True, use_cache=use_cache,
        )  # fmt: skip
    else:
        args = base.training_args(out, version, arch, use_cache=use_cache, **settings)
    kwargs = {"model": model, "train_dataset": dataset()}
    if route == "sft":
        fields = {f for f, d in SFTConfig.__dataclass_fields__.items() if d.init}
        settings = {k: v for k, v in vars(args).items() if k in fields}
        kwargs["args"] = SFTConfig(**{**settings, "bf16": False, "padding_free": packed, "max_length": None})
        trainer = base.LossRecorderSFT(**kwargs)
    else:
        kwargs["args"] = args
        kwargs["data_collator"] = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=packed)
        trainer = base.LossRecorder(**kwargs)
    trainer.train()
    cb = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "FSDPQLoRACallback")
    found = {
        "losses": trainer.losses,
        "engagement": cb.engagement,
        "distributed_type": str(trainer.accelerator.state.distributed_type),
        "use_cache": trainer.accelerator.unwrap_model(trainer.model).config.use_cache,
        "loss_path": trainer_loss_path(trainer),
    }
    base.reset_accelerate()
    return found


def run(name, path, out, version, arch, kind):
    _, route, impl = kind.split("_", 2)
    use_cache = impl.endswith("_cache")  # TrainingArguments(use_cache=True): a KV cache in every training forward
    impl = impl.removesuffix("_cache")
    if impl == "custom":
        impl = register_custom_attention()
    result = {"scenario": name}
    for mode in ("packed", "padded"):
        # The reference (padded) runs without a cache: with one, FSDP's activation checkpointing recomputes each
        # layer into the same cache and the backward fails on mismatched sizes, packing or not.
        packed = mode == "packed"
        result[mode] = _train(path, out / name / mode, version, arch, route, impl, packed, use_cache and packed)
    return result
