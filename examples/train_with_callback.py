"""A trainer you cannot swap: the stock QLoRA recipe and a plain `transformers.Trainer`, plus one callback.

    # 2 GPUs:
    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" examples/train_with_callback.py \
        --model meta-llama/Llama-3.1-8B --data my_data.jsonl --output llama-qlora-callback
    # CPU rehearsal (2 processes, gloo):
    accelerate launch --config_file "$(hf-fsdp-qlora config cpu_fsdp2_rehearsal)" examples/train_with_callback.py \
        --model demo_output/tiny-llama --data examples/data/capitals.jsonl --output demo_output/adapter-callback

The model is loaded the way the stock single-GPU recipe does (bitsandbytes' default uint8 4-bit storage, peft's
float32 adapters): `FSDPQLoRACallback` makes that train under FSDP1 and FSDP2, and `save_model` writes the adapter
gathered from every rank. The same line works for trl's trainers (`SFTTrainer`, `DPOTrainer`, ...) and your own
`Trainer` subclasses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Import before TrainingArguments: on a CPU-only machine this lets accelerate run real FSDP.
from hf_fsdp_qlora import FSDPQLoRACallback, finish_distributed
from hf_fsdp_qlora.data import CompletionOnlyCollator, tokenize_completion_only


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="local directory or Hub id of a causal LM")
    parser.add_argument("--data", required=True, help="JSONL file with prompt/completion")
    parser.add_argument("--output", required=True, help="where the adapter is saved")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=64)
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, Trainer, TrainingArguments

    on_gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    train = [tokenize_completion_only(r["prompt"], r["completion"], tokenizer, args.max_length) for r in rows]

    # The stock recipe, unchanged: default uint8 storage, fp32 adapters (peft's autocast_adapter_dtype=True).
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quantization, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))

    training_args = TrainingArguments(
        output_dir=args.output, per_device_train_batch_size=4, max_steps=args.max_steps, learning_rate=5e-3,
        logging_steps=1, save_strategy="no", report_to=[], bf16=on_gpu, use_cpu=not on_gpu, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id),
        callbacks=[FSDPQLoRACallback()],
    )
    trainer.train()
    trainer.save_model(args.output)  # the adapter, gathered from every rank
    if trainer.is_world_process_zero():
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; adapter saved to {args.output}")
    return 0


if __name__ == "__main__":
    # the process group is torn down and the process exits without gloo's occasional abort; this rank does not
    # wait for the others (a tail one rank runs alone may outlast the collective timeout)
    finish_distributed(main())
