"""Worker runners of the later GPU-check stages (benchmarks/gpu/stages_new.py), kept apart from _worker.py's size.

``adapter_dtype``: one run of ours with the adapters' master weights in the scenario's dtype (float32 / bfloat16),
the dtype the live LoRA parameters ended in recorded beside the figures. ``moe_layer``: one MoE layer's experts
(benchmarks/moe_layer.py's build, routing and LoRA factors) on this device, grouped vs the per-expert loop vs
transformers' 16-bit grouped_mm experts: forward + backward time, operator calls and peak memory.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time


def adapter_dtype_missing() -> str | None:
    """Why this tree cannot set the adapters' dtype (None: it can): the API of issue 34,
    ``FSDPQLoRATrainingArguments.adapter_dtype`` and ``load_qlora_model(adapter_dtype=)``."""
    from hf_fsdp_qlora import FSDPQLoRATrainingArguments, load_qlora_model

    missing = []
    if "adapter_dtype" not in {f.name for f in dataclasses.fields(FSDPQLoRATrainingArguments)}:
        missing.append("FSDPQLoRATrainingArguments.adapter_dtype")
    if "adapter_dtype" not in inspect.signature(load_qlora_model).parameters:
        missing.append("load_qlora_model(adapter_dtype=)")
    if not missing:
        return None
    return f"this tree has no {' nor '.join(missing)} (issue 34, fp32 adapter master weights, lands separately)"


def run_adapter_dtype(sc: dict, spec: dict, load, train) -> dict:
    """Ours with ``sc["adapter_dtype"]`` adapters; the LoRA parameters' dtypes as trained, beside the figures."""
    missing = adapter_dtype_missing()
    if missing:
        return {"status": "not yet available", "reason": missing}
    found = train(sc, spec, load(sc, spec))
    trainer = found.pop("_trainer")
    found["adapter_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for n, p in trainer.model.named_parameters()
                                      if "lora_" in n and p.requires_grad})  # fmt: skip
    del trainer
    return found


def _timed(torch, cuda: bool, step, repeats: int) -> dict:
    """Median milliseconds of `step` after one warm-up (the device synchronised around each), its peak memory."""
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {"ms": 1000 * statistics.median(times), "ms_repeats": [1000 * t for t in times],
            "max_allocated": torch.cuda.max_memory_allocated() if cuda else None}  # fmt: skip


def _contestant(torch, moe_layer, cuda: bool, module, inputs, factors: dict, repeats: int) -> tuple[dict, tuple]:
    """One contestant's figures (time, memory, the operators a forward + backward launches) and its outputs."""

    def step():
        for pairs in factors.values():
            for a, b, _ in pairs:
                a.weight.grad = b.weight.grad = None
        return moe_layer._step(module, *inputs, factors)

    row = _timed(torch, cuda, step, repeats)
    calls = moe_layer.operator_calls(step)
    row.update(operator_calls=sum(calls.values()), mm_calls=calls["aten::mm"],
               grouped_mm_calls=sum(n for k, n in calls.items() if "grouped_mm" in k),
               dequantize_calls=sum(n for k, n in calls.items() if "dequantize" in k),
               top_operators=dict(calls.most_common(6)))  # fmt: skip
    outputs = step()
    outputs += tuple(p.weight.grad.clone() for pairs in factors.values() for a, b, _ in pairs for p in (a, b))
    return row, outputs


def run_moe_layer(sc: dict, spec: dict, device: str) -> dict:
    """Grouped vs loop vs stock (and both of ours with LoRA) at ``sc["shape"]``, ``sc["tokens"]`` tokens, bf16."""
    import moe_layer  # benchmarks/ is on the worker's sys.path
    import torch

    cuda = device == "cuda"
    dtype, shape = torch.bfloat16, sc["shape"]
    started = time.perf_counter()
    with torch.device(device):  # the experts made and quantized where they run
        ours, stock = moe_layer.build(shape, dtype)
        lora = moe_layer.lora_factors(ours, sc["lora_r"], dtype) if sc["lora_r"] else {}
    inputs = tuple(t.to(device) for t in moe_layer.routing(sc["tokens"], shape, dtype))
    found = {"build_s": time.perf_counter() - started, "routed_experts": int(inputs[1].unique().numel()),
             "device": device, "contestants": {}}  # fmt: skip
    plan = [("grouped", ours, "grouped", {}), ("loop", ours, "loop", {}), ("stock", stock, None, {})]
    if lora:
        plan += [("grouped+lora", ours, "grouped", lora), ("loop+lora", ours, "loop", lora)]
    outputs = {}
    for name, module, compute, factors in plan:
        if compute:
            module.compute = compute
        try:
            found["contestants"][name], outputs[name] = _contestant(torch, moe_layer, cuda, module, inputs, factors,
                                                                    sc["repeats"])  # fmt: skip
        except Exception as e:  # noqa: BLE001  (recorded; the other contestants still run)
            found["contestants"][name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:400]}
        if cuda:
            torch.cuda.empty_cache()
    if {"grouped", "loop", "stock"} <= outputs.keys() and (
        not lora or {"grouped+lora", "loop+lora"} <= outputs.keys()
    ):
        found["max_rel_diff"] = moe_layer._diffs(outputs)
    return found
