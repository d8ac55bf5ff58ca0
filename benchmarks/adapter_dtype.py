"""Float32 adapters (the default, issue 34) against the bf16 opt-out: memory and step time, side by side.

    python benchmarks/adapter_dtype.py                       # Llama hidden 512, 4 layers, 2 gloo ranks, FSDP2
    python benchmarks/adapter_dtype.py --shape small --steps 2 --warmup 1 --seq 16 --batch 1 --one-launch --json   # the smoke form (tests/test_adapter_dtype_benchmark.py)

Both contestants train the same workload under FSDP2 on 2 CPU ranks (accelerate launch with
accelerate_configs/cpu_fsdp2_rehearsal.yaml): a Llama built locally from a config (random weights, saved in bf16
to a temporary folder; nothing downloaded), NF4 with double quantization, bf16 autocast, LoRA r=16 on all linear
layers, AdamW, the same data. Only the adapter dtype differs:

    float32   load_qlora_model(adapter_dtype=torch.float32) + FSDPQLoRATrainingArguments(adapter_dtype="float32")
    bfloat16  the same with "bfloat16": pure 16-bit adapters

Measured per rank: the trainable parameters' bytes held (FSDP2 local shards), their gradients' and the optimizer
states' bytes after the first step (tracked tensors, exact), peak RSS during the steady steps (VmHWM reset at the
end of the warm-up; noisy at this size), and step time (median of the steady steps, wall and CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _launch  # benchmarks/, this script's folder, is first on sys.path

ROOT = Path(__file__).resolve().parents[1]
CONTESTANTS = ("float32", "bfloat16")
# Llama config fields. "cpu": the benchmark's; "small": the smoke test's (the bytes' ratios hold at any shape).
SHAPES = {
    "cpu": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 512},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512},
}  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: Path, shape: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(torch.bfloat16)
    model.save_pretrained(path)


def _vm_hwm() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _bytes(tensors) -> int:
    """Bytes of `tensors` (each a plain tensor or a DTensor's local shard)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _tracked(model, optimizer) -> dict:
    trainable = [p for p in model.parameters() if p.requires_grad]
    states = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "dim") and v.dim()]
    return {
        "trainable_dtypes": sorted({str(p.dtype) for p in trainable}),
        "adapter_bytes": _bytes(p.to_local() if hasattr(p, "to_local") else p for p in trainable),
        "grad_bytes": _bytes(g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in trainable) if g is not None),
        "optimizer_bytes": _bytes(v.to_local() if hasattr(v, "to_local") else v for v in states),
    }  # fmt: skip


def worker(args) -> None:
    """Train each contestant of --worker in turn in this launch; each rank writes OUT/NAME/rankR.json."""
    from _contestants import run_contestants  # benchmarks/, the script's own folder, is first on sys.path

    run_contestants(args.worker, train_one, args, args.out)


def train_one(name: str, args) -> dict:
    import torch
    from transformers import TrainerCallback

    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    model = load_qlora_model(args.model, adapter_dtype=getattr(torch, name), gradient_checkpointing=False)
    found = {"contestant": name, "rank": rank, "world": world}
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(
        3, SHAPES[args.shape]["vocab_size"], (args.steps * args.batch * world, args.seq), generator=gen
    )
    data = [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids]
    steps, marks = [], {}

    class Measure(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            marks["t"], marks["cpu"] = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, targs, state, control, model=None, **kw):
            if state.global_step == 0:  # the gradients exist here; the optimizer states after the first step
                marks["grad_bytes"] = _tracked(model, trainer.optimizer)["grad_bytes"]

        def on_step_end(self, targs, state, control, model=None, **kw):
            if state.global_step == 1:
                inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
                found.update(_tracked(model, inner), grad_bytes=marks["grad_bytes"])
            if state.global_step > args.warmup:
                steps.append((time.perf_counter() - marks["t"], time.process_time() - marks["cpu"]))
            if state.global_step == args.warmup:  # the training peak, not the load's: reset VmHWM (Linux)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            if state.global_step == args.steps:
                found["peak_rss_train"] = _vm_hwm()

    targs = FSDPQLoRATrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), max_steps=args.steps, learning_rate=1e-4, seed=0,
        per_device_train_batch_size=args.batch, report_to=[], save_strategy="no", bf16=True, use_cpu=True,
        disable_tqdm=True, logging_steps=args.steps, remove_unused_columns=False, adapter_dtype=name,
    )  # fmt: skip
    trainer = FSDPQLoRATrainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()])
    found["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    trainer.train()
    from torch.distributed.fsdp import FSDPModule

    found["fsdp2_modules"] = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    found["step_s"] = statistics.median(s for s, _ in steps)
    found["step_cpu_s"] = statistics.median(c for _, c in steps)
    return found


def launch(names: list[str], model: Path, out: Path, args) -> dict[str, list[dict]]:
    """One 2-rank launch training the contestants `names` in turn; returns every rank's findings per contestant."""
    shutil.rmtree(out, ignore_errors=True)
    name = ",".join(names)
    config = ROOT / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), "--num_processes",
           "2", "--main_process_port", str(_port()), str(Path(__file__).resolve()), "--worker", name,
           "--shape", args.shape,
           "--model", str(model), "--out", str(out), "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_FSDP", None)
    env.pop("HF_FSDP_QLORA_ADAPTER_DTYPE", None)
    proc = _launch.run(cmd, env, args.timeout)
    ranks = [out / n / f"rank{r}.json" for n in names for r in range(2)]
    if proc.returncode != 0 or not all(p.exists() for p in ranks):
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        raise RuntimeError(f"contestant(s) {name!r} failed (exit {proc.returncode}):\n{tail}")
    return {n: checked(n, [json.loads((out / n / f"rank{r}.json").read_text()) for r in range(2)]) for n in names}


def checked(name: str, found: list[dict]) -> list[dict]:
    """Refuse a contestant whose run did not engage FSDP2 or trained other adapters than it claims."""
    if "FSDP" not in found[0]["distributed_type"] or not found[0]["fsdp2_modules"]:
        raise RuntimeError(f"contestant {name!r}: FSDP2 not engaged ({found[0]['distributed_type']})")
    if found[0]["trainable_dtypes"] != [f"torch.{name}"]:
        raise RuntimeError(f"contestant {name!r} trained {found[0]['trainable_dtypes']} adapters")
    return found


FIELDS = ("adapter_bytes", "grad_bytes", "optimizer_bytes", "peak_rss_train", "step_s", "step_cpu_s")


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per contestant the worst rank's bytes and memory, rank 0's step time; float32 over bfloat16."""
    rows = {}
    for name, ranks in runs.items():
        row = {k: max(r[k] for r in ranks) for k in FIELDS[:4]}
        row.update(step_s=ranks[0]["step_s"], step_cpu_s=ranks[0]["step_cpu_s"])
        rows[name] = row
    ratios = {k: rows["float32"][k] / rows["bfloat16"][k] for k in FIELDS if rows["bfloat16"][k]}
    return {"contestants": rows, "ratios_fp32_over_bf16": ratios}


def print_table(result: dict) -> None:
    rows, ratios = result["contestants"], result["ratios_fp32_over_bf16"]
    mb = lambda b: f"{b / 2**20:9.2f} MiB"  # noqa: E731
    print(f"{'per rank':<16}{'float32':>16}{'bfloat16':>16}{'fp32/bf16':>11}")
    for k in FIELDS:
        fmt = (lambda v: f"{v:13.3f} s") if k.startswith("step") else mb
        print(f"{k:<16}{fmt(rows['float32'][k]):>16}{fmt(rows['bfloat16'][k]):>16}{ratios.get(k, 0):>10.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="per-device batch size")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per launch, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="print the result as JSON after the table")
    p.add_argument("--keep", help="build the model and write the runs here instead of a temporary folder")
    p.add_argument("--one-launch", action="store_true",
                   help="train both contestants in turn in one launch (the smoke test's: saves a launch's imports; "
                   "VmHWM is reset before each one's steady steps)")  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)  # comma-separated contestants, set by launch()
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}), which must be >= 1")
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        model = work / f"llama-{args.shape}"
        if not (model / "config.json").exists():
            build_model(model, args.shape)
        if args.one_launch:
            runs = launch(list(CONTESTANTS), model, work / "run", args)
        else:
            runs = {n: launch([n], model, work / f"run-{n}", args)[n] for n in CONTESTANTS}
    result = summarize(runs)
    result["workload"] = {"shape": args.shape, **SHAPES[args.shape], "seq": args.seq, "batch": args.batch,
                          "ranks": 2, "steps": args.steps, "warmup": args.warmup, "lora_r": 16,
                          "one_launch": args.one_launch}  # fmt: skip
    print_table(result)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
