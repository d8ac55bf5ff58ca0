"""Worker of the options sweep (tests/options_grid.py says what a cell is; tests/test_options.py asserts).

``--stock``: one process, no FSDP: per option, transformers' ``Trainer`` on a stock peft model (float32 adapters)
loaded with ``from_pretrained(quantization_config=...)``; the first run's initial adapter is saved (init.pt) and
every run starts from it. Writes stock.json and, per run, its adapter and prediction tensors (KEY.pt).
Launched (2 ranks, the CPU rehearsal config of ``--fsdp-version``): every cell of the grid's settings of that FSDP
version, through ``load_qlora_model`` and ``FSDPQLoRATrainer`` from the same initial adapter. Rank 0 writes
rank0.json and KEY.pt per cell. A cell raising before its first optimizer step is recorded as refused with the
error's text; anything else raised is a failure (with its traceback).
"""

from __future__ import annotations

import argparse
import gc
import json
import traceback
from pathlib import Path

import options_grid as grid
import torch
import train_scenarios as ts
from dist_utils import finish_worker

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before TrainingArguments)


class TrainData(torch.utils.data.Dataset):
    """Rows of SEQ tokens whose first 1-5 targets are masked (uneven: the loss's normalisation is visible)."""

    def __init__(self, rows=grid.TRAIN_ROWS, masked=True, seed=17):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 256, (rows, grid.SEQ), generator=gen)
        self.masked = masked

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        labels = ids.clone()
        if self.masked:
            labels[: 1 + i % 5] = -100
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def eval_data():
    """Fully labelled rows of one length: the evaluation loss does not depend on how rows are batched."""
    return TrainData(rows=grid.EVAL_ROWS, masked=False, seed=23)


def sft_data(data: TrainData):
    """`data` as trl takes a pre-tokenized dataset: input ids and a completion mask (trl's completion_only_loss masks
    the same targets TrainData does)."""
    from datasets import Dataset

    rows = [data[i] for i in range(len(data))]
    mask = [(r["labels"] != -100).long().tolist() for r in rows]
    return Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows], "completion_mask": mask})


def datasets(route: str) -> tuple:
    """(train, eval) data of a route: the Trainer's torch datasets, or trl's pre-tokenized ones."""
    if route == "sft":
        return sft_data(TrainData()), sft_data(eval_data())
    return TrainData(), eval_data()


def make_trainer(route: str, ours: bool, model, args: dict, option: str, more: dict | None = None):
    """The trainer a user builds on `route`: transformers' Trainer (ours: FSDPQLoRATrainer with our arguments), or
    trl's SFTTrainer with SFTConfig (ours: the same stock class, made ours by ``-m hf_fsdp_qlora.run``)."""
    train, _ = datasets(route)
    extra = {**grid.option(option)["trainer"], **(more or {})}
    if route == "sft":
        from tiny_models import build_tokenizer
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**args, completion_only_loss=True, bf16=False)
        trainer = SFTTrainer(
            model=model, args=config, train_dataset=train, processing_class=build_tokenizer(), **extra
        )
        if not ours:  # trl casts a quantized model's adapters to bf16; the oracle keeps peft's float32, as we do
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
        return trainer
    from transformers import Trainer, TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments

    if ours:
        return FSDPQLoRATrainer(model=model, args=FSDPQLoRATrainingArguments(**args), train_dataset=train, **extra)
    return Trainer(model=model, args=TrainingArguments(**args), train_dataset=train, **extra)


def lora_config(model: str, option: str):
    # lora_B non-zero: the adapter acts from the first step
    row = grid.option(option)["model"]
    return ts.lora_config(init_lora_weights=False, use_dora=(model == "dora"), **row["lora"])


def common_args(out: Path, option: str, eval_batch: int) -> dict:
    """The arguments every run shares (SGD at a constant schedule's default, rows in order), then the option's."""
    shared = {
        "output_dir": str(out), "max_steps": grid.STEPS, "learning_rate": grid.LEARNING_RATE, "optim": "sgd",
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True, "seed": 0,
        "train_sampling_strategy": "sequential", "per_device_eval_batch_size": eval_batch, "disable_tqdm": True,
    }  # fmt: skip
    return {**shared, **grid.option(option)["args"]}


def copy_adapter(model, init: dict) -> None:
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == set(init), f"not the stock run's adapter: {sorted(trainable ^ set(init))[:4]}"
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value)


def record(trainer, model, option: str, out: Path, key: str, version: int | None, route: str) -> dict:
    """What a run is compared on: per-step logs, the evaluation's metrics and tensors, the adapter (KEY.pt)."""
    tensors, found = {}, {"logs": [h for h in trainer.state.log_history if "loss" in h]}
    evaluation = datasets(route)[1]
    for call in grid.option(option)["after"]:
        if call == "evaluate":
            found["eval_loss"] = trainer.evaluate(evaluation)["eval_loss"]
        elif call == "predict":
            pred = trainer.predict(evaluation)
            logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
            tensors["predictions"], tensors["label_ids"] = torch.as_tensor(logits), torch.as_tensor(pred.label_ids)
            found["test_loss"] = pred.metrics.get("test_loss")
    tensors["adapter"] = ts.full_trainable(model, version) if version else ts.trainable_snapshot(model)
    if ts.rank() == 0:
        torch.save(tensors, out / f"{key}.pt")
    return found


def stock_model(models: Path, option: str, variant: str):
    """The model as a user builds it with stock transformers + peft: float32 adapters (peft's default)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32,
    )  # fmt: skip
    if variant == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    row = grid.option(option)["model"]
    path = models / row["arch"]
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32, **row["config"])
    for module in model.modules():  # bitsandbytes' in-place CPU repack at a no-grad forward (FACTS.md): off
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    torch.manual_seed(0)
    return get_peft_model(model, lora_config(variant, option))


def initial_adapter(model, option: str, variant: str, out: Path) -> dict:
    """The first stock model's trainable weights of `variant` on that architecture, saved for every run to start
    from."""
    path = grid.init_file(out, option, variant)
    if not path.exists():
        torch.save({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, path)
    return torch.load(path)


def stock_run(models: Path, out: Path, run: tuple) -> dict:
    """One stock run (tests/options_grid.py's stock_run): its record, its tensors saved."""
    option, variant, groups, route, batch, packed = run
    model = stock_model(models, option, variant)
    copy_adapter(model, initial_adapter(model, option, variant, out))
    key, chosen = grid.stock_key(run), grid.option(option)
    args = {"per_device_train_batch_size": batch, **common_args(out / key, option, eval_batch=1)}
    extra = {**oracle_loss(chosen, model, groups), **packing(packed)}
    trainer = make_trainer(route, False, model, args, option, extra)
    trainer.train()
    return record(trainer, model, option, out, key, None, route)


def packing(packed: bool) -> dict:
    """Trainer keywords of padding-free packing: transformers' flattening collator (position ids restart per row)."""
    if not packed:
        return {}
    from transformers import DataCollatorWithFlattening

    return {"data_collator": DataCollatorWithFlattening()}


def oracle_loss(chosen: dict, model, groups: int) -> dict:
    """The stock run's loss function where an option averages per data-parallel rank (tests/options_grid.py)."""
    if chosen["per_rank_aux"]:
        return {"compute_loss_func": grid.router_aux_loss(model, groups)}
    if chosen["per_rank_mean"]:
        return {"compute_loss_func": grid.group_means_loss(groups)}
    return {}


def run_stock(models: Path, out: Path) -> dict:
    found = {}
    for run in grid.stock_runs():
        try:
            found[grid.stock_key(run)] = stock_run(models, out, run)
        except Exception as exc:  # noqa: BLE001  (stock itself refuses: the cell must refuse too)
            found[grid.stock_key(run)] = {"error": f"{type(exc).__name__}: {exc}"}
    return found


def our_model(models: Path, option: str, column: dict):
    """The model of a cell: ours from load_qlora_model, or (trl's route) built as the stock user builds it."""
    from hf_fsdp_qlora import load_qlora_model

    if column["route"] == "sft":
        return stock_model(models, option, column["model"])
    row = grid.option(option)["model"]
    return load_qlora_model(
        models / row["arch"], dtype=torch.float32, lora_config=lora_config(column["model"], option),
        bits=8 if column["model"] == "int8" else 4, **row["load"], **row["config"],
    )  # fmt: skip


def run_cell(models: Path, out: Path, option: str, setting: str, inits: Path) -> dict:
    from hf_fsdp_qlora.train.fsdp import fsdp_engagement

    column, key = grid.SETTINGS[setting], grid.cell_key(option, setting)
    model, trainer = None, None
    try:
        model = our_model(models, option, column)
        init = grid.init_file(inits, option, column["model"])
        if init.exists():  # none where stock itself refused: then only a refusal before the first step compares
            copy_adapter(model, torch.load(init))
        args = {
            "per_device_train_batch_size": column["batch"], **common_args(out / key, option, column["eval_batch"]),
            **column["args"],
        }  # fmt: skip
        trainer = make_trainer(column["route"], True, model, args, option, packing(column["packed"]))
        trainer.train()
        if grid.option(option)["resume"]:  # a fresh model and trainer, resumed from the step-1 checkpoint
            del model, trainer
            ts.reset_accelerate()
            model, trainer = our_model(models, option, column), None
            trainer = make_trainer(column["route"], True, model, args, option, packing(column["packed"]))
            trainer.train(resume_from_checkpoint=str(out / key / "checkpoint-1"))
        found = {
            "outcome": "ran",
            **record(trainer, trainer.model, option, out, key, column["version"], column["route"]),
        }
        found["distributed_type"] = str(trainer.accelerator.distributed_type)
        found["engaged"] = fsdp_engagement(trainer.model)
    except Exception as exc:  # noqa: BLE001  (a cell's outcome, recorded for the test)
        found = {"outcome": "raised", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        found["before_first_step"] = trainer is None or trainer.state.global_step == 0
        found["ours"] = type(exc).__module__ == "hf_fsdp_qlora.errors"  # raised on purpose, with its fix
    finally:
        ts.reset_accelerate()
        del model, trainer
        gc.collect()
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--fsdp-version", type=int)
    parser.add_argument("--inits", help="the stock run's folder: every cell starts from its init_VARIANT.pt")
    parser.add_argument(
        "--route", default="trainer", help="the columns of this route (sft: under -m hf_fsdp_qlora.run)"
    )
    args = parser.parse_args()
    out, path = Path(args.out), Path(args.models)
    out.mkdir(parents=True, exist_ok=True)
    if args.stock:
        (out / "stock.json").write_text(json.dumps(run_stock(path, out), indent=1))
        return
    found = {}
    for setting, column in grid.SETTINGS.items():
        ours = column["version"] == args.fsdp_version and column["route"] == args.route
        for option in grid.OPTIONS if ours else ():
            if grid.not_applicable(option, setting) is None:
                found[grid.cell_key(option, setting)] = run_cell(path, out, option, setting, Path(args.inits))
    finish_worker(out, found)


if __name__ == "__main__":
    main()
