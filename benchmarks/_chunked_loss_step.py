"""Worker of benchmarks/chunked_loss.py --step: two FSDP2 training steps of a tiny 4-bit Llama with a large vocabulary.

Each rank writes rank<N>.json: the logged losses, its peak RSS (ru_maxrss) and what FSDP engaged.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before the arguments build accelerate's state)
from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
from hf_fsdp_qlora.train.fsdp import fsdp_engagement


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab, seq, n=8):
        self.ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "labels": self.ids[i].clone(),
            "attention_mask": torch.ones_like(self.ids[i]),
        }


def main():
    from peft import LoraConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunked", type=int, required=True)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = load_qlora_model(args.model, lora_config=lora)
    training = FSDPQLoRATrainingArguments(
        output_dir=args.out, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, chunked_loss=bool(args.chunked),
        log_memory_throughput=False,
    )  # fmt: skip
    trainer = FSDPQLoRATrainer(model=model, args=training, train_dataset=Tokens(model.config.vocab_size, args.seq))
    trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    found = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "engaged": {k: v for k, v in fsdp_engagement(trainer.model_wrapped).items() if v},
    }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(found))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
