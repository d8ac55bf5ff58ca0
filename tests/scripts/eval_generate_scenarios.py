"""Worker for tests/test_eval_generate.py: evaluate / predict / generate under FSDP1 or FSDP2, in one launch.

Launched with `accelerate launch --config_file accelerate_configs/cpu_fsdp{1,2}_rehearsal.yaml`. Scenarios:

* ``fresh``  - our trainer before any training: evaluate(), predict(), generate_under_fsdp() (each rank its own
  prompt and max_new_tokens), then 2 training steps;
* ``stock_fresh`` - stock transformers.Trainer without our callback, evaluate() before training (upstream bug);
* ``callback_fresh`` - stock transformers.Trainer + FSDPQLoRACallback, evaluate() before training (works);
* ``during`` - 3 steps with eval_strategy="steps", eval_steps=1 and SampleGenerationsCallback every step, then
  evaluate(), predict(), generate; the adapter is gathered and saved after every step;
* ``plain`` - the same 3 steps without evaluation or sample generations (the loss oracle for ``during``).

Each rank writes rank<N>.json; rank 0 saves the adapters (init / per step) the pytest side loads into an
unsharded model to compute the expected losses, logits and tokens.
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import bitsandbytes as bnb
import torch
import torch.distributed as dist
from dist_utils import finish_worker

# On CPUs with AVX512-BF16, bitsandbytes repacks every 4-bit weight in place at the first no-grad forward (an
# evaluate() or generate()), after which the weights differ from the unsharded oracle's. Another change turns this
# off globally; until then this worker does it itself: on the class, and on every instance in build() (Linear4bit
# sets the flag per instance in __init__, so the class attribute alone does not reach already built layers).
bnb.nn.Linear4bit.support_avx512bf16_for_cpu = False

from train_scenarios import TokenDataset, full_trainable, lora_config, reset_accelerate, training_args
from transformers import Trainer, TrainerCallback

import hf_fsdp_qlora  # noqa: F401  (installs the CPU rehearsal hook before TrainingArguments)
from hf_fsdp_qlora import FSDPQLoRACallback, FSDPQLoRATrainer, load_qlora_model
from hf_fsdp_qlora.train.generation import (
    SampleGenerationsCallback,
    generate_under_fsdp,
)

# Per-rank prompts of equal length; rank 1 asks for more tokens than rank 0, so under FSDP rank 0 must keep
# running forward passes after it has finished (synced_gpus).
PROMPTS = {0: [5, 17, 42, 99], 1: [7, 8, 200, 31]}
MAX_NEW = {0: 5, 1: 8}
SAMPLE_PROMPTS = [[11, 12, 13], [250, 3, 77, 90, 4]]
SAMPLE_NEW = 4
# A constant learning rate, so the first steps of a 2-step run equal those of a 3-step run.
COMMON = {"per_device_eval_batch_size": 2, "lr_scheduler_type": "constant"}


def rank() -> int:
    return dist.get_rank()


Evaluating = FSDPQLoRATrainer  # its evaluation_loop calls hf_fsdp_qlora.train.generation.prepare_for_evaluation


class Recorder(TrainerCallback):
    """Per-step local losses come from log_history; this records what the callbacks left behind at each step end:
    the model's mode right after SampleGenerationsCallback, and (rank 0) the gathered adapter."""

    def __init__(self, version, out):
        self.version, self.out, self.modes = version, out, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.modes.append(bool(model.training))
        weights = full_trainable(model, self.version)  # collective
        if rank() == 0:
            torch.save(weights, self.out / f"adapter_step{state.global_step}.pt")


def build(path, bits=4):
    model = load_qlora_model(path, bits=bits, lora_config=lora_config(), gradient_checkpointing=False)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    # Nonzero lora_B, so the adapter changes the outputs from the start (the trainer broadcasts rank 0's).
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_((torch.randn(param.shape, generator=gen) * 0.05).to(param.dtype))
    return model


def trainable(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def generate_local(model):
    ids = torch.tensor([PROMPTS[rank()]])
    out = generate_under_fsdp(
        model, input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
        max_new_tokens=MAX_NEW[rank()], min_new_tokens=MAX_NEW[rank()], pad_token_id=0,
    )  # fmt: skip
    return out[0].tolist()


def eval_predict_generate(trainer, result, tag, out):
    data = TokenDataset()
    result[f"{tag}_evaluate"] = trainer.evaluate(data)
    pred = trainer.predict(data)
    result[f"{tag}_predict_metrics"] = pred.metrics
    if rank() == 0:
        torch.save(torch.as_tensor(pred.predictions).float(), out / f"{tag}_predictions.pt")
    result[f"{tag}_generate"] = generate_local(trainer.model)
    result[f"{tag}_mode_after"] = bool(trainer.model.training)


def engagement(trainer, result):
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FSDPQLoRACallback))
    result["engagement"] = cb.engagement
    result["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    result["model_type"] = type(trainer.model).__name__
    packed = [p for n, p in trainer.model.named_parameters() if n.endswith("base_layer.weight")]
    result["packed_dtensor"] = sum(type(p).__name__ == "DTensor" for p in packed)
    result["packed_count"] = len(packed)
    result["flat_params"] = sum(type(p).__name__ == "FlatParameter" for p in trainer.model.parameters())
    result["checkpoint_wrappers"] = sum("CheckpointWrapper" in type(m).__name__ for m in trainer.model.modules())


def run(name, path, out, version):
    result = {"scenario": name}
    here = out / name
    here.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)  # the same LoRA A initialisation in every scenario
    model = build(path, bits=8 if name == "fresh8" else 4)  # fresh8: an 8-bit base (docs/int8.md)
    data = TokenDataset()
    if name in ("stock_fresh", "callback_fresh"):  # upstream transformers.Trainer, evaluate() before training
        args = training_args(here, version, "llama", steps=2, **COMMON)
        callbacks = [FSDPQLoRACallback()] if name == "callback_fresh" else None
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        try:
            result["evaluate"] = trainer.evaluate(data)
        except Exception as err:  # noqa: BLE001  (recorded: the test asserts the upstream error)
            result["error"] = f"{type(err).__name__}: {err}"
        return result
    if name in ("fresh", "fresh8"):
        args = training_args(here, version, "llama", steps=2, **COMMON)
        trainer = Evaluating(model=model, args=args, train_dataset=data)
        if rank() == 0:
            torch.save(trainable(trainer.model), here / "adapter_init.pt")
        eval_predict_generate(trainer, result, "before", here)
        trainer.train()
        result["train_losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    else:
        steps = {"eval_strategy": "steps", "eval_steps": 1} if name == "during" else {}
        args = training_args(here, version, "llama", steps=3, **COMMON, **steps)
        sampler = SampleGenerationsCallback(SAMPLE_PROMPTS, every_n_steps=1, max_new_tokens=SAMPLE_NEW)
        recorder = Recorder(version, here)
        callbacks = [sampler, recorder] if name == "during" else [recorder]
        trainer = Evaluating(model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=callbacks)
        if rank() == 0:
            torch.save(trainable(trainer.model), here / "adapter_init.pt")
        trainer.train()
        result["modes_after_step"] = recorder.modes
        result["sample_history"] = sampler.history if name == "during" else None
        if name == "during":
            eval_predict_generate(trainer, result, "after", here)
    engagement(trainer, result)
    result["log_history"] = trainer.state.log_history
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", required=True)
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument(
        "--scenarios", required=True, help="comma-separated names (fresh, stock_fresh, callback_fresh, during, plain)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.scenarios.split(","):
        try:
            results[name] = run(name, str(Path(args.models) / "llama"), out, args.fsdp_version)
            results[name]["ok"] = True
        except Exception as err:  # noqa: BLE001  (recorded for the test to assert on)
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                             "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
            print(f"[rank{rank()}] scenario {name} failed:\n{traceback.format_exc()}", flush=True)
        dist.barrier()
        reset_accelerate()
    finish_worker(out, results)  # results on disk, barrier, teardown, exit


if __name__ == "__main__":
    main()
