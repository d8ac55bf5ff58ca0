"""Peak memory and time of the causal-LM loss, stock (full logits) against ours (hf_fsdp_qlora.train.loss), on CPU.

    python benchmarks/chunked_loss.py                      # vocab 128256, hidden 4096, 8192 tokens, 3 rounds
    python benchmarks/chunked_loss.py --hidden 256 --rounds 3
    python benchmarks/chunked_loss.py --step               # also a whole FSDP2 training step (2 ranks)

Part 1, the loss alone: LM head + cross-entropy forward and backward on ``tokens x hidden`` bf16 hidden states and a
frozen bf16 ``vocab x hidden`` head (a QLoRA run's head), every token labelled. Each contestant runs in a subprocess
of its own, rounds interleaved (stock, ours, stock, ours, ...), and the medians are printed. Peak memory is the
growth of the process's peak resident set (``ru_maxrss``) across the loss, after inputs are built: tracemalloc does
not see torch's CPU allocations and torch keeps no CPU allocator statistics, while a fresh process's peak RSS counts
every byte the loss touched. Time is wall time of forward + backward.

Part 2 (``--step``): two optimizer steps of the tiny 4-bit Llama with a 128256-token vocabulary under FSDP2 on 2 CPU
ranks (the CPU rehearsal config), ``chunked_loss`` False then True: the losses, and each rank's peak RSS.

The machine is shared and noisy: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hf_fsdp_qlora.loss_paths import DEFAULT_LOSS_CHUNK_SIZE  # torch-free


def _loss_once(kind: str, vocab: int, hidden: int, tokens: int, chunk: int) -> dict:
    import torch
    import torch.nn.functional as F

    from hf_fsdp_qlora.train.loss import head_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    h = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    shift = F.pad(labels[..., 1:], (0, 1), value=-100)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if kind == "stock":  # transformers' ForCausalLMLoss on the full logits
        logits = head(h)
        loss = F.cross_entropy(logits.float().flatten(0, 1), shift.flatten(), ignore_index=-100)
    else:
        loss, _ = head_loss(head.forward, h, shift, chunk, scale=1.0 / int(shift.ne(-100).sum()))
    loss.backward()
    seconds = time.perf_counter() - started
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB on Linux
    return {"kind": kind, "seconds": seconds, "peak_bytes": peak, "loss": float(loss), "grad_sum": float(h.grad.sum())}


def _contestant(kind, args) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--tokens", str(args.tokens), "--chunk", str(args.chunk)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, cwd=str(REPO))
    return json.loads(out.stdout.strip().splitlines()[-1])


def loss_benchmark(args) -> dict:
    runs = {"stock": [], "ours": []}
    for _ in range(args.rounds):
        for kind, results in runs.items():
            results.append(_contestant(kind, args))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "peak_bytes")} for k, v in runs.items()}
    gib = 2**30
    print(f"loss forward+backward, vocab {args.vocab}, hidden {args.hidden}, {args.tokens} tokens, bf16, frozen head, "
          f"chunk {args.chunk}, medians of {args.rounds} interleaved rounds, {args.threads} thread(s):")  # fmt: skip
    for kind, m in med.items():
        print(f"  {kind:<6} peak {m['peak_bytes'] / gib:6.2f} GiB   time {m['seconds']:7.2f} s   "
              f"loss {runs[kind][0]['loss']:.6f}")  # fmt: skip
    ratio_mem = med["stock"]["peak_bytes"] / max(1, med["ours"]["peak_bytes"])
    ratio_time = med["ours"]["seconds"] / med["stock"]["seconds"]
    print(f"  ours: {ratio_mem:.1f}x less peak memory, {ratio_time:.2f}x the time")
    return {"runs": runs, "medians": med, "memory_ratio": ratio_mem, "time_ratio": ratio_time}


def step_benchmark(args) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from dist_utils import accelerate_launch, check
    from tiny_models import tiny_config

    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        if not (model / "config.json").exists():
            import torch
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=args.vocab)).to(
                torch.bfloat16
            ).save_pretrained(model)
        for chunked in (False, True):
            out = Path(tmp) / f"out{int(chunked)}"
            proc = accelerate_launch(
                "cpu_fsdp2_rehearsal.yaml", str(REPO / "benchmarks" / "_chunked_loss_step.py"), "--model", str(model),
                "--out", str(out), "--chunked", str(int(chunked)), "--seq", str(args.step_seq), timeout=900,
            )  # fmt: skip
            check(proc)
            found[chunked] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    gib = 2**30
    print(f"FSDP2 training step, tiny Llama (hidden 64, 2 layers, 4-bit + LoRA), vocab {args.vocab}, 2 ranks x batch 2 "
          f"x {args.step_seq} tokens, 2 optimizer steps:")  # fmt: skip
    for chunked, ranks in found.items():
        name = "ours " if chunked else "stock"
        peaks = ", ".join(f"{r['peak_rss'] / gib:.2f}" for r in ranks)
        print(f"  {name} losses {ranks[0]['losses']}  peak RSS per rank {peaks} GiB  (engaged: {ranks[0]['engaged']})")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=DEFAULT_LOSS_CHUNK_SIZE)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step", action="store_true", help="also a whole FSDP2 training step (2 ranks)")
    parser.add_argument("--step-seq", type=int, default=1024)
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--child", choices=("stock", "ours"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_loss_once(args.child, args.vocab, args.hidden, args.tokens, args.chunk)))
        return
    if not args.skip_loss:
        loss_benchmark(args)
    if args.step:
        step_benchmark(args)


if __name__ == "__main__":
    main()
