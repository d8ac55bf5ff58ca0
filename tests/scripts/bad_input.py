"""Worker: a user script whose input is bad. Every rank must exit non-zero with our message, none hang."""

import sys

from transformers import TrainingArguments

import hf_fsdp_qlora  # noqa: F401
from hf_fsdp_qlora import FSDPQLoRATrainer, load_qlora_model


def main():
    case, path = sys.argv[1], sys.argv[2]
    args = TrainingArguments(output_dir="/tmp/unused", use_cpu=True, report_to=[], max_steps=1)
    if case == "8bit":
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        base = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                    dtype=torch.bfloat16)  # fmt: skip
        # DoRA on an 8-bit base: an 8-bit route we refuse (plain LoRA on it trains: tests/test_int8.py).
        model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    elif case == "targets":
        from peft import LoraConfig

        model = load_qlora_model(path, lora_config=LoraConfig(r=4, target_modules=["no_such_proj"]))
    else:
        model = load_qlora_model(path)
    FSDPQLoRATrainer(model=model, args=args, train_dataset=[]).train()


if __name__ == "__main__":
    main()
