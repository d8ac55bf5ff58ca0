"""Stages f-h of the GPU check: fp32 against bf16 adapters, MoE expert speed, the longest sequence.

All three run in the resumed run (budget.PLAN: no share in the first run, ``resume_share_s`` in the second).

* ``fp32_vs_bf16``: ours at the 8B shape (no FSDP), the adapters' master weights in float32 and in bfloat16, one
  launch: seconds per step and CUDA's max allocated, side by side, and the dtype the LoRA weights trained in.
* ``moe_speed``: one Qwen3-30B-A3B MoE layer's experts on CUDA, bf16: our 4-bit experts computed grouped against
  the per-expert loop and transformers' 16-bit ``grouped_mm`` experts (benchmarks/moe_layer.py's workload):
  milliseconds per layer forward + backward and the operators each launches.
* ``longest_seq``: the longest sequence (batch 1) whose step trains at the 8B shape with tiled MLP, chunked loss
  and activation checkpointing, bisected around the doctor's ``--longest`` answer for the same setup and memory.
"""

from __future__ import annotations

from .profiles import GIB, MEMORY_GOAL

ADAPTER_DTYPES = ("float32", "bfloat16")
# fp32 master weights cost the optimizer nothing (Adam's states are fp32 either way) and the LoRA weights and their
# gradients 2 bytes more per parameter: ~0.2 GiB at the 8B shape, r=16; the matmuls still run in bf16.
FP32_GOAL = {"step_time": 1.05, "memory_gib": 0.5}
MOE_GOAL = 0.5  # grouped's ms at most half the loop's


def fp32_scenarios(ctx) -> list[dict]:
    p = ctx.profile
    return [{"name": f"f.{d}", "kind": "adapter_dtype", "config": None, "lora_r": p["lora_r"], "adapter_dtype": d,
             "options": {"adapter_dtype": d}, **p["adapter_dtype"]} for d in ADAPTER_DTYPES]  # fmt: skip


def fp32_summary(ctx, results: dict) -> dict:
    """Stage f: step time and peak memory of fp32 against bf16 adapters, and the dtype each trained in."""
    memory_key = "peak_rss" if ctx.dry else "max_allocated"
    rows, wrong = {}, []
    for d in ADAPTER_DTYPES:
        f = results.get(f"f.{d}", {"status": "not run"})
        rows[d] = {"adapter_dtype": d, "status": f.get("status"), "trained_in": f.get("adapter_dtypes"),
                   "s_per_step": f.get("s_per_step"), "tokens_per_s": f.get("tokens_per_s"),
                   "peak_memory_gib": f[memory_key] / GIB if f.get(memory_key) else None, "losses": f.get("losses"),
                   "error": f.get("error") or f.get("reason")}  # fmt: skip
        if f.get("status") == "ok" and f.get("adapter_dtypes") != [d]:
            wrong.append(f"{d} asked, trained in {f.get('adapter_dtypes')}")
    waiting = [r["error"] for r in rows.values() if r["status"] == "not yet available"]
    if waiting:
        return {"status": "not yet available", "waiting_for": waiting[0], "rows": list(rows.values())}
    fp32, bf16 = rows["float32"], rows["bfloat16"]
    if not (fp32["s_per_step"] and bf16["s_per_step"]) or wrong:
        return {"status": "failed", "rows": list(rows.values()), "failures": wrong}
    ratio = fp32["s_per_step"] / bf16["s_per_step"]
    extra = fp32["peak_memory_gib"] - bf16["peak_memory_gib"]
    met = ratio <= FP32_GOAL["step_time"] and extra <= FP32_GOAL["memory_gib"]
    goal = (f"fp32 adapters at most {FP32_GOAL['step_time']}x bf16's step time and {FP32_GOAL['memory_gib']} GiB more "
            f"peak memory: {ratio:.3f}x, {extra:+.3f} GiB: {'met' if met else 'MISSED'}")  # fmt: skip
    notes = ["dry run on CPU: peak memory is the process's peak RSS (the two runs share a process)"] if ctx.dry else []
    return {"status": "ok", "rows": list(rows.values()), "step_time_fp32_vs_bf16": ratio,
            "extra_memory_gib": extra, "goals": [goal], "notes": notes}  # fmt: skip


def moe_scenarios(ctx) -> list[dict]:
    return [{"name": "g.moe_layer", "kind": "moe_layer", "config": None, "isolate": True, **ctx.profile["moe"]}]


def moe_summary(ctx, results: dict) -> dict:
    """Stage g: ms per layer forward + backward and operator calls, grouped vs loop vs stock, side by side."""
    f = results.get("g.moe_layer", {"status": "not run"})
    found = f.get("contestants") or {}
    keys = ("ms", "operator_calls", "grouped_mm_calls", "mm_calls", "dequantize_calls", "max_allocated", "error")
    rows = [{"contestant": name, **{k: row.get(k) for k in keys}} for name, row in found.items()]
    for row in rows:
        peak = row.pop("max_allocated")
        row["max_allocated_gib"] = peak / GIB if peak else None
    ms = {r["contestant"]: r["ms"] for r in rows if r.get("ms")}
    if f.get("status") != "ok" or not {"grouped", "loop", "stock"} <= ms.keys():
        return {"status": "failed", "rows": rows, "error": f.get("error"), "log_tail": f.get("log_tail")}
    ratio, vs_stock = ms["grouped"] / ms["loop"], ms["grouped"] / ms["stock"]
    calls = {r["contestant"]: r["operator_calls"] for r in rows}
    shape = ctx.profile["moe"]["shape"]
    goals = [f"grouped at most {MOE_GOAL}x the loop's ms per layer: {ratio:.2f}x "
             f"({ms['grouped']:.2f} against {ms['loop']:.2f} ms; stock 16-bit grouped_mm {ms['stock']:.2f} ms, grouped "
             f"{vs_stock:.2f}x it): {'met' if ratio <= MOE_GOAL else 'MISSED'}",
             f"grouped launches fewer operators than the loop: {calls['grouped']} against {calls['loop']}: "
             f"{'met' if calls['grouped'] < calls['loop'] else 'MISSED'}"]  # fmt: skip
    notes = [f"one layer's experts: hidden {shape['hidden_size']}, {shape['num_experts']} experts, width "
             f"{shape['moe_intermediate_size']}, top {shape['num_experts_per_tok']}, {ctx.profile['moe']['tokens']} "
             f"tokens ({f.get('routed_experts')} experts routed), bf16, NF4 + double quantization, on "
             f"{f.get('device')}"]  # fmt: skip
    if ctx.dry:
        notes.append("dry run on CPU: the times prove the plumbing; CPU grouped_mm runs one matmul per group inside")
    return {"status": "ok", "rows": rows, "grouped_vs_loop": ratio, "grouped_vs_stock": vs_stock,
            "max_rel_diff": f.get("max_rel_diff"), "goals": goals, "notes": notes}  # fmt: skip


def doctor_longest(ctx, cap: int) -> int:
    """The doctor's ``--longest`` 100% edge for the stage's setup: ours, NF4, LoRA, checkpointing, tiled MLP, chunked
    loss, batch 1, one GPU of `cap` bytes (the plan's own claim of where memory runs out; its answer, the verdict's
    "fits", leaves 10% to the allocator)."""
    from hf_fsdp_qlora.doctor.checks import diagnose
    from hf_fsdp_qlora.doctor.longest import longest_sequence

    d = diagnose(str(ctx.model), quantization="4bit", lora_r=ctx.profile["lora_r"], lora_dropout=0.0, batch_size=1,
                 model_checkpointing=True, tiled_mlp_tokens=ctx.profile["longest"]["tile"], num_gpus=1,
                 gpu_memory=cap, mixed_precision="bf16")  # fmt: skip
    return longest_sequence(d.shape, d.setup, fraction=1.0)


def _window(ctx, answer: int) -> tuple[int, int]:
    """The bisection's interval: the profile's on CPU, else `around` the doctor's answer, in whole steps."""
    c = ctx.profile["longest"]
    if ctx.dry:
        return c["low"], c["high"]
    low, high = (max(1, round(answer * f / c["step"])) * c["step"] for f in c["around"])
    return low, max(high, low + c["step"])


def longest_scenarios(ctx) -> list[dict]:
    c = ctx.profile["longest"]
    runs = []
    for name, cap in c["caps"].items():
        cap = cap or ctx.gpu_memory
        low, high = _window(ctx, doctor_longest(ctx, cap))
        runs.append({"name": f"h.longest.{name}", "kind": "seq_capacity", "recipe": "ours", "config": None,
                     "caps": {name: cap}, "lora_r": ctx.profile["lora_r"], "low": low, "high": high,
                     "step": c["step"], "seconds": c["seconds"], "count_saved": ctx.dry,
                     "options": {"tiled_mlp": True, "tiled_mlp_tokens": c["tile"], "chunked_loss": True}})  # fmt: skip
    return runs


def longest_summary(ctx, results: dict) -> dict:
    """Stage h: the longest sequence that trained a step, per cap, beside the doctor's answer for that memory."""
    rows, missed, compared = [], [], []
    for sc in longest_scenarios(ctx):
        ((name, cap),) = sc["caps"].items()
        run = results.get(sc["name"], {"status": "not run"})
        found = (run.get("caps") or {}).get(name, {})
        doctor = doctor_longest(ctx, cap)
        row = {"cap": name, "cap_gib": cap / GIB, "status": run.get("status"), "longest_seq": found.get("largest"),
               "complete": found.get("complete"), "probes": found.get("probes"), "searched": [sc["low"], sc["high"]],
               "doctor_longest": doctor, "error": run.get("error")}  # fmt: skip
        if row["longest_seq"] and doctor:
            row["measured_vs_doctor"] = row["longest_seq"] / doctor
            compared.append(name)
            if abs(row["measured_vs_doctor"] - 1) > MEMORY_GOAL:
                missed.append(name)
        rows.append(row)
    ok = rows and all(r["status"] == "ok" and r["longest_seq"] for r in rows)
    verdict = "MISSED for " + ", ".join(missed) if missed else "met" if compared else "not compared (no answers)"
    goal = (f"the longest sequence that trains within {MEMORY_GOAL:.0%} of the doctor's --longest answer (tiled MLP, "
            f"chunked loss, checkpointing): {verdict}")  # fmt: skip
    notes = ["searched around the doctor's answer (profiles: longest.around); a 'longest_seq' equal to the interval's "
             "top means at least that much", "a cap other than the whole GPU is "
             "torch.cuda.set_per_process_memory_fraction (the CUDA context is outside it)"]  # fmt: skip
    if ctx.dry:
        notes.append("dry run: a probe 'fits' when the bytes autograd kept for backward stay under the cap; the "
                     "doctor's answer for a cap that small is 0 (the weights alone exceed it)")  # fmt: skip
    return {"status": "ok" if ok else "failed", "rows": rows, "goals": [goal], "notes": notes}
