"""Write tests/data/plan_golden.json: the doctor's memory plan of every documented setup and of variants that take
each branch of the plan, as the code computes it now (tests/test_plan_golden.py checks the plan still equals it).

Run from the repository root when a figure is meant to change, and say why in the commit:

    PYTHONPATH=$PWD python tests/make_plan_golden.py

Each case records the resolved RunSetup (so the test rebuilds it without reading the accelerate config again), the
model's config.json and LoRA targets (the shape), the plan's JSON (``MemoryPlan.to_dict``, less keys added later)
and the findings computed from it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = Path("tests/data")
GOLDEN = REPO / DATA / "plan_golden.json"
GB = 2**30

L70, L31, L2 = DATA / "llama3_70b_config.json", DATA / "llama3_1_70b_config.json", DATA / "llama2_70b_config.json"
GUARD, Q30, Q235 = (
    DATA / "llamaguard3_1b_config.json",
    DATA / "qwen3_30b_a3b_config.json",
    DATA / "qwen3_235b_a22b_config.json",
)
MIX, QWEN2, GEMMA2 = DATA / "mixtral_8x7b_config.json", DATA / "qwen2_7b_config.json", DATA / "gemma2_9b_config.json"
OSS, QMOE, DSV3 = (DATA / f"small_{a}_config.json" for a in ("gpt_oss", "qwen2_moe", "deepseek_v3"))
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def cfg(name: str, **changes) -> dict:
    """A shipped accelerate config with top-level and fsdp_config (``fsdp_*``) keys changed."""
    config = copy.deepcopy(yaml.safe_load((REPO / "accelerate_configs" / f"{name}.yaml").read_text()))
    for key, value in changes.items():
        (config["fsdp_config"] if key.startswith("fsdp_") else config)[key] = value
    return config


Q4 = {"quantization": "4bit"}
NOT_FSDP = {"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1, "mixed_precision": "bf16"}
SINGLE = {"distributed_type": "NO", "num_processes": 1, "num_machines": 1, "mixed_precision": "bf16"}
# name: (model config, accelerate config, settings)
DOCUMENTED = {
    "readme_70b_2xa100_4096": (L31, "llama3_70b_2xa100_80gb", dict(Q4, seq_len=4096, gpu_memory=80 * GB)),
    "llama3_70b_2xa100_2048": (L70, "llama3_70b_2xa100_80gb", dict(Q4, seq_len=2048, gpu_memory=80 * GB)),
    "llama3_70b_2xa100_4096": (L70, "llama3_70b_2xa100_80gb", dict(Q4, seq_len=4096, gpu_memory=80 * GB)),
    "llama3_70b_no_ac": (L70, cfg("llama3_70b_2xa100_80gb", fsdp_activation_checkpointing=False),
                         dict(Q4, seq_len=4096, gpu_memory=80 * GB)),
    "llama3_70b_model_ckpt": (L70, cfg("llama3_70b_2xa100_80gb", fsdp_activation_checkpointing=False),
                              dict(Q4, seq_len=4096, gpu_memory=80 * GB, model_checkpointing=True)),
    "doc_fsdp1_uint8_stock": (L31, "fsdp1_qlora", dict(Q4, quant_storage="uint8", trainer="transformers")),
    "guard_full_offload_2048": (GUARD, "llamaguard3_1b_1x24gb", dict(full_finetune=True, gpu_memory=24 * GB,
                                                                      save_steps=200, save_only_model=True)),
    "guard_full_offload_4096": (GUARD, "llamaguard3_1b_1x24gb", dict(full_finetune=True, seq_len=4096,
                                                                      gpu_memory=24 * GB)),
    "guard_full_no_offload": (GUARD, cfg("llamaguard3_1b_1x24gb", fsdp_offload_params=False),
                              dict(full_finetune=True, seq_len=4096, gpu_memory=24 * GB)),
    "guard_full_stock_loss": (GUARD, "llamaguard3_1b_1x24gb", dict(full_finetune=True, seq_len=4096,
                                                                    gpu_memory=24 * GB, loss_path="stock")),
    "llama2_70b_24gb": (L2, "fsdp2_qlora", dict(Q4, gpu_memory=24 * GB)),
    "llama3_70b_full_16gpu": (L70, "fsdp1_qlora", dict(full_finetune=True, save_steps=100, gpu_memory=80 * GB,
                                                        num_gpus=16)),
    "llama3_70b_eval_batch": (L70, "llama3_70b_2xa100_80gb", dict(Q4, seq_len=4096, gpu_memory=80 * GB,
                                                                   eval_batch_size=16)),
    "q30_2x24": (Q30, "fsdp2_qlora", dict(Q4, num_gpus=2, gpu_memory=24 * GB)),
    "q30_1x80": (Q30, "fsdp2_qlora", dict(Q4, num_gpus=1, gpu_memory=80 * GB)),
    "q30_2x24_16bit_experts": (Q30, "fsdp2_qlora", dict(Q4, num_gpus=2, gpu_memory=24 * GB, quantize_experts=False)),
    "q30_2x24_stock": (Q30, "fsdp2_qlora", dict(Q4, num_gpus=2, gpu_memory=24 * GB, trainer="transformers")),
    "q30_2x24_expert_lora": (Q30, "fsdp2_qlora", dict(Q4, num_gpus=2, gpu_memory=24 * GB, lora_dropout=0.0,
                                                      lora_target_parameters=EXPERT_TARGETS)),
    "mixtral_2x24": (MIX, "fsdp2_qlora", dict(Q4, num_gpus=2, gpu_memory=24 * GB)),
    "mixtral_2x24_16bit_experts": (MIX, "fsdp2_qlora", dict(Q4, num_gpus=2, gpu_memory=24 * GB,
                                                            quantize_experts=False)),
    "q235_8x80": (Q235, "fsdp2_qlora", dict(Q4, num_gpus=8, gpu_memory=80 * GB)),
    "q235_8x80_16bit_experts": (Q235, "fsdp2_qlora", dict(Q4, num_gpus=8, gpu_memory=80 * GB,
                                                          quantize_experts=False)),
    "int8_l31_2x80": (L31, "llama3_70b_2xa100_80gb", dict(quantization="8bit", seq_len=4096, gpu_memory=80 * GB)),
    "int8_l31_2x80_stock": (L31, "llama3_70b_2xa100_80gb", dict(quantization="8bit", seq_len=4096,
                                                                 gpu_memory=80 * GB, trainer="transformers")),
    "qwen2_7b_8192_ours": (QWEN2, "fsdp2_qlora", dict(Q4, seq_len=8192, gpu_memory=24 * GB)),
    "qwen2_7b_8192_stock": (QWEN2, "fsdp2_qlora", dict(Q4, seq_len=8192, gpu_memory=24 * GB, loss_path="stock")),
    "gemma2_9b_8192_default": (GEMMA2, "fsdp2_qlora", dict(Q4, seq_len=8192, gpu_memory=24 * GB)),
    "gemma2_9b_8192_ours": (GEMMA2, "fsdp2_qlora", dict(Q4, seq_len=8192, gpu_memory=24 * GB, loss_path="ours")),
}  # fmt: skip

L8 = dict(Q4, seq_len=1024, gpu_memory=24 * GB)  # a 70B shape at short sequences: every part is large enough to see
# Each variant takes a branch of the plan (named in its key).
VARIANTS = {
    "fsdp1_ours_4bit": (L70, "fsdp1_qlora", L8),
    "fsdp1_stock_4bit": (L70, "fsdp1_qlora", dict(L8, trainer="transformers", adapter_dtype="bfloat16")),
    "fsdp1_stock_fp32_adapters": (L70, "fsdp1_qlora", dict(L8, trainer="transformers")),
    "fsdp1_accelerate_whole_units_mixed": (L70, "fsdp1_qlora", dict(L8, trainer="accelerate",
                                                                    adapter_dtype="bfloat16")),
    "fsdp1_accelerate_whole_units_no_mixed": (L70, cfg("fsdp1_qlora", mixed_precision="no"),
                                              dict(L8, trainer="accelerate", adapter_dtype="bfloat16")),
    "fsdp1_accelerate_16bit_lora": (L70, "fsdp1_qlora", dict(seq_len=1024, trainer="accelerate")),
    "fsdp1_no_mixed_ours": (L70, cfg("fsdp1_qlora", mixed_precision="no"), L8),
    "fsdp1_uint8_ours": (L70, "fsdp1_qlora", dict(L8, quant_storage="uint8")),
    "fsdp1_shard_grad_op": (L70, cfg("fsdp1_qlora", fsdp_sharding_strategy="SHARD_GRAD_OP"), L8),
    "fsdp1_no_shard": (L70, cfg("fsdp1_qlora", fsdp_sharding_strategy="NO_SHARD"), L8),
    "fsdp1_hybrid_2_machines": (L70, cfg("fsdp1_qlora", fsdp_sharding_strategy="HYBRID_SHARD", num_machines=2,
                                         num_processes=8), L8),
    "fsdp1_full_finetune": (GUARD, "fsdp1_qlora", dict(full_finetune=True, seq_len=1024)),
    "fsdp1_no_wrap_stock": (L70, cfg("fsdp1_qlora", fsdp_auto_wrap_policy="NO_WRAP"),
                            dict(L8, trainer="transformers", adapter_dtype="bfloat16")),
    "fsdp2_ours_4bit": (L70, "fsdp2_qlora", L8),
    "fsdp2_ours_bf16_storage_fp32_compute": (L70, "fsdp2_qlora", dict(L8, compute_dtype="float32")),
    "fsdp2_ours_fp32_storage": (L70, "fsdp2_qlora", dict(L8, quant_storage="float32")),
    "fsdp2_ours_uint8": (L70, "fsdp2_qlora", dict(L8, quant_storage="uint8")),
    "fsdp2_stock_uint8_unsharded": (L70, "fsdp2_qlora", dict(L8, quant_storage="uint8", trainer="transformers")),
    "fsdp2_stock_fp32_adapters": (L70, "fsdp2_qlora", dict(L8, trainer="transformers")),
    "fsdp2_no_double_quant": (L70, "fsdp2_qlora", dict(L8, double_quant=False)),
    "fsdp2_16bit_lora_mixed": (L70, "fsdp2_qlora", dict(seq_len=1024, gpu_memory=80 * GB)),
    "fsdp2_16bit_lora_no_mixed": (L70, cfg("fsdp2_qlora", mixed_precision="no"), dict(seq_len=1024)),
    "fsdp2_full_finetune_mixed": (GUARD, "fsdp2_qlora", dict(full_finetune=True, seq_len=1024)),
    "fsdp2_full_finetune_fp16": (GUARD, cfg("fsdp2_qlora", mixed_precision="fp16"), dict(full_finetune=True)),
    "fsdp2_reshard_false": (L70, cfg("fsdp2_qlora", fsdp_reshard_after_forward=False), L8),
    "fsdp2_no_wrap": (L70, cfg("fsdp2_qlora", fsdp_auto_wrap_policy="NO_WRAP"), L8),
    "fsdp2_offload_4bit": (L70, "fsdp2_qlora_offload", L8),
    "fsdp2_multinode": (L70, "fsdp2_qlora_multinode", L8),
    "fsdp2_no_ac": (L70, cfg("fsdp2_qlora", fsdp_activation_checkpointing=False), L8),
    "fsdp2_trainer_ckpt": (L70, cfg("fsdp2_qlora", fsdp_activation_checkpointing=False),
                           dict(L8, gradient_checkpointing=True)),
    "fsdp2_act_offload_ckpt": (L70, "fsdp2_qlora", dict(L8, activation_offloading=True)),
    "fsdp2_act_offload_no_ckpt": (L70, cfg("fsdp2_qlora", fsdp_activation_checkpointing=False),
                                  dict(L8, activation_offloading=True)),
    "fsdp2_batch4_tight": (L70, "fsdp2_qlora", dict(Q4, seq_len=2048, batch_size=4, gpu_memory=40 * GB)),
    "fsdp2_batch2_does_not_fit": (L70, "fsdp2_qlora", dict(Q4, seq_len=8192, batch_size=2, gpu_memory=24 * GB)),
    "fsdp2_adamw_8bit": (L70, "fsdp2_qlora", dict(L8, optimizer="adamw_8bit")),
    "fsdp2_sgd": (L70, "fsdp2_qlora", dict(L8, optimizer="sgd")),
    "fsdp2_lora_r64_qv": (L70, "fsdp2_qlora", dict(L8, lora_r=64, lora_target_modules=["q_proj", "v_proj"])),
    "fsdp2_dora": (L70, "fsdp2_qlora", dict(L8, use_dora=True)),
    "fsdp2_dora_sgd": (L70, "fsdp2_qlora", dict(L8, use_dora=True, optimizer="sgd")),
    "fsdp2_8bit_ours": (L70, "fsdp2_qlora", dict(L8, quantization="8bit")),
    "fsdp2_8bit_stock": (L70, "fsdp2_qlora", dict(L8, quantization="8bit", trainer="transformers")),
    "fsdp1_8bit_ours": (L70, "fsdp1_qlora", dict(L8, quantization="8bit")),
    "loss_sft": (L70, "fsdp2_qlora", dict(L8, trainer_class="SFTTrainer")),
    "loss_dpo": (L70, "fsdp2_qlora", dict(L8, trainer_class="DPOTrainer")),
    "loss_stock_trainer": (L70, "fsdp2_qlora", dict(L8, trainer="transformers", adapter_dtype="bfloat16")),
    "loss_ours_chunk_2048": (L70, "fsdp2_qlora", dict(L8, loss_chunk_size=2048)),
    "loss_dpo_full_finetune": (GUARD, "fsdp2_qlora", dict(full_finetune=True, loss_path="dpo")),
    "ddp_4bit": (L70, NOT_FSDP, L8),
    "ddp_16bit_lora": (GUARD, NOT_FSDP, dict(seq_len=1024)),
    "single_gpu_4bit": (L70, SINGLE, dict(L8, model_checkpointing=True, gpu_memory=80 * GB)),
    "single_gpu_8bit": (L70, SINGLE, dict(L8, quantization="8bit", model_checkpointing=True)),
    "single_gpu_full_finetune": (GUARD, SINGLE, dict(full_finetune=True, gradient_checkpointing=True)),
    "single_gpu_dora_act_offload": (GUARD, SINGLE, dict(Q4, use_dora=True, model_checkpointing=True,
                                                        activation_offloading=True)),
    "moe_q30_fsdp1": (Q30, "fsdp1_qlora", dict(Q4, gpu_memory=24 * GB)),
    "moe_q30_fsdp1_accelerate": (Q30, "fsdp1_qlora", dict(Q4, trainer="accelerate", adapter_dtype="bfloat16")),
    "moe_q30_no_ac": (Q30, cfg("fsdp2_qlora", fsdp_activation_checkpointing=False), dict(Q4, gpu_memory=80 * GB)),
    "moe_q30_act_offload": (Q30, "fsdp2_qlora", dict(Q4, activation_offloading=True)),
    "moe_q30_offload_params": (Q30, "fsdp2_qlora_offload", Q4),
    "moe_q30_expert_lora_dora": (Q30, "fsdp2_qlora", dict(Q4, lora_dropout=0.0, use_dora=True,
                                                          lora_target_parameters=EXPERT_TARGETS)),
    "moe_q30_expert_lora_16bit_experts": (Q30, "fsdp2_qlora", dict(Q4, lora_dropout=0.0, quantize_experts=False,
                                                                   lora_target_parameters=EXPERT_TARGETS)),
    "moe_q30_16bit_lora": (Q30, "fsdp2_qlora", {}),
    "moe_q30_full_finetune": (Q30, "fsdp2_qlora", dict(full_finetune=True, num_gpus=8)),
    "moe_q30_no_double_quant": (Q30, "fsdp2_qlora", dict(Q4, double_quant=False)),
    "moe_q30_single_gpu": (Q30, SINGLE, dict(Q4, model_checkpointing=True)),
    "moe_q30_dpo": (Q30, "fsdp2_qlora", dict(Q4, trainer_class="DPOTrainer")),
    "moe_mixtral_stock_trainer": (MIX, "fsdp2_qlora", dict(Q4, trainer="transformers", adapter_dtype="bfloat16")),
    "moe_gpt_oss": (OSS, "fsdp2_qlora", Q4),
    "moe_gpt_oss_expert_lora": (OSS, "fsdp2_qlora", dict(Q4, lora_dropout=0.0, lora_target_parameters=EXPERT_TARGETS)),
    "moe_gpt_oss_stock": (OSS, "fsdp2_qlora", dict(Q4, trainer="transformers")),
    "moe_qwen2_moe_shared": (QMOE, "fsdp2_qlora", Q4),
    "moe_deepseek_v3_dense_first": (DSV3, "fsdp2_qlora", Q4),
    "moe_deepseek_v3_16bit_experts": (DSV3, "fsdp2_qlora", dict(Q4, quantize_experts=False)),
}  # fmt: skip
CASES = {**DOCUMENTED, **VARIANTS}


def record(name: str, model: Path, accelerate_config, settings: dict) -> dict:
    from hf_fsdp_qlora.doctor import diagnose

    d = diagnose(model, accelerate_config=accelerate_config, **settings)
    setup = d.setup.to_dict()
    return {
        "name": name,
        "model": str(model),
        "setup": setup,
        "memory": d.plan.to_dict(),
        "loss_path": d.plan.loss_path,
        "findings": [f.to_dict() for f in d.findings],
    }


def main() -> None:
    import os

    os.chdir(REPO)
    cases = [record(name, *case) for name, case in CASES.items()]
    GOLDEN.write_text(json.dumps({"cases": cases}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(cases)} plans to {GOLDEN.relative_to(REPO)}")


if __name__ == "__main__":
    main()
