"""Training throughput and peak memory of ours against the recipes users would pick instead.

    python benchmarks/throughput.py                      # moderate CPU shape, 2 gloo ranks, 3 rounds
    python benchmarks/throughput.py --shape tiny --rounds 1 --steps 2 --warmup 1 --seq 16 --batch 1 --one-launch --json   # the CI smoke form
    python benchmarks/throughput.py --packed             # variable-length examples packed with position_ids
    python benchmarks/throughput.py --shape llama3-8b --device cuda   # one GPU (not run on CPU machines)

Every contestant trains the same workload: a Llama-shaped causal LM built locally from a config (random
weights, saved to a temporary folder; nothing downloaded), NF4 with double quantization, bf16, LoRA r=16 on
all linear layers, activation checkpointing, the same sequence length, per-device batch and data. Contestants:

    ours         load_qlora_model + FSDPQLoRATrainer under FSDP2 (accelerate launch, cpu_fsdp2_rehearsal.yaml)
    stock        BitsAndBytesConfig + prepare_model_for_kbit_training + get_peft_model + transformers.Trainer,
                 no FSDP (DDP over gloo on CPU ranks, torchrun)
    accel_fsdp2  the stock Trainer under accelerate's FSDP2 plugin (same accelerate config as ours). On CPU
                 accelerate runs FSDP only with our rehearsal hook installed (enable_cpu_fsdp); nothing else
                 of ours is used.
    ours_ddp     ours launched like `stock` (DDP, no FSDP): same engine as `stock`, so ours_ddp / stock is the
                 cost of our loader, callbacks and checks alone, without FSDP2's per-layer all-gathers.

Each contestant is its own launch of benchmarks/_throughput_worker.py (--one-launch, the smoke's form: the FSDP2
ones share one); rounds interleave the contestants (the order rotates each round) so machine noise falls on all
of them alike. Tokens per second are global (every
rank's tokens) over the steps after the warm-up; peak memory is per rank: peak RSS during those steps on CPU
(VmHWM reset at the end of warm-up), CUDA max allocated on GPU. Figures are medians over rounds. All
contestants run the same bitsandbytes CPU kernel path (the in-place repack for AVX512-BF16 is off on every
4-bit layer; see the worker). Goal on CPU: ours >= 0.98x the stock recipe's tokens per second.
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
from importlib import metadata
from pathlib import Path

import _launch  # benchmarks/, this script's folder, is first on sys.path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_throughput_worker.py"
CONTESTANTS = ("ours", "stock", "accel_fsdp2", "ours_ddp")
PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes")

# Llama shapes (LlamaConfig fields). "cpu": 20.2M parameters, minutes on 2 cores; "llama3-8b": Llama 3 8B.
SHAPES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256},
    "cpu": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": 8192},
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0},
}  # fmt: skip
DEFAULTS = {"tiny": (32, 2), "cpu": (256, 2), "llama3-8b": (2048, 1)}  # shape -> (seq, per-device batch)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: Path, shape: str, seq: int) -> int:
    """Save a random Llama of `shape` in bf16 to `path`; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(seq, 256))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def launch(contestant: str, model: Path, out: Path, args) -> dict[str, list[dict]]:
    """One launch of the worker for `contestant` (or several of the same launch kind, comma-separated, trained in
    turn); returns every rank's findings per contestant."""
    bin_dir = Path(sys.executable).parent
    shutil.rmtree(out, ignore_errors=True)  # a failed launch must not be read from an earlier run's files
    worker_args = [
        str(WORKER), "--contestant", contestant, "--model", str(model), "--out", str(out), "--seq", str(args.seq),
        "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--lora-r", str(args.lora_r), "--device", args.device, *(["--packed"] if args.packed else []),
        *(["--no-bf16"] if args.no_bf16 else []), *(["--profile"] if args.profile else []),
    ]  # fmt: skip
    if contestant.split(",")[0] in ("stock", "ours_ddp"):
        if args.device == "cuda" and args.nproc == 1:
            cmd = [sys.executable, *worker_args]  # the single-GPU user's plain `python train.py`
        else:  # torchrun + TrainingArguments(use_cpu=True): accelerate picks DDP over gloo on CPU
            cmd = [str(bin_dir / "torchrun"), f"--nproc-per-node={args.nproc}", "--master-addr=127.0.0.1",
                   f"--master-port={_port()}", *worker_args]  # fmt: skip
    else:
        config = args.accelerate_config or (
            ROOT / "accelerate_configs" / ("cpu_fsdp2_rehearsal.yaml" if args.device == "cpu" else "fsdp2_qlora.yaml")
        )
        cmd = [str(bin_dir / "accelerate"), "launch", "--config_file", str(config), "--num_processes",
               str(args.nproc), "--main_process_port", str(_port()), *worker_args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_FSDP", None)
    proc = _launch.run(cmd, env, args.timeout)
    names = contestant.split(",")
    folders = {name: out / name if len(names) > 1 else out for name in names}  # the worker's layout for several
    ranks = {name: [folder / f"rank{r}.json" for r in range(args.nproc)] for name, folder in folders.items()}
    if proc.returncode != 0 or not all(p.exists() for paths in ranks.values() for p in paths):
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        raise RuntimeError(f"contestant {contestant!r} failed (exit {proc.returncode}):\n{tail}")
    return {name: [json.loads(p.read_text()) for p in paths] for name, paths in ranks.items()}


def launch_groups(order: list[str], one_launch: bool) -> list[list[str]]:
    """Each contestant its own launch; with `one_launch` the FSDP2 ones (same `accelerate launch`) share one,
    accel_fsdp2 first so that it trains before anything of ours but the rehearsal hook has run in the process."""
    if not one_launch:
        return [[name] for name in order]
    fsdp = sorted((n for n in order if n in ("ours", "accel_fsdp2")), key=lambda n: n != "accel_fsdp2")
    return [fsdp] + [[n] for n in order if n not in fsdp]


def check_engaged(contestant: str, ranks: list[dict], args) -> None:
    """A green launch proves nothing: the FSDP contestants must have sharded, the stock one must be DDP."""
    first = ranks[0]
    problems = []
    if len(ranks) != args.nproc or any(r["world"] != args.nproc for r in ranks):
        problems.append(f"expected {args.nproc} ranks, got worlds {[r['world'] for r in ranks]}")
    if contestant in ("stock", "ours_ddp"):
        if args.nproc > 1 and first["fsdp2_modules"]:
            problems.append("FSDP engaged in the no-FSDP recipe")
        if args.nproc > 1 and "MULTI" not in first["distributed_type"]:
            problems.append(f"expected DDP, distributed type is {first['distributed_type']}")
    elif "FSDP" not in first["distributed_type"] or not first["fsdp2_modules"] or not first["dtensor_params"]:
        problems.append(f"FSDP2 did not engage ({first['distributed_type']}, {first['fsdp2_modules']} FSDP modules)")
    if not all(r["repack_off"] for r in ranks):
        problems.append("a 4-bit layer kept bitsandbytes' CPU repack on (different kernel path)")
    if problems:
        raise RuntimeError(f"contestant {contestant!r}: " + "; ".join(problems))


def memory_of(rank: dict, device: str) -> int:
    if device == "cuda":
        return rank["cuda_max_allocated"]
    return rank.get("peak_rss_train", rank["peak_rss"])


def summarize(runs: dict[str, list[list[dict]]], args) -> dict:
    """Medians over rounds per contestant and each ratio to ours."""
    rows = {}
    for name, rounds in runs.items():
        rows[name] = {
            "tokens_per_s": statistics.median(r[0]["tokens_per_s"] for r in rounds),
            "tokens_per_s_rounds": [round(r[0]["tokens_per_s"], 1) for r in rounds],
            # every rank's tokens over every rank's CPU seconds: steadier than wall time on a shared machine
            "tokens_per_cpu_s": statistics.median(
                sum(x["tokens_per_cpu_s"] * x["cpu_s"] for x in r) / sum(x["cpu_s"] for x in r) for r in rounds
            ),
            "peak_memory_per_rank": statistics.median(max(memory_of(x, args.device) for x in r) for r in rounds),
            "peak_rss_with_load_per_rank": statistics.median(max(x["peak_rss"] for x in r) for r in rounds),
            "distributed_type": rounds[0][0]["distributed_type"],
            "fsdp2_modules": rounds[0][0]["fsdp2_modules"],
            "load_s": statistics.median(r[0]["load_s"] for r in rounds),
        }
    ours = rows["ours"]
    for row in rows.values():
        row["tokens_per_s_vs_ours"] = row["tokens_per_s"] / ours["tokens_per_s"]
        row["tokens_per_cpu_s_vs_ours"] = row["tokens_per_cpu_s"] / ours["tokens_per_cpu_s"]
        row["memory_vs_ours"] = row["peak_memory_per_rank"] / ours["peak_memory_per_rank"]
    return rows


def print_table(result: dict) -> None:
    mib = 2**20
    memory = "CUDA max allocated" if result["device"] == "cuda" else "peak RSS, train"
    w = result["workload"]
    print(f"\nworkload: {w['shape']} Llama ({w['parameters'] / 1e6:.1f}M parameters), seq {w['seq']}, per-device "
          f"batch {w['batch']}, {w['ranks']} rank(s) on {result['device']}, {w['steps']} steps ({w['warmup']} "
          f"warm-up), LoRA r={w['lora_r']} all-linear, NF4 + double quant, bf16, "
          f"{'packed' if w['packed'] else 'fixed-length'} data, {result['rounds']} round(s), medians")  # fmt: skip
    print(f"{'contestant':<13}{'tokens/s':>10}{'vs ours':>9}{'tok/CPU-s':>11}{'vs ours':>9}"
          f"{memory + ' MiB/rank':>29}{'vs ours':>9}{'with load':>11}  engine")  # fmt: skip
    for name, row in result["contestants"].items():
        engine = row["distributed_type"] + (f" ({row['fsdp2_modules']} FSDP2 modules)" if row["fsdp2_modules"] else "")
        print(
            f"{name:<13}{row['tokens_per_s']:>10.1f}{row['tokens_per_s_vs_ours']:>8.3f}x"
            f"{row['tokens_per_cpu_s']:>11.1f}{row['tokens_per_cpu_s_vs_ours']:>8.3f}x"
            f"{row['peak_memory_per_rank'] / mib:>29.0f}{row['memory_vs_ours']:>8.3f}x"
            f"{row['peak_rss_with_load_per_rank'] / mib:>11.0f}  {engine}  rounds {row['tokens_per_s_rounds']}"
        )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    for note in result["notes"]:
        print("note: " + note)
    if result.get("goal"):
        print("goal: " + result["goal"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help="comma-separated, must include ours")
    p.add_argument("--seq", type=int, help="sequence length (default: per shape)")
    p.add_argument("--batch", type=int, help="per-device batch size (default: per shape)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per launch, warm-up included")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--nproc", type=int, help="ranks (default: 2 on CPU, 1 on GPU)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--packed", action="store_true", help="pack variable-length examples (hf_fsdp_qlora.data)")
    p.add_argument("--no-bf16", action="store_true", help="TrainingArguments(bf16=False) for all: no autocast")
    p.add_argument(
        "--accelerate-config",
        help="accelerate config for the FSDP contestants (default: the shipped one "
        "for --device, e.g. to try fsdp_reshard_after_forward: false)",
    )
    p.add_argument("--profile", action="store_true", help="write each rank's torch.profiler top ops (needs --keep)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="print the result as JSON after the table")
    p.add_argument("--one-launch", action="store_true",
                   help="train the FSDP2 contestants in turn in one launch (the smoke test's: saves a launch's "
                   "imports; not for timing, since the second shares the first's process)")  # fmt: skip
    p.add_argument("--keep", help="build the model and write runs here instead of a temporary folder")
    args = p.parse_args(argv)
    names = [c for c in args.contestants.split(",") if c]
    if "ours" not in names or any(c not in CONTESTANTS for c in names):
        p.error(f"--contestants must include 'ours' and only name {', '.join(CONTESTANTS)}; got {args.contestants!r}")
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}), which must be >= 1")
    if args.profile and not args.keep:
        p.error("--profile writes profile-rank<R>.txt into each launch's folder: add --keep DIR to keep them")
    seq, batch = DEFAULTS[args.shape]
    args.seq, args.batch = args.seq or seq, args.batch or batch
    args.nproc = args.nproc or (2 if args.device == "cpu" else 1)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        model = work / f"model-{args.shape}"
        if (model / "config.json").exists():
            from transformers import AutoConfig

            params = json.loads((model / "params.json").read_text())["parameters"]
            AutoConfig.from_pretrained(model)  # a broken folder fails here, not in every worker
        else:
            params = build_model(model, args.shape, args.seq)
            (model / "params.json").write_text(json.dumps({"parameters": params}))
        runs = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no contestant always goes first
            for group in launch_groups(order, args.one_launch):
                for name, ranks in launch(",".join(group), model, work / f"round{r}-{'-'.join(group)}", args).items():
                    check_engaged(name, ranks, args)
                    runs[name].append(ranks)
                    print(f"round {r + 1}/{args.rounds} {name}: {ranks[0]['tokens_per_s']:.1f} tokens/s", flush=True)
    rows = summarize(runs, args)
    notes = ["torchtune's QLoRA recipe is a GPU contestant and is not run by this benchmark yet"]
    if args.device == "cpu" and "accel_fsdp2" in names:
        notes.append(
            "accel_fsdp2 on CPU: accelerate 1.15 never runs FSDP on CPU by itself (it falls back to DDP); "
            "this run installs hf_fsdp_qlora's rehearsal hook (enable_cpu_fsdp) and nothing else of ours"
        )
    if args.device == "cpu":
        notes.append(
            "every contestant has bitsandbytes' AVX512-BF16 CPU repack off on every 4-bit layer "
            "(Linear4bit.support_avx512bf16_for_cpu = False): one kernel path for all"
        )
    result = {
        "device": args.device,
        "rounds": args.rounds,
        "workload": {"shape": args.shape, "parameters": params, "seq": args.seq, "batch": args.batch,
                     "ranks": args.nproc, "steps": args.steps, "warmup": args.warmup, "lora_r": args.lora_r,
                     "packed": args.packed, "threads_per_rank": args.threads, "one_launch": args.one_launch,
                     **SHAPES[args.shape]},
        "versions": {k: metadata.version(k) for k in PACKAGES},
        "contestants": rows,
        "notes": notes,
    }  # fmt: skip
    if "stock" in rows and args.device == "cpu":
        stock = rows["stock"]["tokens_per_s"]
        verdicts = [(f"ours (FSDP2) {rows['ours']['tokens_per_s'] / stock:.3f}x "
                    f"{'met' if rows['ours']['tokens_per_s'] >= 0.98 * stock else 'MISSED'}")]  # fmt: skip
        if "ours_ddp" in rows:  # the same engine as stock: what our own code costs
            ratio = rows["ours_ddp"]["tokens_per_s"] / stock
            verdicts.append(f"ours_ddp (DDP, like stock) {ratio:.3f}x {'met' if ratio >= 0.98 else 'MISSED'}")
        result["goal"] = "ours >= 0.98x the stock recipe's tokens/s on CPU: " + "; ".join(verdicts)
    print_table(result)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
