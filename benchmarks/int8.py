"""8-bit LoRA under FSDP2 on CPU: per-rank parameter bytes and step time of an 8-bit base on 2 ranks, against the
same model in one process and against a 4-bit (NF4) base on 2 ranks.

    python benchmarks/int8.py [--hidden 512 --layers 4 --steps 8]   # ~10 min on a CPU without avx512_bf16

Each contestant is one launch of the worker below (``accelerate launch`` with cpu_fsdp2_rehearsal.yaml for the 2-rank
ones, plain ``python`` for the single process): ``load_qlora_model(bits=...)`` then ``FSDPQLoRATrainer``. Reported per
rank: the base's quantized weight bytes this rank holds (FSDP2 local shards) and in all, every parameter's bytes, and
the median step time after warm-up. A 2-rank contestant that did not shard is refused. CPU step times show the
route's overhead, not GPU speed (bf16 matmuls are emulated on CPUs without avx512_bf16/amx: see FACTS).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import _launch  # benchmarks/, this script's folder, is first on sys.path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time, torch
import hf_fsdp_qlora
from hf_fsdp_qlora import FSDPQLoRATrainer, load_qlora_model
from peft import LoraConfig
from transformers import TrainerCallback, TrainingArguments
path, outs, bitss, steps = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4])
lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
def run(out, bits):
    model = load_qlora_model(path, bits=bits, lora_config=lora, gradient_checkpointing=False)
    found = {"step_s": []}
    class Measure(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            base = [p for n, p in model.named_parameters() if n.endswith("base_layer.weight")]
            local = lambda p: (p.to_local() if hasattr(p, "to_local") else p)
            found["base_local"] = sum(local(p).numel() * p.element_size() for p in base)
            found["base_full"] = sum(p.numel() * p.element_size() for p in base)
            found["base_sharded"] = sum(type(p).__name__ == "DTensor" for p in base)
            found["params_local"] = sum(local(p).numel() * p.element_size() for p in model.parameters())
        def on_step_begin(self, *a, **kw):
            self.t = time.perf_counter()
        def on_step_end(self, *a, **kw):
            found["step_s"].append(time.perf_counter() - self.t)
    ids = torch.randint(3, 1000, (16, 128), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r, "attention_mask": torch.ones_like(r)} for r in ids]
    args = TrainingArguments(output_dir=out + "-o", max_steps=steps, per_device_train_batch_size=int(sys.argv[5]),
                             report_to=[], save_strategy="no", use_cpu=True, learning_rate=1e-4)
    trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=data, callbacks=[Measure()])
    found["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    open(f"{out}-rank{rank}.json", "w").write(json.dumps(found))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
for out, bits in zip(outs, bitss):  # contestants in turn (--one-launch); one by default
    run(out, int(bits))
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # a gloo job left without it aborts at exit about one run in four
"""

# name: (bits, ranks)
CONTESTANTS = {"int8_fsdp2": (8, 2), "int8_single": (8, 1), "nf4_fsdp2": (4, 2)}


def build_model(path: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=256)  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(names: list[str], model: Path, work: Path, args) -> dict[str, list[dict]]:
    """One launch training the contestants `names` (same rank count) in turn; every rank's findings per contestant."""
    ranks = CONTESTANTS[names[0]][1]
    worker = work / "worker.py"
    worker.write_text(WORKER)
    outs, bits = ",".join(str(work / n) for n in names), ",".join(str(CONTESTANTS[n][0]) for n in names)
    # 2 ranks x batch b and 1 process x batch 2b: the same global batch.
    tail = [str(worker), str(model), outs, bits, str(args.steps), str(args.batch * (3 - ranks))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("ACCELERATE_USE_FSDP", None)
    if ranks == 1:
        cmd = [sys.executable, *tail]
    else:
        config = ROOT / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config),
               "--num_processes", str(ranks), "--main_process_port", str(_free_port()), *tail]  # fmt: skip
    proc = _launch.run(cmd, env, args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{names} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    runs = {n: [json.loads((work / f"{n}-rank{r}.json").read_text()) for r in range(ranks)] for n in names}
    for name, found in runs.items():
        if ranks > 1 and not all(f["distributed_type"].endswith("FSDP") and f["base_sharded"] for f in found):
            raise SystemExit(f"{name} did not shard its base under FSDP2: {found[0]}")
    return runs


def summarize(name: str, found: list[dict], warmup: int) -> dict:
    steps = [statistics.median(f["step_s"][warmup:] or f["step_s"]) for f in found]
    return {
        "ranks": len(found),
        "base_bytes_per_rank": max(f["base_local"] for f in found),
        "base_bytes_total": found[0]["base_full"],
        "param_bytes_per_rank": max(f["params_local"] for f in found),
        "step_s": max(steps),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per launch, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (one process: twice that)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    p.add_argument("--one-launch", action="store_true",
                   help="the 2-rank contestants in turn in one launch (the smoke test's: saves a launch's imports)")  # fmt: skip
    args = p.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_model(work / "model", args.hidden, args.layers)
        groups = [[n for n in CONTESTANTS if CONTESTANTS[n][1] == r] for r in (2, 1)] if args.one_launch else None
        runs = {}
        for names in groups or [[n] for n in CONTESTANTS]:
            runs.update(launch(names, model, work, args))
        for name in CONTESTANTS:
            rows[name] = summarize(name, runs[name], args.warmup)
    single = rows["int8_single"]
    print(f"{'contestant':<12} {'ranks':>5} {'base MB/rank':>13} {'base MB all':>12} {'params MB/rank':>15} "
          f"{'step s':>8} {'step vs 1 proc':>15}")  # fmt: skip
    for name, row in rows.items():
        row["base_share"] = row["base_bytes_per_rank"] / row["base_bytes_total"]
        row["step_vs_single"] = row["step_s"] / single["step_s"]
        print(f"{name:<12} {row['ranks']:>5} {row['base_bytes_per_rank'] / 2**20:>13.2f} "
              f"{row['base_bytes_total'] / 2**20:>12.2f} {row['param_bytes_per_rank'] / 2**20:>15.2f} "
              f"{row['step_s']:>8.3f} {row['step_vs_single']:>14.2f}x")  # fmt: skip
    print(
        f"int8 per rank vs nf4 per rank: {rows['int8_fsdp2']['base_bytes_per_rank'] / rows['nf4_fsdp2']['base_bytes_per_rank']:.2f}x"
    )
    if args.json:
        print(json.dumps({"contestants": rows, "shape": {"hidden": args.hidden, "layers": args.layers}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
