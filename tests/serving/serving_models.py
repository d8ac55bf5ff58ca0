"""Tiny models and adapters for the serving check (runs in the main venv; no vLLM here).

vLLM's CPU attention refuses the suite's tiny head size (16: "Unsupported CPU attention configuration"); these are
the suite's tiny Llama, Qwen3-MoE and Mixtral (tests/tiny_models.py) with two query heads of 32 and one KV head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import build_tokenizer, tiny_config

HEAD_DIM = 32  # the smallest head size vLLM's CPU attention serves
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft's target_parameters, vLLM's order


def serving_config(arch: str):
    config = tiny_config(arch)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, HEAD_DIM
    return config


def build_model(path: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random `arch` model with its tokenizer, saved in bf16 (as the suite's tiny models)."""
    from transformers import AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(serving_config(arch), dtype=torch.float32)
    assert model.config.head_dim == HEAD_DIM
    model.to(torch.bfloat16).save_pretrained(path)
    build_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(path)
    return path


def build_expert_adapter(base: Path, out: Path, seed: int = 1, scale: float = 0.5) -> Path:
    """A peft adapter with LoRA on the fused experts (target_parameters) and on q/v, its B matrices random so
    that it changes the greedy tokens (a freshly initialised adapter is the identity)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS
    )
    model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out)
    return out
