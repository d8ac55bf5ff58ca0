"""Per-rank activation memory and step time of long sequences: sp_size 1 vs 2, tiled MLP off vs on, side by side.

    python benchmarks/long_context.py                          # 2048 and 8192 tokens, 2 CPU ranks (gloo)
    python benchmarks/long_context.py --lengths 4096,16384 --hidden 256 --intermediate 1024

One 2-rank launch (torchrun, gloo) runs every configuration on a tiny-shaped 4-bit NF4 + LoRA Llama (2 layers, 8
heads), bf16, one sequence per rank, no activation checkpointing (so what forward keeps is what backward needs).
``sp 1``: each rank holds its whole sequence (data parallel). ``sp 2``: the two ranks share one sequence through the
Ulysses attention of hf_fsdp_qlora.train.ulysses. Figures per rank:

* ``kept MiB``: bytes autograd keeps for backward over one forward (saved-tensor hooks, each storage counted once,
  parameters excluded): the activation memory a GPU would hold at the end of forward. CPU has no allocator
  statistics, and a process's peak RSS only grows, so this is the per-rank peak activation figure here.
* ``mlp MiB``: the same, counted inside the MLPs only;
* ``step s``: median wall time of forward + backward over 3 rounds (noisy shared machine: read ratios).

FSDP is left out on purpose: it shards parameters, not activations, and the figures are activations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Kept:
    """Bytes autograd saves for backward (each storage once, parameters excluded), in total and inside MLPs."""

    def __init__(self, params):
        import torch

        self.torch, self.params = torch, {p.data_ptr() for p in params}
        self.seen, self.total, self.mlp, self.in_mlp = set(), 0, 0, 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            size = t.untyped_storage().nbytes()
            self.total += size
            self.mlp += size if self.in_mlp else 0
        return t

    def hooks(self):
        return self.torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _model(models: Path, hidden: int, intermediate: int):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_fsdp_qlora import load_qlora_model

    path = models / f"llama_{hidden}_{intermediate}"
    if not path.exists() and int(os.environ.get("RANK", "0")) == 0:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                             max_position_embeddings=65536)  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    torch.distributed.barrier()
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = load_qlora_model(str(path), lora_config=lora, gradient_checkpointing=False)
    model.train()
    return model


def _watch_mlps(model, kept: Kept) -> list:
    from hf_fsdp_qlora.train.tiled_mlp import tiled_mlp_modules

    handles = []
    for _, mlp in tiled_mlp_modules(model):
        handles.append(mlp.register_forward_pre_hook(lambda *a: setattr(kept, "in_mlp", kept.in_mlp + 1)))
        handles.append(mlp.register_forward_hook(lambda *a: setattr(kept, "in_mlp", kept.in_mlp - 1)))
    return handles


def _measure(model, length: int, sp: int, state) -> tuple[int, int, float]:
    import torch

    from hf_fsdp_qlora.train import ulysses
    from hf_fsdp_qlora.train.sequence_parallel import split_batch

    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    if sp > 1:  # both ranks share rank 0's sequence
        torch.distributed.broadcast(ids, 0)
    batch = {"input_ids": ids, "labels": ids}
    ulysses.set_active_group(state if sp > 1 else None)
    if sp > 1:
        batch, _, _ = split_batch(batch, sp, state.sp_rank)
    times, kept = [], None
    for _ in range(3):
        kept = Kept(model.parameters())
        handles = _watch_mlps(model, kept)
        torch.distributed.barrier()
        started = time.perf_counter()
        with kept.hooks():
            loss = model(**batch).loss
        loss.backward()
        torch.distributed.barrier()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
        for handle in handles:
            handle.remove()
    return kept.total, kept.mlp, statistics.median(times)


def worker(args) -> None:
    import torch.distributed as dist

    from hf_fsdp_qlora.train import ulysses
    from hf_fsdp_qlora.train.tiled_mlp import install_tiled_mlp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group, sp_rank, dp_index = ulysses.new_groups(2)
    state = ulysses.UlyssesGroup(sp_size=2, group=group, inner="sdpa", sp_rank=sp_rank, dp_index=dp_index)
    rows = []
    for tiled in (False, True):
        model = _model(Path(args.models), args.hidden, args.intermediate)
        if tiled:
            install_tiled_mlp(model, args.tile)
        for length in [int(n) for n in args.lengths.split(",")]:
            for sp in (1, 2):
                model.base_model.model.set_attn_implementation(
                    ulysses.register_ulysses_attention() if sp > 1 else "sdpa"
                )
                total, mlp, seconds = _measure(model, length, sp, state)
                rows.append((length, sp, "on" if tiled else "off", total, mlp, seconds))
    if rank == 0:
        print(f"\nper rank, rank {rank} (2 ranks, hidden {args.hidden}, intermediate {args.intermediate}, bf16, 4-bit "
              f"NF4 + LoRA r=8, tile {args.tile} tokens)")  # fmt: skip
        print(f"{'tokens':>7} {'sp':>3} {'tiled':>6} {'kept MiB':>9} {'mlp MiB':>8} {'step s':>7}")
        for length, sp, tiled, total, mlp, seconds in rows:
            print(f"{length:>7} {sp:>3} {tiled:>6} {total / 2**20:>9.1f} {mlp / 2**20:>8.1f} {seconds:>7.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--models", default=None)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    models = args.models or tempfile.mkdtemp(prefix="long_context_")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={port}", __file__, "--worker", "--models", models, "--lengths", args.lengths,
           "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--tile", str(args.tile)]  # fmt: skip
    return subprocess.run(cmd, env=env, check=True, timeout=1800).returncode


if __name__ == "__main__":
    main()
