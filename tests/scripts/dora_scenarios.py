"""Worker for tests/test_dora.py: DoRA (QDoRA on the 4-bit base) through every trainer route in one launch.

Launched with ``accelerate launch --config_file accelerate_configs/cpu_fsdp{1,2}_rehearsal.yaml`` (2 ranks,
per-device batch 2) or run as one plain process with ``--single`` (batch 4: the same global batch, the oracle).
Scenarios, in order:

* ``ours``: :class:`FSDPQLoRATrainer` on ``load_qlora_model(..., lora_config=LoraConfig(use_dora=True))``, 4 steps,
  a checkpoint at step 2;
* ``resume``: the same run resumed from ``ours``' step-2 checkpoint (must end bit-equal to ``ours``);
* ``sft``: :class:`FSDPQLoRASFTTrainer` with ``peft_config=LoraConfig(use_dora=True)`` (trl builds the peft model);
* ``stock``: a stock ``transformers.Trainer`` alone (FSDP1 only: the upstream failure, recorded);
* ``callback``: a stock ``transformers.Trainer`` with :class:`FSDPQLoRACallback`;
* ``ac``: ``ours`` with activation checkpointing (``load_qlora_model``'s default), applied once as the trainer
  chooses: FSDP's own under the FSDP2 config, the model's under FSDP1's and single-process;
* ``prec``: float32 master weights (issue 34): ``ours`` in bf16 at a constant lr on ordered micro-batches
  (tests/scripts/precision_scenarios.py), the adapters before and after saved to prec/weights.pt with their dtypes;
* ``stockpeft`` (``--single`` only, after the launches, ``--init`` = a ``prec`` run's weights.pt): ``prec``'s oracle,
  stock peft (fp32 DoRA adapters) and a stock ``Trainer(bf16=True)`` from the same adapters on the same micro-batches
  (gradient accumulation 2 = 2 ranks);
* with ``--trl ARGS...``, last: trl's ``sft.py`` from the installed trl package, run by the function behind
  ``python -m hf_fsdp_qlora.run`` (``--use_peft --use_dora --load_in_4bit`` among ARGS).

Each rank writes rank<N>.json: per-step losses averaged over ranks (the global batch's mean: samples have equal
length, no padding), engagement, the FSDP units that hold DoRA's modules; the saved adapters stay on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as base
from dist_utils import finish_worker

import hf_fsdp_qlora  # noqa: F401  (installs the CPU rehearsal hook before TrainingArguments)
from hf_fsdp_qlora import FSDPQLoRACallback, load_qlora_model
from hf_fsdp_qlora.train.fsdp import fsdp_unit_kinds

STEPS = 4
SCENARIOS = ("ours", "resume", "sft", "callback", "ac", "prec")
PREC_LR = 2e-4  # a Adam step of ~lr: below half a bf16 ulp of a magnitude near 1 (1/256), kept in float32


def dora_config():
    return base.lora_config(use_dora=True)


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def args_for(out, single, **kw):
    """Same global batch either way: 2 ranks x 2, or 1 process x 4."""
    return base.training_args(
        out, 1, "llama", steps=STEPS, per_device_train_batch_size=base.BATCH * (2 if single else 1), **kw
    )


def global_losses(local: list[float]) -> list[float]:
    losses = torch.tensor(local, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= world()
    return losses.tolist()


def build(kind, path, out, single):
    from transformers import Trainer

    torch.manual_seed(0)  # the same LoRA initialisation in the sharded run and in the single-process oracle
    if kind == "sft":
        from trl import SFTConfig

        args = args_for(out, single)
        fields = {f for f, d in SFTConfig.__dataclass_fields__.items() if d.init}
        sft_args = SFTConfig(**{**{k: v for k, v in vars(args).items() if k in fields}, "bf16": False})
        return base.LossRecorderSFT(
            model=base.user_loaded(path, peft=False),
            args=sft_args,
            peft_config=dora_config(),
            train_dataset=base.sft_dataset(),
        )
    if kind == "stock":  # upstream alone: a stock Trainer, no callback (under FSDP1 it fails in the first forward)
        model = load_qlora_model(path, lora_config=dora_config(), gradient_checkpointing=False)
        return Trainer(model=model, args=args_for(out, single), train_dataset=base.TokenDataset())
    if kind == "callback":
        model = base.user_loaded(path, peft=False)
        from peft import get_peft_model

        model = get_peft_model(model, dora_config())
        return base._recording(Trainer)(
            model=model, args=args_for(out, single), train_dataset=base.TokenDataset(), callbacks=[FSDPQLoRACallback()]
        )
    if kind == "prec":
        import precision_scenarios as prec

        from hf_fsdp_qlora import FSDPQLoRATrainingArguments

        model = load_qlora_model(path, lora_config=dora_config(), gradient_checkpointing=False)
        args = prec.training_args(FSDPQLoRATrainingArguments, out, 0, "llama", PREC_LR)
        return base.LossRecorder(model=model, args=args, train_dataset=prec.OrderedTokens())
    # `ac`: load_qlora_model's default gradient_checkpointing=True. Under a launch the trainer applies it once:
    # FSDP's own under the FSDP2 rehearsal config (fsdp_activation_checkpointing: true), the model's under FSDP1's.
    model = load_qlora_model(path, lora_config=dora_config(), gradient_checkpointing=kind == "ac")
    save = {} if kind == "ac" else {"save_strategy": "steps", "save_steps": 2}
    return base.LossRecorder(model=model, args=args_for(out, single, **save), train_dataset=base.TokenDataset())


def trainable_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def dtypes(trainer) -> dict:
    """What the optimizer steps (issue 34: float32 master weights) and what FSDP computes in."""
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    policy = getattr(trainer.accelerator.state.fsdp_plugin, "mixed_precision_policy", None)
    return {
        "trainable_dtypes": sorted({str(p.dtype) for p in trainable_params(trainer.model)}),
        "optimizer_state_dtypes": sorted(
            {str(v.dtype) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
        ),
        "mp_param_dtype": str(getattr(policy, "param_dtype", None)),
        "mp_reduce_dtype": str(getattr(policy, "reduce_dtype", None)),
    }


def stock_peft(path, out, init_path):
    """``prec``'s oracle: stock peft's fp32 DoRA adapters from ``prec``'s start, a stock Trainer(bf16=True), one
    process, the same micro-batches (2 per step, gradient accumulation 2 = 2 ranks x 2). Saves the trained adapters."""
    import precision_scenarios as prec
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    out.mkdir(parents=True, exist_ok=True)
    init = torch.load(init_path)["init"]
    model = get_peft_model(base.user_loaded(path, peft=False), dora_config())
    params = dict(model.named_parameters())
    before = sorted({str(params[n].dtype) for n in init})
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value)
    args = prec.training_args(TrainingArguments, out, 0, "llama", PREC_LR, gradient_accumulation_steps=2)
    Trainer(model=model, args=args, train_dataset=prec.OrderedTokens()).train()
    trained = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"init": init, "trained": trained}, out / "weights.pt")
    base.reset_accelerate()
    return {"trainable_dtypes_before_wrap": before}


def run(kind, path, out, single, version):
    result = {}
    name = "ours" if kind == "resume" else kind
    trainer = build(name, path, out / kind, single)
    resume = str(out / "ours" / "checkpoint-2") if kind == "resume" else None
    init = base.trainable_snapshot(trainer.model) if kind == "prec" else None  # rank 0 broadcasts it
    trainer.train(resume_from_checkpoint=resume)
    if kind == "prec":  # gathered independently of the package (train_scenarios.full_trainable), collective
        result.update(dtypes(trainer))
        trained = base.full_trainable(trainer.model, version) if version else base.trainable_snapshot(trainer.model)
        if base.rank() == 0:
            (out / kind).mkdir(parents=True, exist_ok=True)
            torch.save({"init": init, "trained": trained}, out / kind / "weights.pt")
    result["losses"] = global_losses(trainer.losses)
    result["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    cb = next((c for c in trainer.callback_handler.callbacks if isinstance(c, FSDPQLoRACallback)), None)
    result["engagement"] = cb.engagement if cb else None
    result["units"] = fsdp_unit_kinds(trainer.model)  # FSDP1: DoRA magnitudes, lora_A/B own units
    result["magnitude_params"] = sum("lora_magnitude_vector" in n for n, _ in trainer.model.named_parameters())
    # Layers checkpointed: FSDP's CheckpointWrapper, or transformers' flag on each layer (the model's own).
    result["checkpointed"] = sum(
        "CheckpointWrapper" in type(m).__name__ or getattr(m, "gradient_checkpointing", False) is True
        for m in trainer.model.modules()
    )
    adapter = out / kind / "adapter"
    if not hasattr(trainer, "fsdp_callback"):  # a stock Trainer: save with our function
        from hf_fsdp_qlora.train.checkpoint import save_adapter

        save_adapter(trainer.model, adapter)
    else:
        trainer.save_model(str(adapter))
    if dist.is_initialized():
        dist.barrier()
    base.reset_accelerate()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--fsdp-version", type=int, default=0)
    parser.add_argument("--single", action="store_true", help="one plain process, batch 4: the oracle")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--init", help="stockpeft: the prec run (weights.pt) whose start to copy")
    parser.add_argument("--trl", nargs=argparse.REMAINDER, default=[], help="then trl's sft.py with these arguments")
    args = parser.parse_args()
    # train_scenarios adds TrainingArguments.fsdp unless accelerate launched it: the oracle runs without FSDP.
    base.LAUNCHED_BY_ACCELERATE = base.LAUNCHED_BY_ACCELERATE or args.single
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for kind in args.scenarios.split(","):
        wall, cpu = time.perf_counter(), time.process_time()  # where the launch's time goes (issue 33)
        try:
            if kind == "stockpeft":
                results[kind] = stock_peft(args.model, out / kind, args.init)
            else:
                results[kind] = run(kind, args.model, out, args.single, args.fsdp_version)
            results[kind]["ok"] = True
            results[kind].update(
                seconds=round(time.perf_counter() - wall, 2), cpu_s=round(time.process_time() - cpu, 2)
            )
        except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
            results[kind] = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:2000]}",
                             "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
            print(f"[rank{base.rank()}] scenario {kind} failed:\n{traceback.format_exc()}", flush=True)
            base.reset_accelerate()
    if not args.trl:
        finish_worker(out, results)  # results on disk, barrier, teardown, exit
    (out / f"rank{base.rank()}.json").write_text(json.dumps(results, indent=1, default=str))
    # Last, trl's own sft.py as `python -m hf_fsdp_qlora.run SFT.py ARGS` runs it: the same function, in this
    # process (the scenarios above reset accelerate's state), which ends the process with the script's status.
    import trl.scripts.sft

    from hf_fsdp_qlora.train.launcher import main as run_script

    run_script([trl.scripts.sft.__file__, *args.trl])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
