"""QLoRA fine-tune under FSDP with hf_fsdp_qlora: the same script on GPUs and on a CPU rehearsal.

    # 2 GPUs:
    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" examples/train_qlora.py \
        --model meta-llama/Llama-3.1-8B --data my_data.jsonl --output llama-qlora
    # CPU rehearsal (2 processes, gloo):
    accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml examples/train_qlora.py \
        --model demo_output/tiny-llama --data examples/data/capitals.jsonl --output demo_output/adapter

    # A recipe's settings (sequence length, batch, learning rate and schedule, checkpoints, evaluation) from the
    # YAML file the doctor plans with (examples/recipes/; flags beside --config win):
    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" --num_processes 1 examples/train_qlora.py \
        --config examples/recipes/llama-8b-1x24gb.yaml --model ./Llama-3.1-8B --data my_data.jsonl --output out

Without --config the defaults are the CPU demo's (short samples, a high learning rate, no checkpoints).
The data is JSONL with "prompt" and "completion"; the loss is taken on completion tokens only. The main process
prints the loss curve and writes it as a PNG beside the adapter (OUTPUT/loss_curve.png, with matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Import before TrainingArguments: on a CPU-only machine this lets accelerate run real FSDP.
from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, finish_distributed, load_qlora_model
from hf_fsdp_qlora.data import CompletionOnlyCollator, tokenize_completion_only
from hf_fsdp_qlora.training_config import held_out_rows, parse_with_config


class LossCurve:
    """Collects the logged training loss so the main process can print the curve at the end."""

    def __init__(self):
        from transformers import TrainerCallback

        curve = self.points = []

        class _Callback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    curve.append((state.global_step, float(logs["loss"])))

        self.callback = _Callback()

    def save_png(self, path: Path, title: str) -> Path:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a training machine
        from matplotlib import pyplot as plt

        steps, losses = zip(*self.points)
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot(steps, losses, marker="o", markersize=3)
        ax.set(xlabel="step", ylabel="training loss", title=title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


# YAML keys that are this script's own options (the rest go to FSDPQLoRATrainingArguments as they are).
CONFIG_OPTIONS = {
    "max_length": "max_length", "per_device_train_batch_size": "batch_size", "num_train_epochs": "epochs",
    "learning_rate": "lr", "lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
    "logging_steps": "logging_steps", "seed": "seed", "max_steps": "max_steps", "dtype": "dtype",
    "eval_fraction": "eval_fraction",
}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="YAML", help="training settings file (examples/recipes/); flags win")
    parser.add_argument("--model", required=True, help="local directory or Hub id of a causal LM")
    parser.add_argument("--data", required=True, help="JSONL file with prompt/completion")
    parser.add_argument("--output", required=True, help="where the adapter is saved")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--epochs", type=float, default=8)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: --epochs)")
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, help="default: twice --lora-r")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval-fraction", type=float, default=0.0, help="rows of --data held out for evaluation")
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parse_with_config(parser, argv, CONFIG_OPTIONS, fixed={"load_in_4bit": True})


def main(argv=None):
    args = parse_args(argv)

    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, set_seed

    on_gpu = torch.cuda.is_available()
    settings = {
        "output_dir": args.output,
        "per_device_train_batch_size": args.batch_size,
        "num_train_epochs": args.epochs,
        "max_steps": args.max_steps,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "logging_steps": args.logging_steps,
        "save_strategy": "no",
        "report_to": [],
        "bf16": on_gpu and args.dtype == "bfloat16",
        "use_cpu": not on_gpu,
        "seed": args.seed,
    }
    training_args = FSDPQLoRATrainingArguments(**{**settings, **args.training})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows, held_out = held_out_rows(rows, args.eval_fraction, args.training)
    train, evaluation = (
        [tokenize_completion_only(r["prompt"], r["completion"], tokenizer, args.max_length) for r in part]
        for part in (rows, held_out)
    )

    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r, lora_dropout=args.lora_dropout,
                      target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    # One dtype drives storage, compute, adapters. Activation checkpointing comes from the accelerate
    # config (fsdp_activation_checkpointing), so the model's own is off.
    # Seed before the adapters are created: Trainer seeds only in its __init__, and rank 0's initial adapters
    # (broadcast to the other ranks) would differ from run to run.
    set_seed(args.seed)
    model = load_qlora_model(args.model, dtype=args.dtype, lora_config=lora, gradient_checkpointing=False)

    curve = LossCurve()
    trainer = FSDPQLoRATrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation or None,
        data_collator=CompletionOnlyCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[curve.callback],
    )
    trainer.train()
    trainer.save_model(args.output)
    if trainer.is_world_process_zero():
        engaged = trainer.fsdp_callback.engagement
        print(f"\nFSDP engaged: {engaged}")
        if not curve.points:  # fewer steps than --logging-steps: nothing was logged
            print(f"no loss logged (fewer steps than --logging-steps); adapter saved to {args.output}")
            return 0
        print("loss curve (step: loss):")
        for step, loss in curve.points:
            print(f"  {step:4d}: {loss:.4f}  " + "#" * int(loss * 8))
        first, last = curve.points[0][1], curve.points[-1][1]
        print(f"loss {first:.4f} -> {last:.4f}; adapter saved to {args.output}")
        png = curve.save_png(Path(args.output) / "loss_curve.png", f"QLoRA under FSDP on {Path(args.data).name}")
        print(f"loss curve plot: {png}")
    return 0


if __name__ == "__main__":
    # the process group is torn down and the process exits without gloo's occasional abort; this rank does not
    # wait for the others (rank 0's tail - printing, the plot - may outlast the collective timeout)
    finish_distributed(main())
