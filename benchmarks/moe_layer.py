"""One MoE layer's experts, forward + backward on CPU: time and operator calls, grouped vs loop vs stock.

    python benchmarks/moe.py --layer                      # Qwen3-30B-A3B's expert shape, 2048 tokens (~3 GB, minutes)
    python benchmarks/moe.py --layer --tokens 512 --json  # smaller

Qwen3-30B-A3B's experts (hidden 2048, 128 experts, width 768, top 8) built locally from a config, random weights
(nothing downloaded), bf16, NF4 with double quantization, random top-k routing. One process, one thread by default.

    grouped   our 4-bit experts, grouped compute (hf_fsdp_qlora/experts/grouped.py)
    loop      the same module, the per-expert loop (compute="loop": the reference)
    stock     transformers' bf16 experts (Qwen3MoeExperts, experts_implementation="grouped_mm") holding our
              dequantized weights, so its output is the oracle of ours
    *+lora    ours with LoRA (rank --lora-r) on both expert weights, as peft's target_parameters adapts them

Measured: forward + backward (input gradient; LoRA gradients for +lora) wall and CPU time, median of the repeats
after one warm-up; operator calls of one profiled forward + backward (torch.profiler: aten and bitsandbytes
operators not called from inside another, i.e. what a GPU would launch; the CPU grouped_mm itself runs one matmul
per group inside); peak RSS. On CPU the loop is not slower than stock's grouped_mm, so time cannot show the gain:
the operator calls, which grow with the routed experts in the loop and stay a constant per projection grouped, do.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

SHAPE = {"hidden_size": 2048, "num_experts": 128, "moe_intermediate_size": 768, "num_experts_per_tok": 8}
OPERATORS = ("aten::", "bitsandbytes::")


def build(shape: dict, dtype, seed: int = 0):
    """(our 4-bit experts, stock bf16 experts holding our dequantized weights)."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hf_fsdp_qlora.experts.grouped import dequantize_routed
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts, expert_layout

    config = Qwen3MoeConfig(**shape, experts_implementation="grouped_mm")
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # never a float32 copy of the experts
    try:
        stock = Qwen3MoeExperts(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in stock.parameters():
            p.normal_(0, 0.02)
    stock.requires_grad_(False)
    ours = QuantizedExperts(stock, expert_layout(stock), quant_type="nf4", double_quant=True, dtype=dtype)
    with torch.no_grad():
        for name in ours.layout.weights:
            getattr(stock, name).copy_(dequantize_routed(ours, name, torch.arange(ours.num_experts)))
    return ours, stock


def routing(tokens: int, shape: dict, dtype, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, shape["hidden_size"], generator=g).to(dtype)
    logits = torch.randn(tokens, shape["num_experts"], generator=g)
    weights, index = torch.softmax(logits, -1).topk(shape["num_experts_per_tok"], dim=-1)
    return hidden, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def lora_factors(ours, rank: int, dtype) -> dict:
    """peft's expert LoRA layout: lora_A ``[r*E, in]``, lora_B ``[out, r*E]``, per weight."""
    import torch

    factors = {}
    for name in ours.layout.weights:
        out_f, in_f = ours.quant_meta(name)[0]
        a = torch.nn.Linear(in_f, rank * ours.num_experts, bias=False, dtype=dtype)
        b = torch.nn.Linear(rank * ours.num_experts, out_f, bias=False, dtype=dtype)
        torch.nn.init.normal_(b.weight, std=0.02)
        factors[name] = [(a, b, 2.0)]
    return factors


def _step(module, hidden, index, weights, lora):
    from contextlib import ExitStack

    import torch

    x = hidden.detach().requires_grad_(True)
    with ExitStack() as stack:
        for name, factors in lora.items():
            stack.enter_context(module.lora_active(name, factors))
        out = module(x, index, weights)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


def operator_calls(fn) -> Counter:
    """Operators `fn` calls that no other operator called (aten and bitsandbytes), by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    calls = Counter()
    for event in prof.events():
        if not event.name.startswith(OPERATORS):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(OPERATORS):
            parent = parent.cpu_parent
        if parent is None:
            calls[event.name] += 1
    return calls


def _vm_hwm(reset: bool = False) -> int:
    """Peak RSS since the last reset (Linux VmHWM); `reset`: start a new peak after reading."""
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return peak


def _release_freed_memory() -> None:
    """Hand memory freed by earlier contestants back to the OS (glibc keeps it), so each peak is the contestant's."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the peaks may include memory an earlier contestant freed
        pass


def measure(module, inputs, lora: dict, repeats: int) -> dict:
    _release_freed_memory()
    _vm_hwm(reset=True)
    walls, cpus = [], []
    for i in range(repeats + 1):  # the first is the warm-up
        for factors in lora.values():
            for a, b, _ in factors:
                a.weight.grad = b.weight.grad = None
        wall, cpu = time.perf_counter(), time.process_time()
        _step(module, *inputs, lora)
        if i:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    calls = operator_calls(lambda: _step(module, *inputs, lora))
    return {"fwd_bwd_s": statistics.median(walls), "fwd_bwd_cpu_s": statistics.median(cpus),
            "operator_calls": sum(calls.values()), "grouped_mm_calls": calls["aten::_grouped_mm"],
            "mm_calls": calls["aten::mm"], "dequantize_calls": calls["bitsandbytes::dequantize_4bit"],
            "top_operators": dict(calls.most_common(6)), "peak_rss_bytes": _vm_hwm()}  # fmt: skip


def run(tokens: int, repeats: int = 2, lora_r: int = 16, threads: int = 1, shape: dict | None = None) -> dict:
    import torch

    torch.set_num_threads(threads)
    shape = shape or SHAPE
    dtype = torch.bfloat16
    started = time.perf_counter()
    ours, stock = build(shape, dtype)
    build_rss = _vm_hwm()
    inputs = routing(tokens, shape, dtype)
    routed = int(inputs[1].unique().numel())
    result = {"workload": {**shape, "tokens": tokens, "routed_experts": routed, "dtype": "bfloat16",
                           "threads": threads, "repeats": repeats, "lora_r": lora_r,
                           "build_s": round(time.perf_counter() - started, 1), "build_peak_rss_bytes": build_rss},
              "contestants": {}}  # fmt: skip
    outputs = {}
    lora = lora_factors(ours, lora_r, dtype) if lora_r else {}
    plan = [("grouped", ours, "grouped", {}), ("loop", ours, "loop", {}), ("stock", stock, None, {})]
    if lora:
        plan += [("grouped+lora", ours, "grouped", lora), ("loop+lora", ours, "loop", lora)]
    for name, module, compute, factors in plan:
        if compute:
            module.compute = compute
        result["contestants"][name] = measure(module, inputs, factors, repeats)
        outputs[name] = _step(module, *inputs, factors)
        if factors:
            outputs[name] += tuple(p.weight.grad.clone() for f in factors.values() for a, b, _ in f for p in (a, b))
        print(f"{name}: {result['contestants'][name]['fwd_bwd_s']:.2f} s, "
              f"{result['contestants'][name]['operator_calls']} operator calls", flush=True)  # fmt: skip
    result["max_abs_diff"] = _diffs(outputs)
    return result


def _diffs(outputs: dict) -> dict:
    """max |difference| / max |value| over the output, the input gradient (and the LoRA gradients)."""

    def diff(a, b):
        return max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))

    found = {"grouped_vs_loop": diff(outputs["grouped"], outputs["loop"]),
             "grouped_vs_stock": diff(outputs["grouped"], outputs["stock"])}  # fmt: skip
    if "grouped+lora" in outputs:
        found["lora_grouped_vs_loop"] = diff(outputs["grouped+lora"], outputs["loop+lora"])
    return found


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"\nOne MoE layer's experts, forward + backward: hidden {w['hidden_size']}, {w['num_experts']} experts, "
          f"width {w['moe_intermediate_size']}, top {w['num_experts_per_tok']}, {w['tokens']} tokens "
          f"({w['routed_experts']} experts routed), {w['dtype']}, {w['threads']} thread(s)")  # fmt: skip
    print(f"{'':14}{'wall s':>9}{'CPU s':>9}{'operators':>11}{'grouped_mm':>12}{'mm':>6}{'dequant':>9}"
          f"{'peak RSS':>11}")  # fmt: skip
    for name, row in result["contestants"].items():
        print(f"{name:14}{row['fwd_bwd_s']:9.2f}{row['fwd_bwd_cpu_s']:9.2f}{row['operator_calls']:11}"
              f"{row['grouped_mm_calls']:12}{row['mm_calls']:6}{row['dequantize_calls']:9}"
              f"{row['peak_rss_bytes'] / 2**30:7.2f} GiB")  # fmt: skip
    print("max |difference| / max |value|: " + ", ".join(f"{k} {v:.3g}" for k, v in result["max_abs_diff"].items()))
    print(
        f"built in {w['build_s']} s, peak RSS {w['build_peak_rss_bytes'] / 2**30:.2f} GiB; CPU time is the "
        "figure to compare on a shared machine (the wall clock waits for the CPU)"
    )
