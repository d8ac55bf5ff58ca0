"""Worker for tests/test_semantics_pref.py: step-1 losses and margins of trl's DPO, ORPO and CPO trainers.

Each stock trl trainer gets FSDPQLoRACallback and trl's own defaults (bf16=True) except
gradient_checkpointing=False, on a tiny preference set built here. Launched three ways - torchrun without
FSDP (DDP), and accelerate launch with the CPU FSDP1 / FSDP2 rehearsal configs - each rank writes
rank<N>.json with the first logged metrics of every trainer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import train_scenarios as ts
from dist_utils import finish_worker

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before the configs build accelerate's state)
from hf_fsdp_qlora import FSDPQLoRACallback, load_qlora_model

KEYS = ("loss", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "nll_loss",
        "log_odds_ratio")  # fmt: skip


def preference_data():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(5)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(3, 256, (n,), generator=gen))

    rows = [{"prompt": words(6), "chosen": words(5), "rejected": words(5)} for _ in range(8)]
    return Dataset.from_list(rows)


def trainer_for(kind, path, out, version):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if kind == "dpo":
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer
    elif kind == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    if not ts.LAUNCHED_BY_ACCELERATE and version:
        raise SystemExit("FSDP runs are launched with accelerate's rehearsal configs")
    args = Config(
        output_dir=str(out / kind), per_device_train_batch_size=2, max_steps=1, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, gradient_checkpointing=False, seed=7, learning_rate=1e-3,
        max_length=32, dataloader_drop_last=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = load_qlora_model(path, lora_config=ts.lora_config(), gradient_checkpointing=False)
    return Trainer(model=model, args=args, train_dataset=preference_data(), processing_class=tokenizer,
                   callbacks=[FSDPQLoRACallback()])  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp-version", type=int, default=0, help="0: DDP (torchrun)")
    parser.add_argument("--trainers", default="dpo,orpo,cpo")
    args = parser.parse_args()
    out, path = Path(args.out), str(Path(args.models) / "llama")
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    found = {}
    for kind in args.trainers.split(","):
        try:
            trainer = trainer_for(kind, path, out, args.fsdp_version)
            trainer.train()
            first = trainer.state.log_history[0]
            found[kind] = {k: first[k] for k in KEYS if k in first}
            callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FSDPQLoRACallback))
            found[kind]["engaged"] = callback.engagement
            found[kind]["distributed_type"] = str(trainer.accelerator.distributed_type)
        except Exception as err:  # noqa: BLE001 - reported to the test
            import traceback

            found[kind] = {"error": "".join(traceback.format_exception(err))[-3000:]}
        ts.reset_accelerate()
    finish_worker(out, found)  # results on disk, barrier, teardown, exit


if __name__ == "__main__":
    main()
