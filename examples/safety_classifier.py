"""Fine-tune a safety classifier Llama Guard style: the prompt is the conversation wrapped in a policy
template, the completion is the label ("safe", or "unsafe" and a category), and the loss is taken on the
label only (completion-only labels). Full fine-tune or QLoRA, under FSDP or the CPU rehearsal.

    # Llama Guard 3 1B, full fine-tune on one 24 GB GPU (the out-of-memory case):
    accelerate launch --config_file "$(hf-fsdp-qlora config llamaguard3_1b_1x24gb)" examples/safety_classifier.py \
        --model meta-llama/Llama-Guard-3-1B --data my_labels.jsonl --output guard-ft --full-finetune
    # with the recipe's settings (sequence length, batch, learning rate and schedule, checkpoints, evaluation) from
    # the YAML file the doctor plans with (examples/recipes/; flags beside --config win):
    accelerate launch --config_file "$(hf-fsdp-qlora config llamaguard3_1b_1x24gb)" examples/safety_classifier.py \
        --config examples/recipes/llama-guard-full-finetune.yaml --model ./Llama-Guard-3-1B --data my_labels.jsonl \
        --output guard-ft
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
from hf_fsdp_qlora.training_config import held_out_rows, parse_with_config

TEMPLATE = (
    "Task: Check if there is unsafe content in 'User' messages in conversations according to our safety "
    "policy with the below categories.\n<BEGIN UNSAFE CONTENT CATEGORIES>\nS1: Violent Crimes.\nS2: Non-Violent "
    "Crimes.\nS7: Privacy.\nS10: Hate.\n<END UNSAFE CONTENT CATEGORIES>\n<BEGIN CONVERSATION>\nUser: {message}\n"
    "<END CONVERSATION>\nProvide your safety assessment for ONLY THE LAST User message in the above conversation:\n"
)


# YAML keys that are this script's own options (the rest go to FSDPQLoRATrainingArguments as they are).
CONFIG_OPTIONS = {
    "full_finetune": "full_finetune", "max_length": "max_length", "num_train_epochs": "epochs",
    "learning_rate": "lr", "per_device_train_batch_size": "batch_size", "max_steps": "max_steps",
    "eval_fraction": "eval_fraction",
}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="YAML", help="training settings file (examples/recipes/); flags win")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help='JSONL with "prompt" (the user message) and "label"')
    parser.add_argument("--output", required=True)
    parser.add_argument("--full-finetune", action="store_true", help="train every weight (no 4-bit, no LoRA)")
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: --epochs)")
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--eval-fraction", type=float, default=0.0, help="rows of --data held out for evaluation")
    return parse_with_config(parser, argv, CONFIG_OPTIONS, fixed={})


def main(argv=None):
    args = parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows, held_out = held_out_rows(rows, args.eval_fraction, args.training)
    train, evaluation = (
        [tokenize_completion_only(TEMPLATE.format(message=r["prompt"]), r["label"], tokenizer, args.max_length)
         for r in part]
        for part in (rows, held_out)
    )  # fmt: skip
    print(f"padding would waste {padding_waste(train, args.batch_size):.1%} of tokens at batch size {args.batch_size}")
    on_gpu = torch.cuda.is_available()
    settings = {
        "output_dir": args.output, "per_device_train_batch_size": args.batch_size, "num_train_epochs": args.epochs,
        "max_steps": args.max_steps, "learning_rate": args.lr, "logging_steps": 5, "save_strategy": "no",
        "report_to": [], "use_cpu": not on_gpu, "seed": 0,
    }  # fmt: skip
    training_args = FSDPQLoRATrainingArguments(**{**settings, **args.training})
    if args.full_finetune:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        model = load_qlora_model(args.model, dtype=torch.bfloat16, gradient_checkpointing=False)
    trainer = FSDPQLoRATrainer(
        model=model, args=training_args, train_dataset=train, eval_dataset=evaluation or None,
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id), processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(args.output)
    return 0


if __name__ == "__main__":
    # the process group is torn down and the process exits without gloo's occasional abort; this rank does not
    # wait for the others (a tail one rank runs alone may outlast the collective timeout)
    finish_distributed(main())
