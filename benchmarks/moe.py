"""Mixture of experts: per-rank bytes, peak RSS and step time of 4-bit experts against the stock 4-bit load.

    python benchmarks/moe.py                          # Qwen3-MoE "cpu" shape, 2 gloo ranks, FSDP2, ~2 minutes
    python benchmarks/moe.py --shape small --steps 2 --warmup 1 --seq 16 --batch 1 --one-launch --json   # the CI smoke form (tests/test_moe_benchmark.py)
    python benchmarks/moe.py --profile                # adds each rank's share of time in the experts' dequantization
    python benchmarks/moe.py --layer [--tokens 2048]  # one layer's experts, one process: grouped vs loop vs stock
                                                      # time and operator calls (benchmarks/moe_layer.py)

Both contestants train the same workload under FSDP2 on 2 CPU ranks (accelerate launch with
accelerate_configs/cpu_fsdp2_rehearsal.yaml: activation checkpointing, reshard after forward): a Qwen3-MoE built
locally from a config (random weights, saved in bf16 to a temporary folder; nothing downloaded), NF4 with double
quantization, bf16, LoRA r=16 on the attention (q/k/v/o), the same data, sequence length and per-device batch.

    ours   load_qlora_model + FSDPQLoRATrainer: the linear layers AND the fused experts in 4 bits
           (hf_fsdp_qlora/experts/quantized.py, one routed expert dequantized at a time).
    stock  transformers + bitsandbytes + peft, as peft's FSDP-QLoRA guide loads: BitsAndBytesConfig(load_in_4bit,
           nf4, double quant, bnb_4bit_quant_storage=bf16) + get_peft_model, transformers.Trainer under accelerate's
           FSDP2 plugin. bitsandbytes only replaces nn.Linear, so the experts stay bf16 (transformers' default
           experts implementation). On CPU accelerate runs FSDP only with our rehearsal hook (enable_cpu_fsdp);
           nothing else of ours is used.

Measured per rank after FSDP2 wrapping: parameter bytes held (DTensor local shards; buffers such as the experts'
quantization constants count whole, since FSDP leaves buffers on every rank) and the experts' share of them; peak
RSS during the steady steps (VmHWM reset at the end of the warm-up) and including the load; step time (median of
the steady steps, wall and CPU). Goals (issue 27): expert bytes per rank >= 3.5x below stock's bf16 experts; step
time <= 1.5x stock on CPU.
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
from importlib import metadata
from pathlib import Path

import _launch  # benchmarks/, this script's folder, is first on sys.path

ROOT = Path(__file__).resolve().parents[1]
CONTESTANTS = ("ours", "stock")
PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

# Qwen3MoeConfig fields. "small": the smoke test's (bigger than tests/tiny_models.py's so the constants' share is
# realistic); "cpu": 14.4M parameters, 12.6M of them in experts (87%, Qwen3-30B-A3B has 95%).
SHAPES = {
    "small": {"hidden_size": 128, "num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512},
    "cpu": {"hidden_size": 256, "num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048},
}  # fmt: skip
DEFAULTS = {"small": (32, 2), "cpu": (128, 2)}  # shape -> (seq, per-device batch)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: Path, shape: str) -> dict:
    """Save a random Qwen3-MoE of `shape` in bf16 to `path`; returns its parameter counts."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    fields = SHAPES[shape]
    config = Qwen3MoeConfig(**fields, intermediate_size=2 * fields["hidden_size"], num_experts_per_tok=2,
                            max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    model.save_pretrained(path)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return {"parameters": sum(p.numel() for p in model.parameters()), "expert_parameters": experts}


# --- the worker: one contestant on every rank (run by `accelerate launch benchmarks/moe.py --worker NAME`) -------


def _load(name: str, model_path: str, lora_r: int):
    import torch
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=ATTENTION, task_type="CAUSAL_LM"
    )
    if name == "ours":
        from hf_fsdp_qlora import load_qlora_model

        # The accelerate config's activation checkpointing is the one applied (as for the stock contestant).
        return load_qlora_model(model_path, dtype=torch.bfloat16, lora_config=lora, gradient_checkpointing=False)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=q, dtype=torch.bfloat16)
    from bitsandbytes.nn import Linear4bit

    for m in model.modules():  # one bitsandbytes CPU kernel path for both (our loader turns the repack off too)
        if isinstance(m, Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return get_peft_model(model, lora, autocast_adapter_dtype=False)


def _tensor_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _held_bytes(model) -> dict:
    """Bytes this rank holds after wrapping: every parameter's local shard and every buffer, experts apart."""
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    expert_ids = {id(t) for m in experts for t in [*m.parameters(), *m.buffers()]}
    params, buffers = list(model.parameters()), list(model.buffers())
    held = sum(_tensor_bytes(t) for t in params + buffers)
    mine = sum(_tensor_bytes(t) for t in params + buffers if id(t) in expert_ids)
    full = sum(t.numel() * t.element_size() for t in params + buffers if id(t) in expert_ids)
    return {"held_bytes": held, "expert_bytes": mine, "expert_bytes_unsharded": full,
            "expert_classes": sorted({type(m).__name__ for m in experts}),
            "expert_dtensors": sum(type(p).__name__ == "DTensor" for m in experts for p in m.parameters()),
            "expert_dtypes": sorted({str(p.dtype) for m in experts for p in m.parameters()})}  # fmt: skip


def _vm_hwm() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def worker(args) -> None:
    """Train each contestant of --worker in turn in this launch; each rank writes OUT/NAME/rankR.json."""
    from _contestants import run_contestants  # benchmarks/, the script's own folder, is first on sys.path

    run_contestants(args.worker, train_one, args, args.out)


def train_one(name: str, args) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_fsdp_qlora  # noqa: F401  (installs the CPU rehearsal hook: accelerate runs FSDP on CPU only with it)

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    started = time.perf_counter()
    model = _load(name, args.model, args.lora_r)
    found = {"contestant": name, "rank": rank, "world": world, "load_s": time.perf_counter() - started}
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, model.config.vocab_size, (args.steps * args.batch * world, args.seq), generator=gen)
    data = [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids]
    steps, marks = [], {}

    class Measure(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            from torch.distributed.fsdp import FSDPModule

            found["fsdp2_modules"] = sum(isinstance(m, FSDPModule) for m in model.modules())
            found.update(_held_bytes(model))

        def on_step_begin(self, targs, state, control, **kw):
            marks["t"], marks["cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, targs, state, control, **kw):
            if state.global_step > args.warmup:
                steps.append((time.perf_counter() - marks["t"], time.process_time() - marks["cpu"]))
            if state.global_step == args.warmup:  # the training peak, not the load's: reset VmHWM (Linux)
                found["peak_rss_load"] = _vm_hwm()  # load and warm-up; ru_maxrss is reset with VmHWM, so keep it here
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                if args.profile:
                    marks["profiler"] = torch.profiler.profile()
                    marks["profiler"].__enter__()
            if state.global_step == args.steps:
                found["peak_rss_train"] = _vm_hwm()
                if "profiler" in marks:
                    marks["profiler"].__exit__(None, None, None)
                    ops = marks.pop("profiler").key_averages()
                    total = sum(op.self_cpu_time_total for op in ops)
                    share = lambda key: sum(op.self_cpu_time_total for op in ops if key in op.key) / total
                    found["profile"] = {"dequantize": share("bitsandbytes::dequantize"), "matmul": share("aten::mm")}

    targs = TrainingArguments(output_dir=str(Path(args.out) / "trainer"), max_steps=args.steps, learning_rate=1e-4,
                              per_device_train_batch_size=args.batch, report_to=[], save_strategy="no", seed=0,
                              bf16=True, use_cpu=True, disable_tqdm=True, logging_steps=args.steps,
                              remove_unused_columns=False)  # fmt: skip
    if name == "ours":
        from hf_fsdp_qlora import FSDPQLoRATrainer as trainer_cls
    else:
        trainer_cls = Trainer
    trainer = trainer_cls(model=model, args=targs, train_dataset=data, callbacks=[Measure()])
    found["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    trainer.train()
    found["step_s"] = statistics.median(s for s, _ in steps)
    found["step_cpu_s"] = statistics.median(c for _, c in steps)
    found["steps_s"] = [round(s, 3) for s, _ in steps]
    found["peak_rss"] = max(found["peak_rss_load"], found["peak_rss_train"])
    return found


# --- the driver -------------------------------------------------------------------------------------------------


def launch(names: list[str], model: Path, out: Path, args) -> dict[str, list[dict]]:
    """One launch training the contestants `names` in turn; returns every rank's findings per contestant."""
    shutil.rmtree(out, ignore_errors=True)  # never read an earlier run's files
    name = ",".join(names)
    config = ROOT / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), "--num_processes",
           str(args.nproc), "--main_process_port", str(_port()), str(Path(__file__).resolve()), "--worker", name,
           "--model", str(model), "--out", str(out), "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--lora-r", str(args.lora_r),
           *(["--profile"] if args.profile else [])]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_FSDP", None)
    proc = _launch.run(cmd, env, args.timeout)
    ranks = {n: [out / n / f"rank{r}.json" for r in range(args.nproc)] for n in names}
    if proc.returncode != 0 or not all(p.exists() for n in names for p in ranks[n]):
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        raise RuntimeError(f"contestant(s) {name!r} failed (exit {proc.returncode}):\n{tail}")
    return {n: [json.loads(p.read_text()) for p in ranks[n]] for n in names}


def check_engaged(name: str, ranks: list[dict], nproc: int) -> None:
    """A green launch proves nothing: FSDP2 sharded the experts, and each contestant's experts are what it claims."""
    first, problems = ranks[0], []
    if any(r["world"] != nproc for r in ranks):
        problems.append(f"expected {nproc} ranks, got worlds {[r['world'] for r in ranks]}")
    if "FSDP" not in first["distributed_type"] or not first["fsdp2_modules"] or not first["expert_dtensors"]:
        problems.append(f"FSDP2 did not shard the experts ({first['distributed_type']}, {first['expert_dtensors']})")
    if name == "ours" and first["expert_classes"] != ["QuantizedExperts"]:
        problems.append(f"experts are {first['expert_classes']}, not 4-bit QuantizedExperts")
    if name == "stock" and (
        first["expert_classes"] != ["Qwen3MoeExperts"] or first["expert_dtypes"] != ["torch.bfloat16"]
    ):
        problems.append(
            f"stock experts are {first['expert_classes']} {first['expert_dtypes']}, not bf16 Qwen3MoeExperts"
        )
    if problems:
        raise RuntimeError(f"contestant {name!r}: " + "; ".join(problems))


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per contestant the worst rank's bytes and memory, rank 0's step time; ratios of stock to ours."""
    rows = {}
    for name, ranks in runs.items():
        rows[name] = {
            "held_bytes_per_rank": max(r["held_bytes"] for r in ranks),
            "expert_bytes_per_rank": max(r["expert_bytes"] for r in ranks),
            "expert_bytes_unsharded": ranks[0]["expert_bytes_unsharded"],
            "peak_rss_train_per_rank": max(r["peak_rss_train"] for r in ranks),
            "peak_rss_with_load_per_rank": max(r["peak_rss"] for r in ranks),
            "step_s": max(r["step_s"] for r in ranks),  # a step ends when the slower rank's collectives do
            "step_cpu_s": statistics.mean(r["step_cpu_s"] for r in ranks),
            "steps_s": ranks[0]["steps_s"],
            "load_s": max(r["load_s"] for r in ranks),
            "distributed_type": ranks[0]["distributed_type"],
            "fsdp2_modules": ranks[0]["fsdp2_modules"],
            "expert_classes": ranks[0]["expert_classes"],
            **({"profile": [r["profile"] for r in ranks]} if "profile" in ranks[0] else {}),
        }
    ours, stock = rows["ours"], rows["stock"]
    ratios = {  # > 1: ours holds less / is faster
        "expert_bytes_per_rank": stock["expert_bytes_per_rank"] / ours["expert_bytes_per_rank"],
        "expert_bytes_unsharded": stock["expert_bytes_unsharded"] / ours["expert_bytes_unsharded"],
        "held_bytes_per_rank": stock["held_bytes_per_rank"] / ours["held_bytes_per_rank"],
        "peak_rss_train_per_rank": stock["peak_rss_train_per_rank"] / ours["peak_rss_train_per_rank"],
        "step_time_ours_over_stock": ours["step_s"] / stock["step_s"],
        "step_cpu_ours_over_stock": ours["step_cpu_s"] / stock["step_cpu_s"],
    }
    return {"contestants": rows, "ratios": ratios}


def print_table(result: dict) -> None:
    mib, w, r = 2**20, result["workload"], result["ratios"]
    print(f"\nworkload: Qwen3-MoE '{w['shape']}' ({w['parameters'] / 1e6:.1f}M parameters, "
          f"{w['expert_parameters'] / 1e6:.1f}M in {w['num_experts']} experts x {w['num_hidden_layers']} layers, "
          f"top-2), seq {w['seq']}, per-device batch {w['batch']}, {w['ranks']} ranks FSDP2 on CPU, {w['steps']} steps "
          f"({w['warmup']} warm-up), LoRA r={w['lora_r']} on attention, NF4 + double quant, bf16")  # fmt: skip
    print(f"{'contestant':<11}{'experts':>18}{'expert MiB/rank':>17}{'all params MiB/rank':>21}"
          f"{'peak RSS train MiB':>20}{'with load':>11}{'step s':>9}{'step CPU-s':>12}  steps (s)")  # fmt: skip
    for name, row in result["contestants"].items():
        print(f"{name:<11}{'/'.join(row['expert_classes']):>18}{row['expert_bytes_per_rank'] / mib:>17.2f}"
              f"{row['held_bytes_per_rank'] / mib:>21.2f}{row['peak_rss_train_per_rank'] / mib:>20.0f}"
              f"{row['peak_rss_with_load_per_rank'] / mib:>11.0f}{row['step_s']:>9.3f}{row['step_cpu_s']:>12.3f}"
              f"  {row['steps_s']}")  # fmt: skip
        for rank, prof in enumerate(row.get("profile", [])):
            print(f"{'':<11}profile rank {rank}: {prof['dequantize']:.1%} of CPU time in bitsandbytes dequantize, "
                  f"{prof['matmul']:.1%} in aten::mm")  # fmt: skip
    print(f"ratios: expert bytes per rank stock/ours {r['expert_bytes_per_rank']:.2f}x (unsharded "
          f"{r['expert_bytes_unsharded']:.2f}x); all parameter bytes per rank {r['held_bytes_per_rank']:.2f}x; "
          f"peak RSS train {r['peak_rss_train_per_rank']:.2f}x; step time ours/stock "
          f"{r['step_time_ours_over_stock']:.2f}x (CPU {r['step_cpu_ours_over_stock']:.2f}x)")  # fmt: skip
    print("versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    print("goal: " + result["goal"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--seq", type=int, help="sequence length (default: per shape)")
    p.add_argument("--batch", type=int, help="per-device batch size (default: per shape)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per launch, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--profile", action="store_true", help="torch.profiler over the steady steps: dequantize share")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="print the result as JSON after the table")
    p.add_argument("--keep", help="build the model and write the runs here instead of a temporary folder")
    p.add_argument("--layer", action="store_true", help="one layer's experts instead: benchmarks/moe_layer.py")
    p.add_argument("--tokens", type=int, default=2048, help="--layer: tokens per forward")
    p.add_argument("--one-launch", action="store_true",
                   help="train both contestants in turn in one launch, stock first (the smoke test's: saves a "
                   "launch's imports; VmHWM is reset before each one's steady steps)")  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)  # comma-separated contestants, set by the driver's launches
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}), which must be >= 1")
    if args.layer:
        return _layer(args)
    seq, batch = DEFAULTS[args.shape]
    args.seq, args.batch = args.seq or seq, args.batch or batch
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        model = work / f"qwen3-moe-{args.shape}"
        if not (model / "counts.json").exists():
            (model / "counts.json").parent.mkdir(parents=True, exist_ok=True)
            counts = build_model(model, args.shape)
            (model / "counts.json").write_text(json.dumps(counts))
        counts = json.loads((model / "counts.json").read_text())
        runs = launch(list(CONTESTANTS)[::-1], model, work / "run", args) if args.one_launch else {}
        for name in CONTESTANTS:
            if not args.one_launch:
                runs[name] = launch([name], model, work / f"run-{name}", args)[name]
            check_engaged(name, runs[name], args.nproc)
            print(f"{name}: step {runs[name][0]['step_s']:.3f} s", flush=True)
    result = summarize(runs)
    result["workload"] = {"shape": args.shape, **counts, **SHAPES[args.shape], "seq": args.seq, "batch": args.batch,
                          "ranks": args.nproc, "steps": args.steps, "warmup": args.warmup, "lora_r": args.lora_r,
                          "threads_per_rank": args.threads, "one_launch": args.one_launch}  # fmt: skip
    result["versions"] = {k: metadata.version(k) for k in PACKAGES}
    r = result["ratios"]
    result["goal"] = (
        f"expert bytes per rank >= 3.5x below stock's bf16 experts: {r['expert_bytes_per_rank']:.2f}x "
        f"{'met' if r['expert_bytes_per_rank'] >= 3.5 else 'MISSED'}; step time <= 1.5x stock on CPU: "
        f"{r['step_time_ours_over_stock']:.2f}x {'met' if r['step_time_ours_over_stock'] <= 1.5 else 'MISSED'} "
        f"(CPU time {r['step_cpu_ours_over_stock']:.2f}x: steadier than the wall clock on a shared machine)"
    )
    print_table(result)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


def _layer(args) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import moe_layer

    shape = {**moe_layer.SHAPE, **SMALL_LAYER} if args.shape == "small" else None
    result = moe_layer.run(args.tokens, repeats=max(1, args.steps - args.warmup), lora_r=args.lora_r,
                           threads=args.threads, shape=shape)  # fmt: skip
    result["versions"] = {k: metadata.version(k) for k in PACKAGES}
    moe_layer.print_table(result)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


SMALL_LAYER = {"hidden_size": 256, "num_experts": 16, "moe_intermediate_size": 128}  # --layer --shape small (CI)


if __name__ == "__main__":
    raise SystemExit(main())
