"""Benchmark: merging the expert LoRA of one DBRX layer into its 2-D file tensors, old math vs new, in one run.

DBRX stores each layer's experts as three 2-D stacks (``mlp.w1`` / ``v1`` / ``w2``, ``[E * ffn, hidden]``); the
trained LoRA is on the fused ``gate_up_proj`` / ``down_proj`` (hf_fsdp_qlora/experts/dbrx.py). Both contestants
write the same merged tensors from the same pieces (the ``ExpertSlice`` list ``file_slices`` gives the merge), on
one thread, through the merge's own CPU path (``apply_update_into``, a block of rows at a time):

- old: one product per file tensor, a block-diagonal ``b`` ``[E * ffn, E * r]`` times the experts' ``a`` stacked
  ``[E * r, hidden]`` (what ``block_factors`` returned before): E times the arithmetic the update needs;
- new: ``block_factors`` as it is, batched factors ``[E, ffn, r]`` / ``[E, r, hidden]``, each expert's rows from its
  own factors.

The merged tensors are checked equal (bit for bit); the FLOPs are counted from the shapes (2 per multiply-add of
the factor product), for this layer and for the released DBRX (132B: 40 layers, 16 experts of width 10752, hidden
6144).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dbrx_merge.py            # E=16, ffn=1024, hidden=512, r=16
    .venv/bin/python benchmarks/dbrx_merge.py --experts 4 --ffn 256 --json  # quick
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_fsdp_qlora.experts.dbrx import block_factors
from hf_fsdp_qlora.experts.files import ExpertSlice
from hf_fsdp_qlora.merge._lora_math import LoraFactors, TensorUpdate, apply_update_into

RELEASED = {"layers": 40, "experts": 16, "ffn": 10752, "hidden": 6144}  # databricks/dbrx-base config.json


def pieces(experts: int, ffn: int) -> dict[str, list[ExpertSlice]]:
    """The pieces ``dbrx.file_slices`` gives for one layer's ``gate_up_proj`` and ``down_proj``."""
    rows = [(e * ffn, (e + 1) * ffn) for e in range(experts)]
    gate_up = [
        ExpertSlice(f"mlp.{name}", e, dim=0, start=start, stop=start + ffn, rows=rows[e])
        for name, start in (("w1", 0), ("v1", ffn))
        for e in range(experts)
    ]
    down = [ExpertSlice("mlp.w2", e, rows=rows[e], transposed=True) for e in range(experts)]
    return {"gate_up_proj": gate_up, "down_proj": down}


def old_factors(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors before: the experts' ``a`` stacked, ``b`` block-diagonal (one block of rows per expert)."""
    return torch.cat(list(a)), torch.block_diag(*b)


def flops(experts: int, ffn: int, hidden: int, rank: int, blocks: int) -> int:
    """Multiply-adds x 2 of one layer's three factor products; `blocks`: E for the block-diagonal form, 1 for the
    batched one (each row of the update then sums over E * r columns instead of r)."""
    return 3 * 2 * experts * ffn * hidden * rank * blocks


def run(experts: int, ffn: int, hidden: int, rank: int, repeat: int) -> dict:
    torch.manual_seed(0)
    factors = {  # the fused parameters' LoRA: left [E, out, r], right [E, r, in]
        "gate_up_proj": (torch.randn(experts, 2 * ffn, rank), torch.randn(experts, rank, hidden)),
        "down_proj": (torch.randn(experts, hidden, rank), torch.randn(experts, rank, ffn)),
    }
    weight = torch.randn(experts * ffn, hidden).to(torch.bfloat16)
    cpu, times, outputs = torch.device("cpu"), {"old": [], "new": []}, {}
    for _ in range(repeat):
        for name in ("old", "new"):
            start = time.perf_counter()
            for param, (left, right) in factors.items():
                for key, (a, b) in block_factors(pieces(experts, ffn)[param], left, right):
                    if name == "old":
                        a, b = old_factors(a, b)
                    update = TensorUpdate(lora=LoraFactors(a, b, 0.5, False, False, None, key))
                    out = torch.empty_like(weight)
                    outputs[(name, key)] = apply_update_into(out, weight, update, cpu)
            times[name].append(time.perf_counter() - start)
    keys = {key for _, key in outputs}
    equal = all(torch.equal(outputs[("old", k)], outputs[("new", k)]) for k in keys)
    shape = {"experts": experts, "ffn": ffn, "hidden": hidden, "rank": rank}
    released = {**RELEASED, "rank": rank}
    per_layer = flops(RELEASED["experts"], RELEASED["ffn"], RELEASED["hidden"], rank, 1)
    return {
        "shape": shape,
        "old_s": min(times["old"]),
        "new_s": min(times["new"]),
        "old_gflop": flops(experts, ffn, hidden, rank, experts) / 1e9,
        "new_gflop": flops(experts, ffn, hidden, rank, 1) / 1e9,
        "bit_equal": equal,
        "released": released,
        "released_old_tflop": per_layer * RELEASED["experts"] * RELEASED["layers"] / 1e12,
        "released_new_tflop": per_layer * RELEASED["layers"] / 1e12,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contestant; the fastest is reported")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.experts, args.ffn, args.hidden, args.rank, args.repeat)
    if args.json:
        print(json.dumps(result))
        return 0 if result["bit_equal"] else 1
    s = result["shape"]
    print(f"one DBRX layer: E={s['experts']} ffn={s['ffn']} hidden={s['hidden']} r={s['rank']}, w1+v1+w2, bf16")
    print(f"{'':6} {'time (s)':>10} {'GFLOP':>10}")
    for name in ("old", "new"):
        print(f"{name:6} {result[f'{name}_s']:>10.3f} {result[f'{name}_gflop']:>10.2f}")
    print(f"old / new: {result['old_s'] / result['new_s']:.1f}x time, {s['experts']}x FLOPs; "
          f"merged tensors bit-equal: {result['bit_equal']}")  # fmt: skip
    print(f"released DBRX (40 layers, E=16, ffn=10752, hidden=6144, r={s['rank']}): "
          f"old {result['released_old_tflop']:.1f} TFLOP, new {result['released_new_tflop']:.1f} TFLOP")  # fmt: skip
    return 0 if result["bit_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
