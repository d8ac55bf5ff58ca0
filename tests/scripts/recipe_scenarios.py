"""Worker for the recipe matrix: every training route, with each trainer's own default arguments, in one launch.

Launched with `accelerate launch --config_file accelerate_configs/cpu_fsdp{1,2}_rehearsal.yaml`. Routes:

  ours      - FSDPQLoRATrainer + load_qlora_model (gradient checkpointing on in the model) + our TrainingArguments
  ours_sft  - FSDPQLoRASFTTrainer(model=path, SFTConfig defaults, trl's QLoRA quantization/peft configs)
  callback  - stock transformers.Trainer + FSDPQLoRACallback, a model loaded by hand (uint8 storage, peft defaults)
  dpo       - trl's DPOTrainer + FSDPQLoRACallback (DPOConfig defaults, trl's QLoRA configs)

The trl routes use trl's own `get_quantization_config`/`get_peft_config` for `--load_in_4bit --use_peft` (the
recipe of trl's docs) and the configs' defaults (gradient_checkpointing=True, bf16=True). For each route: 4 steps
with evaluation and a checkpoint every 2 steps, a final `save_model`, then a fresh run resumed from checkpoint-2.
Rank 0 writes what it found; the pytest side asserts.

With ``--trl NAME ARGS...``, last: trl's own ``NAME.py`` (sft or dpo) from the installed trl package, run by the
function behind ``python -m hf_fsdp_qlora.run`` in this process (which ends it with the script's status), after
rank 0 printed TRL_MARKER to stdout and stderr: what the launch printed after it is the script's. This spares the
script a launch of its own (~15 CPU s of launcher and imports on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as ts
from dist_utils import finish_worker
from recipe_fixtures import TRL_MARKER, build_chat_dataset, build_preference_dataset
from transformers import TrainerCallback

import hf_fsdp_qlora  # noqa: F401  (the CPU rehearsal hook, as a user's script would have it)
from hf_fsdp_qlora import FSDPQLoRACallback

STEPS, SAVE_EVERY = 4, 2
COMMON = dict(
    max_steps=STEPS, per_device_train_batch_size=2, per_device_eval_batch_size=2, logging_steps=1,
    eval_strategy="steps", eval_steps=SAVE_EVERY, save_strategy="steps", save_steps=SAVE_EVERY,
    report_to="none", learning_rate=1e-3, seed=11,
)  # fmt: skip


class CountForwards(TrainerCallback):
    """Calls of each decoder layer's MLP with autograd on, per optimizer step: 1 without activation checkpointing,
    2 with it applied once (forward + recompute), 3 when applied twice. (DPO's reference pass runs under no_grad.)"""

    def __init__(self):
        self.calls, self.per_step, self.layers = 0, [], 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for name, module in model.named_modules():
            if name.endswith("mlp") and ".layers." in name:
                self.layers += 1
                # A pre-hook: non-reentrant checkpointing stops the recompute as soon as the last saved tensor it
                # needs is rebuilt, so a forward hook (run after forward returns) misses recomputations.
                module.register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs):
        if torch.is_grad_enabled() and module.training:
            self.calls += 1

    def on_step_begin(self, args, state, control, **kwargs):
        self.calls = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.calls / max(self.layers, 1))


def trl_model_args(path):
    from trl import ModelConfig

    # What `--model_name_or_path PATH --use_peft --load_in_4bit` gives trl's scripts.
    return ModelConfig(model_name_or_path=path, use_peft=True, load_in_4bit=True)


def build(route, path, data, out):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from trl import get_peft_config, get_quantization_config

    counter = CountForwards()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if route == "ours":
        from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model

        # bf16=True with LoRA dropout and the model's non-reentrant checkpointing: under FSDP1 accelerate's fp32
        # upcast of the adapters made the recomputation differ from the forward (CheckpointError).
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
        model = load_qlora_model(path, lora_config=lora)
        args = FSDPQLoRATrainingArguments(output_dir=str(out), bf16=True, **COMMON)
        trainer = FSDPQLoRATrainer(
            model=model, args=args, train_dataset=ts.TokenDataset(vocab=64), eval_dataset=ts.TokenDataset(vocab=64),
            callbacks=[counter],
        )  # fmt: skip
    elif route == "ours_sft":
        from trl import SFTConfig

        from hf_fsdp_qlora import FSDPQLoRASFTTrainer

        margs = trl_model_args(path)
        trainer = FSDPQLoRASFTTrainer(
            model=path, args=SFTConfig(output_dir=str(out), **COMMON), processing_class=tokenizer,
            train_dataset=data["chat"]["train"], eval_dataset=data["chat"]["test"],
            quantization_config=get_quantization_config(margs), peft_config=get_peft_config(margs), callbacks=[counter],
        )  # fmt: skip
    elif route == "callback":
        margs = trl_model_args(path)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=get_quantization_config(margs))
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        )
        trainer = Trainer(
            model=model, args=TrainingArguments(output_dir=str(out), **COMMON),
            train_dataset=ts.TokenDataset(vocab=64), eval_dataset=ts.TokenDataset(vocab=64),
            callbacks=[FSDPQLoRACallback(), counter],
        )  # fmt: skip
    elif route == "dpo":
        from trl import DPOConfig, DPOTrainer

        margs = trl_model_args(path)
        trainer = DPOTrainer(
            model=path, args=DPOConfig(output_dir=str(out), **COMMON), processing_class=tokenizer,
            train_dataset=data["pref"]["train"], eval_dataset=data["pref"]["test"],
            quantization_config=get_quantization_config(margs), peft_config=get_peft_config(margs),
            callbacks=[FSDPQLoRACallback(), counter],
        )  # fmt: skip
    else:
        raise ValueError(route)
    return trainer, counter


def our_callback(trainer):
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FSDPQLoRACallback))


def adapter_file(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "adapter_model.safetensors"))


def matches(saved: dict, gathered: dict) -> dict:
    """The saved adapter against the oracle gather: same LoRA keys (peft's canonical form), equal bit for bit."""
    canon = {k.replace(".default", ""): v for k, v in gathered.items()}
    common = sorted(set(saved) & set(canon))
    unequal = [k for k in common if not torch.equal(saved[k].float(), canon[k].float())]
    return {
        "saved_keys": len(saved),
        "gathered_keys": len(canon),
        "missing_from_saved": sorted(set(canon) - set(saved))[:5],
        "unequal": unequal[:5],
        "lora_b_nonzero": sum(bool(v.abs().sum() > 0) for k, v in saved.items() if "lora_B" in k),
    }


def losses(trainer, key="loss"):
    return {int(e["step"]): e[key] for e in trainer.state.log_history if key in e}


def run_route(route, path, data, out, version, found):
    a, counter = build(route, path, data, out / "A")
    a.train()
    cb = our_callback(a)
    record = {
        "class": type(a).__name__,
        "adopted": type(a).__mro__[1].__name__,
        "engaged": cb.engagement,
        "forwards_per_step": counter.per_step,
        "losses": losses(a),
        "eval_losses": losses(a, "eval_loss"),
        "model_checkpointing": bool(getattr(a.model, "is_gradient_checkpointing", False)),
        "args_checkpointing": bool(a.args.activation_checkpointing),
        "trainable_dtypes": sorted({str(p.dtype) for p in a.model.parameters() if p.requires_grad}),
    }
    gathered_a = ts.full_trainable(a.model, version)
    a.save_model(str(out / "A" / "final"))
    ts.reset_accelerate()

    b, _ = build(route, path, data, out / "B")
    b.train(resume_from_checkpoint=str(out / "A" / f"checkpoint-{SAVE_EVERY}"))
    record["resumed_losses"] = losses(b)
    gathered_b = ts.full_trainable(b.model, version)
    ts.reset_accelerate()

    if dist.get_rank() == 0:
        record["final"] = matches(adapter_file(out / "A" / "final"), gathered_a)
        record["checkpoint"] = matches(adapter_file(out / "A" / f"checkpoint-{STEPS}"), gathered_a)
        record["checkpoint_files"] = sorted(p.name for p in (out / "A" / f"checkpoint-{SAVE_EVERY}").iterdir())
        record["resume_equal"] = sorted(gathered_a) == sorted(gathered_b) and all(
            torch.equal(gathered_a[k], gathered_b[k]) for k in gathered_a
        )
        record["output_entries"] = sorted(p.name for p in (out / "A").iterdir())
    found[route] = record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument("--routes", default="ours,ours_sft,callback,dpo")
    parser.add_argument("--trl", nargs=argparse.REMAINDER, default=[], help="then trl's NAME.py with ARGS")
    args = parser.parse_args()
    from accelerate import PartialState
    from datasets import load_dataset

    PartialState()  # joins the process group (as TrainingArguments would), CPU ranks via the rehearsal hook
    out, path = Path(args.out), str(Path(args.models) / "recipe")
    data = {}
    if dist.get_rank() == 0:
        build_chat_dataset(out / "data" / "chat")
        build_preference_dataset(out / "data" / "pref")
    dist.barrier()
    for kind in ("chat", "pref"):
        data[kind] = load_dataset(str(out / "data" / kind))
    found = {"ln2": math.log(2)}
    for route in args.routes.split(","):
        run_route(route, path, data, out / route, args.fsdp_version, found)
    if not args.trl:
        finish_worker(out, found)  # results on disk, barrier, teardown, exit
    from hf_fsdp_qlora.train.launcher import main as run_script

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(found, indent=1, default=str))
    script = importlib.import_module(f"trl.scripts.{args.trl[0]}").__file__
    dist.barrier()  # every route's output is printed before the marker
    if dist.get_rank() == 0:
        for stream in (sys.stdout, sys.stderr):
            print(TRL_MARKER, file=stream, flush=True)
    run_script([script, *args.trl[1:]])  # never returns


if __name__ == "__main__":
    main()
