"""Tiny causal LMs built locally (no hub): random weights saved with save_pretrained, loaded back.

Three architectures, as the foundation tests require: Llama; Qwen2, whose attention projections
carry biases; and a Llama with tied input/output embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "llama_tied")
# Mixtures of experts with fused 3-D experts (tests/test_moe.py): 8 experts, 2 routed per token.
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
# Families whose experts layout transformers declares (tests/test_expert_layouts.py's FSDP2 scenarios), built by the
# family sweep's generic shrink (tests/family_build.py): Aria (transposed experts) and MiniMax-M2 (not Phi-MoE: its
# router samples in training, so no single-process run can reproduce a step-0 loss).
DECLARED_MOE_ARCHS = ("aria_text", "minimax_m2")
# DBRX: 2-D expert stacks the loader fuses into a declared class (hf_fsdp_qlora/experts/dbrx.py), 4 experts, top 1.
FUSED_MOE_ARCHS = ("dbrx",)

DECODER_LAYER = {
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "llama_tied": "LlamaDecoderLayer",
    "llama_nanbytes": "LlamaDecoderLayer",
    "qwen3_moe": "Qwen3MoeDecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "gpt_oss": "GptOssDecoderLayer",
}

# Pre-quantized 4-bit checkpoints (as the shared `*-bnb-4bit` repos are): the tiny Llama loaded in 4 bits with
# bitsandbytes' default uint8 storage and saved. arch name -> (quant type, double quant).
PREQUANTIZED = {
    "llama_bnb4_nf4_dq": ("nf4", True),
    "llama_bnb4_nf4_nodq": ("nf4", False),
    "llama_bnb4_fp4_dq": ("fp4", True),
    "llama_bnb4_fp4_nodq": ("fp4", False),
}
DECODER_LAYER.update(dict.fromkeys(PREQUANTIZED, "LlamaDecoderLayer"))

# NF4 code sequences whose packed bytes (two codes per byte, first code in the high nibble), read as
# little-endian bf16, are NaN (bytes 0x81 0xFF), +Inf (0x80 0x7F) and subnormal (0x01 0x00). Every
# pattern holds a code of magnitude 1.0 so the block's absmax fixes the codes exactly.
NF4_BYTE_PATTERNS = {"nan": [8, 1, 15, 15], "inf": [8, 0, 7, 15], "subnormal": [0, 1, 0, 0]}


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
    if arch in ("llama", "llama_tied", "llama_nanbytes"):
        from transformers import LlamaConfig

        return LlamaConfig(**common, tie_word_embeddings=(arch == "llama_tied"))
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=False)
    if arch in MOE_ARCHS:
        return _moe_config(arch, common)
    if arch in DECLARED_MOE_ARCHS + FUSED_MOE_ARCHS:
        from family_build import tiny_config as family_config

        return family_config(arch)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")


def _moe_config(arch, common):
    moe = {"num_experts_per_tok": 2, "tie_word_embeddings": False}
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, **moe, num_experts=8, moe_intermediate_size=64, head_dim=16)
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**common, **moe, num_local_experts=8)
    from transformers import GptOssConfig

    common = {**common, "intermediate_size": 64}
    return GptOssConfig(**common, **moe, num_local_experts=8, head_dim=16, sliding_window=32)


def build_tiny_model(path: str | Path, arch: str = "llama", dtype=torch.bfloat16, seed: int = 0) -> Path:
    """Write a tiny random causal LM of `arch` to `path` (safetensors) and return the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    if arch == "chatml":  # a tokenizer with ChatML's tokens and template (tests/recipe_fixtures.py)
        from recipe_fixtures import build_recipe_model

        return build_recipe_model(path, seed=seed)
    if arch in PREQUANTIZED:
        return build_prequantized(path, *PREQUANTIZED[arch], seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    # Biases default to zero; make them matter so a lost bias is visible in outputs.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    if arch == "llama_nanbytes":
        _plant_nf4_byte_patterns(model)
    model.to(dtype).save_pretrained(path)
    build_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(path)
    return path


def build_prequantized(path: str | Path, quant_type: str, double_quant: bool, seed: int = 0, source=None) -> Path:
    """`source` (default: the tiny Llama) loaded in 4 bits (uint8 storage, bitsandbytes' default) and saved with its
    tokenizer: a pre-quantized checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    path = Path(path)
    source = source or build_tiny_model(path.parent / f"{path.name}_16bit", "llama", seed=seed)
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(path)  # no forward ran: the packed bytes are bitsandbytes' own, not repacked for CPU
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def sgd_step(model, ids: torch.Tensor, lr: float = 0.5) -> None:
    """One plain SGD step of every parameter with a gradient, on the causal-LM loss of `ids` (a trained adapter that
    differs from its initialisation, for the reload and merge tests)."""
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param -= lr * param.grad


def build_tokenizer(vocab_size: int = 256):
    """A word-level tokenizer over tokens t3..t{vocab-1}, with <pad>=0, <eos>=1, <unk>=2 (trl needs one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@torch.no_grad()
def _plant_nf4_byte_patterns(model, scale: float = 0.05) -> None:
    """Overwrite blocks of every decoder Linear weight with values that NF4-quantize to NaN/Inf/subnormal bytes."""
    from bitsandbytes.functional import get_4bit_type

    table = get_4bit_type("nf4", device="cpu")
    patterns = list(NF4_BYTE_PATTERNS.values())
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            flat = module.weight.view(-1)
            for block in range(0, flat.numel() // 64, 2):  # every other 64-block keeps its random values
                codes = torch.tensor(patterns[(block // 2) % len(patterns)] * 16)
                flat[block * 64 : (block + 1) * 64] = table[codes] * scale
