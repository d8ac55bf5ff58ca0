"""The sweep's variants, each on the families it applies to (a representative few, to keep the sweep short):

- ``expert_lora``: an MoE family with LoRA on its fused experts too (peft ``target_parameters``), one training step;
- ``int8``: ``load_qlora_model(bits=8)`` and one training step;
- ``prequantized``: a 4-bit checkpoint written by ``save_pretrained`` after 4-bit loading, reloaded by
  ``load_qlora_model`` and trained one step.

Each step is recorded like the sweep's own (tests/family_sweep.py): ok, refused by name, or failed with the error.
"""

from __future__ import annotations

from pathlib import Path

import torch

EXPERT_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "granitemoe")
INT8_FAMILIES = ("llama", "qwen2", "gemma2", "phi3", "lfm2", "qwen3_moe")
PREQUANTIZED_FAMILIES = ("llama", "qwen3", "gemma", "mistral", "lfm2", "mixtral")


def expert_targets(model) -> list[str]:
    """peft `target_parameters` for every fused 3-D expert weight, as `<parent>.experts.<param>` suffixes."""
    targets = set()
    for name, param in model.named_parameters():
        parts = name.split(".")
        if param.dim() == 3 and len(parts) >= 3 and parts[-2] == "experts":
            targets.add(".".join(parts[-3:]))
    return sorted(targets)


def _lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", **kwargs)


def _expert_lora(path: Path, train_step) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fsdp_qlora.loading.qlora import load_qlora_model

    with torch.device("meta"):
        targets = expert_targets(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    if not targets:
        raise AssertionError("no fused 3-D expert weight")
    model = load_qlora_model(
        path, dtype=torch.bfloat16, lora_config=_lora(target_modules=["q_proj"], target_parameters=targets)
    )
    return f"{targets}: " + train_step(model)


def _int8(path: Path, train_step) -> str:
    from hf_fsdp_qlora.loading.qlora import load_qlora_model

    model = load_qlora_model(path, dtype=torch.bfloat16, bits=8, lora_config=_lora(target_modules="all-linear"))
    return train_step(model)


def _prequantized(path: Path, train_step) -> str:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp_qlora.loading.qlora import load_qlora_model

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )  # fmt: skip
    saved = path.parent / "prequantized"
    AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16).save_pretrained(saved)
    model = load_qlora_model(saved, dtype=torch.bfloat16, lora_config=_lora(target_modules="all-linear"))
    return train_step(model)


VARIANTS = {
    "expert_lora": (EXPERT_FAMILIES, _expert_lora),
    "int8": (INT8_FAMILIES, _int8),
    "prequantized": (PREQUANTIZED_FAMILIES, _prequantized),
}


def run_variants(family: str, path: Path, record: dict, run, train_step) -> None:
    """Each variant that applies to `family`, recorded under its name by the sweep's `run`."""
    for name, (applies, variant) in VARIANTS.items():
        if family in applies:
            run(record, name, lambda v=variant: v(path, train_step))
