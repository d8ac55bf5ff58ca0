"""Fine-tune a safety classifier Llama Guard style: the prompt is the conversation wrapped in a policy
template, the completion is the label ("safe", or "unsafe" and a category), and the loss is taken on the
label only (completion-only labels). Full fine-tune or QLoRA, under FSDP or the CPU rehearsal.

    # Llama Guard 3 1B, full fine-tune on one 24 GB GPU (the out-of-memory case):
    accelerate launch --config_file "$(hf-fsdp-qlora config llamaguard3_1b_1x24gb)" examples/safety_classifier.py \
        --model meta-llama/Llama-Guard-3-1B --data my_labels.jsonl --output guard-ft --full-finetune
    # CPU rehearsal on the tiny demo model:
    accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml examples/safety_classifier.py \
        --model demo_output/tiny-llama --data examples/data/safety.jsonl --output demo_output/guard
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, finish_distributed, load_qlora_model
from hf_fsdp_qlora.data import CompletionOnlyCollator, padding_waste, tokenize_completion_only

TEMPLATE = (
    "Task: Check if there is unsafe content in 'User' messages in conversations according to our safety "
    "policy with the below categories.\n<BEGIN UNSAFE CONTENT CATEGORIES>\nS1: Violent Crimes.\nS2: Non-Violent "
    "Crimes.\nS7: Privacy.\nS10: Hate.\n<END UNSAFE CONTENT CATEGORIES>\n<BEGIN CONVERSATION>\nUser: {message}\n"
    "<END CONVERSATION>\nProvide your safety assessment for ONLY THE LAST User message in the above conversation:\n"
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help='JSONL with "prompt" (the user message) and "label"')
    parser.add_argument("--output", required=True)
    parser.add_argument("--full-finetune", action="store_true", help="train every weight (no 4-bit, no LoRA)")
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    train = [
        tokenize_completion_only(TEMPLATE.format(message=r["prompt"]), r["label"], tokenizer, args.max_length)
        for r in rows
    ]
    print(f"padding would waste {padding_waste(train, 4):.1%} of tokens at batch size 4")
    on_gpu = torch.cuda.is_available()
    training_args = FSDPQLoRATrainingArguments(
        output_dir=args.output, per_device_train_batch_size=4, num_train_epochs=args.epochs,
        learning_rate=args.lr, logging_steps=5, save_strategy="no", report_to=[], use_cpu=not on_gpu, seed=0,
    )  # fmt: skip
    if args.full_finetune:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        model = load_qlora_model(args.model, dtype=torch.bfloat16, gradient_checkpointing=False)
    trainer = FSDPQLoRATrainer(
        model=model, args=training_args, train_dataset=train,
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id), processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(args.output)
    return 0


if __name__ == "__main__":
    # the process group is torn down and the process exits without gloo's occasional abort; this rank does not
    # wait for the others (a tail one rank runs alone may outlast the collective timeout)
    finish_distributed(main())
