"""The other route to the adapter-only sync: a user's own script building trl's GRPOTrainer with our callback, one
process (no accelerate launch). Run by tests/serving/test_grpo_vllm.py with GRPO_PROBE_OUT set (the probe records).

    python grpo_callback_script.py MODEL_DIR DATA_DIR OUT_DIR STEPS
"""

from __future__ import annotations

import sys

import torch
from datasets import load_dataset
from grpo_vllm_probe import reward
from peft import LoraConfig
from transformers import BitsAndBytesConfig
from trl import GRPOConfig, GRPOTrainer

from hf_fsdp_qlora import FSDPQLoRACallback, finish_distributed

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(model_dir: str, data_dir: str, out: str, steps: int) -> None:
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    args = GRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        learning_rate=0.05, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=64, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=0,
        model_init_kwargs={"quantization_config": quant, "dtype": torch.float32},
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=load_dataset(data_dir)["train"],
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
        callbacks=[FSDPQLoRACallback()],
    )
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    finish_distributed(0)
