"""Worker for tests/test_error_index.py: two stock FSDP1 failures of the error index, reproduced, and our route.

Launched once with torchrun (2 CPU ranks, gloo), FSDP1 throughout:

* ``generate_stock`` - `model.generate` on an FSDP1-wrapped peft model ("'weight' must be 2-D");
  ``generate_ours`` - `generate_under_fsdp` on the same wrapped model, against the unwrapped model's greedy tokens.
* ``checkpoint_stock`` - a stock `Trainer` under accelerate's FSDP1 (the shipped cpu_fsdp1_rehearsal config),
  `bf16=True`, LoRA dropout and non-reentrant checkpointing ("CheckpointError: ... different metadata");
  ``checkpoint_ours`` - the same with `FSDPQLoRACallback`.

Each rank writes rank<N>.json: {scenario: {"ok", "error", ...}}.
"""

from __future__ import annotations

import argparse
import functools
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from dist_utils import CONFIGS, finish_worker
from doctor_scenarios import ConstantDataset, apply_accelerate_config, reset_accelerate

import hf_fsdp_qlora  # noqa: F401  (installs the CPU rehearsal hook, the only part of ours the stock runs use)


def _lora_model(path: str, quantized: bool, dropout: float):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": torch.bfloat16}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
        )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    for param in model.parameters():
        param.requires_grad_(False)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    # bf16 adapters beside the bf16 base: the dtype errors of the index stay out of these scenarios.
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def _error(err: BaseException) -> dict:
    return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def generate_scenarios(path: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from hf_fsdp_qlora import generate_under_fsdp

    model = _lora_model(path, quantized=False, dropout=0.0).eval()
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    greedy = {"max_new_tokens": 3, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **greedy)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    found = {}
    try:
        with torch.no_grad():
            wrapped.generate(input_ids=ids, **greedy)
        found["generate_stock"] = {"ok": True}
    except Exception as err:  # noqa: BLE001 - the error text is the finding
        found["generate_stock"] = _error(err)
    dist.barrier()
    try:
        with torch.no_grad():
            tokens = generate_under_fsdp(wrapped, input_ids=ids, **greedy)
        found["generate_ours"] = {"ok": True, "equal": torch.equal(tokens, expected), "tokens": tokens.tolist()}
    except Exception as err:  # noqa: BLE001 - the error text is the finding
        found["generate_ours"] = _error(err)
    return found


def checkpoint_scenario(path: str, out: Path, ours: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRACallback
    from hf_fsdp_qlora.train.fsdp import fsdp_engagement

    reset_accelerate()
    apply_accelerate_config(yaml.safe_load((CONFIGS / "cpu_fsdp1_rehearsal.yaml").read_text()))
    model = _lora_model(path, quantized=True, dropout=0.1)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-3, report_to=[],
        save_strategy="no", use_cpu=True, bf16=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, seed=0,
    )  # fmt: skip
    callbacks = [FSDPQLoRACallback()] if ours else []
    trainer = Trainer(model=model, args=args, train_dataset=ConstantDataset(vocab=200), callbacks=callbacks)
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - the error text is the finding
        return _error(err)
    engagement = fsdp_engagement(trainer.model_wrapped)
    return {"ok": True, "engagement": engagement, "distributed_type": str(trainer.accelerator.distributed_type)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    found = generate_scenarios(args.model)
    for name, ours in (("checkpoint_stock", False), ("checkpoint_ours", True)):
        found[name] = checkpoint_scenario(args.model, out / name, ours)
        dist.barrier()
    finish_worker(out, found)


if __name__ == "__main__":
    main()
