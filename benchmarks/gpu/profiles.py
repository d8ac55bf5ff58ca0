"""The two sizes the GPU check runs at: ``gpu`` (Llama 3.1 8B shape on one H100) and ``dry`` (tiny, on CPU).

Every number a stage uses comes from here, so the dry run exercises exactly the code the GPU run does.
"""

from __future__ import annotations

GIB = 2**30
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
# Larger shapes for the capacity stage, built quantized in memory (their bf16 checkpoints exceed the disk).
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
LLAMA_34B = {"hidden_size": 8192, "intermediate_size": 22016, "num_hidden_layers": 48, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 32000}  # fmt: skip
LLAMA_13B = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
             "num_key_value_heads": 40, "vocab_size": 32000}  # fmt: skip
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
TINY_WIDE = {**TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
# One MoE layer's experts (benchmarks/moe_layer.py): Qwen3-30B-A3B's, and a tiny one for the dry run.
QWEN3_30B_A3B_LAYER = {"hidden_size": 2048, "num_experts": 128, "moe_intermediate_size": 768, "num_experts_per_tok": 8}
TINY_MOE_LAYER = {"hidden_size": 64, "num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2}

# bf16 tolerance for a loss against the no-FSDP run's loss at the same step: FSDP's mixed precision casts and
# reduces in a different order (FSDP1 also casts buffers), which moves a bf16 loss by ~1e-3 relative per step.
LOSS_RTOL = 0.02
MEMORY_GOAL = 0.10  # the doctor's plan within 10% of the measured peak
H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM, for MFU

PROFILES = {
    "gpu": {
        "shape": LLAMA_8B, "shape_name": "llama3.1-8b", "lora_r": 16, "lr": 1e-3,
        "correctness": {"seq": 1024, "batch": 1, "steps": 4},
        "memory": {"seqs": (2048, 8192), "steps": 2},
        # 8 steps, 2 of warm-up: a launch is ~50 s (start, 8B load, steps), so the first run's share holds one
        # round of the stock recipe and ours; the second round (order rotated) comes with --resume-from.
        "speed": {"seq": 2048, "batch": 1, "steps": 8, "warmup": 2, "rounds": 2},
        "capacity_shapes": [("llama3.1-70b", LLAMA_70B), ("codellama-34b", LLAMA_34B), ("llama2-13b", LLAMA_13B)],
        "capacity_seq": {"caps": {"24GB": 24 * 10**9, "80GB": 80 * 10**9}, "low": 2048, "high": 131072,
                         "step": 1024, "seconds": 100},
        # fp32 against bf16 adapter master weights: both in one launch (the 8B load twice, a few steps each).
        "adapter_dtype": {"seq": 2048, "batch": 1, "steps": 6, "warmup": 2},
        "moe": {"shape": QWEN3_30B_A3B_LAYER, "tokens": 2048, "repeats": 5, "lora_r": 16},
        # Bisection around the doctor's answer (around: its fractions), the 24 GB cap first, then the whole GPU
        # (None); a probe near the whole H100's answer is minutes (attention grows with the square of the tokens).
        "longest": {"caps": {"24GB": 24 * 10**9, "gpu": None}, "around": (0.8, 1.1), "step": 1024, "seconds": 60,
                    "tile": 1024},
        "threads": 8,  # each stage's seconds: budget.PLAN
    },
    "dry": {
        "shape": TINY, "shape_name": "tiny", "lora_r": 4, "lr": 1e-2,
        "correctness": {"seq": 32, "batch": 2, "steps": 3},
        "memory": {"seqs": (32, 64), "steps": 2},
        "speed": {"seq": 32, "batch": 2, "steps": 3, "warmup": 1, "rounds": 1},
        "capacity_shapes": [("tiny-wide", TINY_WIDE), ("tiny", TINY)],
        "capacity_seq": {"caps": {"small": 300_000, "large": 600_000}, "low": 32, "high": 256, "step": 32,
                         "seconds": 60},
        "adapter_dtype": {"seq": 32, "batch": 2, "steps": 3, "warmup": 1},
        "moe": {"shape": TINY_MOE_LAYER, "tokens": 64, "repeats": 1, "lora_r": 4},
        "longest": {"caps": {"small": 120_000}, "low": 32, "high": 256, "step": 32, "seconds": 30, "tile": 16},
        "threads": 1,
    },
}  # fmt: skip
