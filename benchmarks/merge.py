"""Benchmark: our streamed merge vs peft's in-memory merge_and_unload vs a plain copy of the same bytes.

Builds a random bf16 Llama-shaped model of about `--size` (default 1.5GB) in at least `--shards` safetensors
shards, and a LoRA adapter (rank 16 on every Linear of every layer, random non-zero factors), all locally.
Then each contender runs in its own subprocess, so its peak RSS (ru_maxrss of that child, from wait4) is
its own:

- copy: copy every file of the base folder and fsync it: what the disk allows for these bytes.
- peft: from_pretrained(bf16) + PeftModel.from_pretrained + merge_and_unload + save_pretrained (+ fsync).
- ours: hf_fsdp_qlora.merge_adapters (it fsyncs each shard before publishing the folder).

Goals: our peak RSS <= 0.35x peft's; our time <= peft's and <= 2x the copy's.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/merge.py              # full size, ~1.5 GB
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/merge.py --size 150MB # quick
    .venv/bin/python benchmarks/merge.py --device cuda                   # ours on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS = ("copy", "peft", "ours")


def _config_for(size: int):
    """A Llama config of about `size` bytes in bf16 (untied embeddings, GQA 4:1)."""
    from transformers import LlamaConfig

    hidden = 2048 if size >= 10**9 else 1024 if size >= 2 * 10**8 else 512
    inter, vocab, kv = int(hidden * 2.75) // 64 * 64, 32000, hidden // 4
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden)
    embeddings = 2 * 2 * vocab * hidden
    layers = max(2, round((size - embeddings) / per_layer))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 512,
        tie_word_embeddings=False,
    )


def build(base: Path, adapter: Path, size: int, shards: int) -> None:
    """Write the random base (bf16, >= `shards` shards) and a rank-16 LoRA adapter over all its Linear layers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config_for(size)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(base, max_shard_size=max(nbytes // shards - 10**6, 10**6))
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.02)
    peft_model.save_pretrained(adapter)


def _fsync_tree(path: Path) -> None:
    for file in sorted(path.iterdir()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def child(which: str, base: Path, adapter: Path, output: Path, shard: str, device: str = "cpu") -> None:
    """Run one contender in this process and print its timings as JSON."""
    start = time.perf_counter()
    if which == "copy":
        imported = time.perf_counter()
        output.mkdir()
        for file in sorted(base.iterdir()):
            shutil.copyfile(file, output / file.name)
        _fsync_tree(output)
    elif which == "peft":
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        imported = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.save_pretrained(output, max_shard_size=shard)
        _fsync_tree(output)
    else:
        from hf_fsdp_qlora.merge.pipeline import merge_adapters

        imported = time.perf_counter()
        merge_adapters(base, adapter, output, max_shard_size=shard, progress=False, device=device)
    done = time.perf_counter()
    print(json.dumps({"import_s": imported - start, "work_s": done - imported}))


def measure(which: str, base: Path, adapter: Path, output: Path, shard: str, device: str = "cpu") -> dict:
    """Run `which` in a fresh interpreter; its own peak RSS comes from wait4 on that child alone.

    This process imports nothing heavy: ru_maxrss of a child counts the image it was forked from.
    """
    shutil.rmtree(output, ignore_errors=True)
    cmd = [sys.executable, __file__, "--_child", which, "--_base", str(base), "--_adapter", str(adapter)]
    cmd += ["--_output", str(output), "--_shard", shard, "--device", device]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{which} failed ({proc.returncode}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    written = sum(f.stat().st_size for f in output.iterdir())
    shutil.rmtree(output, ignore_errors=True)
    return {"rss_mb": usage.ru_maxrss / 1024, "wall_s": wall, "written_gb": written / 1e9, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.5GB", help="approximate base model size in bf16 (default: 1.5GB)")
    parser.add_argument("--shards", type=int, default=4, help="minimum number of base shards (default: 4)")
    parser.add_argument("--workdir", default=None, help="where to build and write (default: a temp folder, removed)")
    parser.add_argument("--device", default="cpu", help="where ours computes: cpu (default) or cuda")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all three contenders; the median is reported")
    parser.add_argument("--_child", choices=CONTENDERS + ("build",), help=argparse.SUPPRESS)
    parser.add_argument("--_base", help=argparse.SUPPRESS)
    parser.add_argument("--_adapter", help=argparse.SUPPRESS)
    parser.add_argument("--_output", help=argparse.SUPPRESS)
    parser.add_argument("--_shard", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child == "build":
        from hf_fsdp_qlora.safetensors_io import parse_shard_size

        build(Path(args._base), Path(args._adapter), parse_shard_size(args.size), args.shards)
        return 0
    if args._child:
        child(args._child, Path(args._base), Path(args._adapter), Path(args._output), args._shard, args.device)
        return 0

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="merge-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base, adapter = workdir / "base", workdir / "adapter"
    try:
        if not (base / "config.json").exists():
            started = time.perf_counter()
            # In a child: this process must stay small, since a child's ru_maxrss includes the parent
            # image it was forked from (before exec).
            cmd = [sys.executable, __file__, "--_child", "build", "--_base", str(base), "--_adapter", str(adapter)]
            subprocess.run(cmd + ["--size", args.size, "--shards", str(args.shards)], check=True)
            print(f"built base + adapter in {time.perf_counter() - started:.1f} s")
        shard_files = sorted(base.glob("*.safetensors"))
        base_gb = sum(f.stat().st_size for f in shard_files) / 1e9
        shard = f"{int(base_gb * 1e9 / len(shard_files) / 1e6) + 1}MB"  # same shard size as the base
        print(
            f"base: {base_gb:.2f} GB in {len(shard_files)} shards; output shards up to {shard}; CPUs: {os.cpu_count()}; "
            f"ours on {args.device}"
        )
        # Interleaved (copy, peft, ours, copy, ...): the disk's state drifts between runs, so each round
        # gives all three the same conditions; the median round of each is reported.
        runs = {which: [] for which in CONTENDERS}
        for round_ in range(args.repeat):
            for which in CONTENDERS:
                runs[which].append(measure(which, base, adapter, workdir / f"out-{which}", shard, args.device))
            if args.repeat > 1:
                print(f"round {round_ + 1}: " + ", ".join(f"{w} {r[-1]['work_s']:.2f} s" for w, r in runs.items()))
        results = {}
        for which, done in runs.items():
            median = sorted(done, key=lambda r: r["wall_s"])[len(done) // 2]
            results[which] = {**median, "rss_mb": max(r["rss_mb"] for r in done)}
        _report(results)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _report(results: dict) -> None:
    print(f"\n{'':6} {'peak RSS MB':>12} {'wall s':>8} {'work s':>8} {'import s':>9} {'written GB':>11}")
    for which, r in results.items():
        print(
            f"{which:6} {r['rss_mb']:12.0f} {r['wall_s']:8.2f} {r['work_s']:8.2f} {r['import_s']:9.2f} {r['written_gb']:11.2f}"
        )
    ours, peft, copy = results["ours"], results["peft"], results["copy"]
    rows = [
        ("peak RSS ours / peft", ours["rss_mb"] / peft["rss_mb"], "<= 0.35"),
        ("wall ours / peft", ours["wall_s"] / peft["wall_s"], "<= 1"),
        ("wall ours / copy", ours["wall_s"] / copy["wall_s"], "<= 2"),
        ("work ours / peft", ours["work_s"] / peft["work_s"], "<= 1"),
        ("work ours / copy", ours["work_s"] / copy["work_s"], "<= 2"),
    ]
    print()
    for name, value, goal in rows:
        limit = float(goal.split()[-1])
        print(f"{name:22} {value:6.2f}   goal {goal:8} {'met' if value <= limit else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
