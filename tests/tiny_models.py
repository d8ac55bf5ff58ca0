"""Tiny causal LMs built locally (no hub): random weights saved with save_pretrained, loaded back.

Three architectures, as the foundation tests require: Llama; Qwen2, whose attention projections
carry biases; and a Llama with tied input/output embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "llama_tied")

DECODER_LAYER = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "llama_tied": "LlamaDecoderLayer"}


def tiny_config(arch: str = "llama", vocab_size: int = 256, num_layers: int = 2):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if arch in ("llama", "llama_tied"):
        from transformers import LlamaConfig

        return LlamaConfig(**common, tie_word_embeddings=(arch == "llama_tied"))
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")


def build_tiny_model(path: str | Path, arch: str = "llama", dtype=torch.bfloat16, seed: int = 0) -> Path:
    """Write a tiny random causal LM of `arch` to `path` (safetensors) and return the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    # Biases default to zero; make them matter so a lost bias is visible in outputs.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    build_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(path)
    return path


def build_tokenizer(vocab_size: int = 256):
    """A word-level tokenizer over tokens t3..t{vocab-1}, with <pad>=0, <eos>=1, <unk>=2 (trl needs one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
