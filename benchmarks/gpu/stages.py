"""Stages a-c of the GPU check: the CUDA tests, correctness at real shape, the doctor's memory plan against CUDA.

Each stage is two functions: ``*_scenarios(ctx)`` lists what the worker runs (with the accelerate config of each
and whether it needs a launch of its own, where a CUDA out-of-memory error could poison the process), and
``*_summary(ctx, results)`` turns the worker's results into the report's figures and goals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

from .profiles import GIB, LOSS_RTOL, MEMORY_GOAL

GPU_CONFIGS = ("fsdp2_qlora", "fsdp1_qlora", "fsdp2_qlora_offload")  # the shipped configs that fit one GPU
# FSDP2's CPUOffloadPolicy moves shards between host and an accelerator; on CPU ranks it raises "Cannot access
# accelerator device when none is available", so the dry run leaves it out (and says so).
CPU_UNSUPPORTED = {"fsdp2_qlora_offload": "FSDP2 parameter offloading needs an accelerator"}
# What a one-GPU run leaves unproven, said in every correctness report.
ONE_GPU_CANNOT_SHOW = ("one GPU cannot show FSDP's sharding is correct: at world size 1 each shard is the whole "
                       "tensor and every collective is a copy; the sharding (2 ranks: losses against the unsharded "
                       "run, gathered adapters, state dicts) is checked by the test suite's 2-rank CPU launches")  # fmt: skip
EXPECT = {None: 0, "fsdp2_qlora": 2, "fsdp1_qlora": 1, "fsdp2_qlora_offload": 2, "callback": 2}  # FSDP version


# The fast CUDA tests the first stage runs (under a minute on an H100): the merge kernels, the quantized weights and
# one shipped config end to end. The correctness stage covers the other configs at the 8B shape; "tests_rest" runs
# every other test marked cuda when time is left.
FAST_CUDA_TESTS = (
    "tests/test_cuda.py::test_qlora_weights_on_gpu_have_one_dtype_and_match_cpu_quantization",
    "tests/test_cuda.py::test_merge_on_cuda_equals_cpu_merge_and_peft",
    "tests/test_cuda.py::test_dequantized_merge_on_cuda_uses_the_cuda_kernels_and_matches_cpu",
    "tests/test_cuda.py::test_shipped_gpu_config_trains_and_merges_on_cuda[fsdp2_qlora.yaml]",
)


def start_tests(ctx, which: str = "tests") -> subprocess.Popen:
    """The CUDA tests of stage `which`: "tests" the fast ones, "tests_rest" every other test marked ``cuda``; on
    CPU (dry run) their collection only, which proves the chosen tests still exist."""
    junit = ctx.work / f"cuda-{which}.xml"
    if which == "tests":
        selection = list(FAST_CUDA_TESTS)
    else:
        # Dry run: test_cuda.py alone (every cuda test lives there today; collecting all of tests/ imports it all).
        selection = ["tests/test_cuda.py" if ctx.dry else "tests", *(f"--deselect={t}" for t in FAST_CUDA_TESTS)]
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *selection]
    cmd += ["--collect-only"] if ctx.dry else [f"--junitxml={junit}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ctx.root),
                            start_new_session=True)  # fmt: skip
    proc.junit = junit
    return proc


def finish_tests(ctx, proc: subprocess.Popen, seconds: float) -> dict:
    """The counts of the pytest run `proc`, killed (its whole process group) after `seconds`."""
    junit = proc.junit
    try:
        text, _ = proc.communicate(timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "stopped", "notes": [f"pytest did not finish in {seconds:.0f} s"]}
    if ctx.dry:
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", text)
        collected = int(m.group(1)) if m else 0
        return {"status": "ok" if proc.returncode == 0 and collected else "failed", "collected": collected,
                "notes": ["dry run: CUDA tests collected, not run (no GPU)"], "output_tail": text[-800:]}  # fmt: skip
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        tests, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        counts = {"passed": tests - fail - err - skip, "failed": fail, "skipped": skip, "errors": err}
        counts["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                  if c.find("failure") is not None or c.find("error") is not None]  # fmt: skip
    ok = proc.returncode == 0 and counts["passed"] > 0
    return {"status": "ok" if ok else "failed", **counts, "output_tail": text[-1500:]}


def correctness_scenarios(ctx) -> list[dict]:
    p = ctx.profile
    base = {"kind": "ours", "lora_r": p["lora_r"], "lr": p["lr"], "warmup": 1, "save_adapter": True,
            **p["correctness"]}  # fmt: skip
    runs = [
        {**base, "name": "b.none", "config": None},
        {"name": "b.merge", "kind": "merge", "config": None, "adapter": str(ctx.work / "adapters" / "b.none")},
    ]
    runs += [{**base, "name": f"b.{c}", "config": c} for c in GPU_CONFIGS if not (ctx.dry and c in CPU_UNSUPPORTED)]
    # The stock Trainer + FSDPQLoRACallback route, under FSDP2 (with the FSDP2 launch: same config).
    runs.insert(3, {**base, "name": "b.callback", "kind": "callback", "config": "fsdp2_qlora"})
    return runs


def _engaged_as_asked(found: dict, version: int) -> bool:
    e = found.get("engaged") or {}
    if version == 0:
        return not any(e.values())
    if version == 1:
        return e.get("fsdp1_units", 0) > 0 and e.get("flat_params", 0) > 0
    return e.get("fsdp2_modules", 0) > 0 and e.get("dtensor_params", 0) > 0


def correctness_summary(ctx, results: dict) -> dict:
    """Stage b: FSDP engaged where asked, losses within LOSS_RTOL of the no-FSDP run, adapters and merge equal."""
    ref = results.get("b.none", {})
    ref_losses = ref.get("losses") or []
    rows, failures = [], []
    skipped = [f"{c}: {why} (skipped in the dry run)" for c, why in CPU_UNSUPPORTED.items() if ctx.dry]
    skipped.append(ONE_GPU_CANNOT_SHOW)
    for config in (None, *GPU_CONFIGS, "callback"):
        if ctx.dry and config in CPU_UNSUPPORTED:
            continue
        found = results.get(f"b.{config or 'none'}", {"status": "not run"})
        losses = found.get("losses") or []
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)] if losses and ref_losses else []
        adapter = found.get("adapter") or {}
        label = "callback (stock Trainer + FSDPQLoRACallback, fsdp2_qlora)" if config == "callback" else config
        row = {"config": label or "none (plain python)", "status": found.get("status"),
               "fsdp_engaged_as_asked": _engaged_as_asked(found, EXPECT[config]) if found.get("status") == "ok"
               else None, "losses": losses, "max_rel_diff_vs_no_fsdp": max(rel) if rel else None,
               "adapter_saved_reloaded_equal": adapter.get("equal"), "adapter_tensors": adapter.get("tensors_saved"),
               "distributed_type": found.get("distributed_type"), "s_per_step": found.get("s_per_step"),
               "error": found.get("error")}  # fmt: skip
        rows.append(row)
        good = (found.get("status") == "ok" and row["fsdp_engaged_as_asked"] and row["adapter_saved_reloaded_equal"]
                and len(losses) == len(ref_losses) > 0 and (config is None or max(rel) <= LOSS_RTOL))  # fmt: skip
        if not good:
            failures.append(row["config"])
    merge = results.get("b.merge", {"status": "not run"})
    merge_row = {k: merge.get(k) for k in ("status", "tensors_compared", "tensors_changed_vs_base",
                                           "tensors_beyond_one_bf16_ulp", "max_abs_diff", "merge_s", "error")}  # fmt: skip
    if not merge.get("equal_within_one_ulp"):
        failures.append("merge")
    return {
        "status": "ok" if not failures else "failed", "loss_rtol": LOSS_RTOL, "rows": rows, "merge": merge_row,
        "merge_equal_to_peft": bool(merge.get("equal_within_one_ulp")), "failures": failures, "notes": skipped,
        "goals": [(f"every config engaged as asked, losses within {LOSS_RTOL:.0%} of no-FSDP, adapter equal after "
                  f"reload, merge-adapters on {ctx.device} == peft merge within one bf16 ulp: "
                  f"{'met' if not failures else 'MISSED: ' + ', '.join(failures)}")],
    }  # fmt: skip


def memory_scenarios(ctx) -> list[dict]:
    p = ctx.profile
    base = {"kind": "ours", "lora_r": p["lora_r"], "batch": 1, "steps": p["memory"]["steps"], "warmup": 1,
            "count_saved": ctx.dry}  # fmt: skip
    # In order of value, so a stage cut at its deadline has the most telling rows: the no-FSDP run with
    # checkpointing at every sequence length shares the first launch, then activation offloading, then FSDP2, then
    # the runs without checkpointing (out-of-memory risks: a launch each).
    safe = [{**base, "name": f"c.none.ckpt.{seq}", "seq": seq, "config": None} for seq in p["memory"]["seqs"]]
    safe += [{**base, "name": f"c.none.ckpt_offload.{seq}", "seq": seq, "config": None,
              "options": {"activation_offloading": True}} for seq in p["memory"]["seqs"]]  # fmt: skip
    safe += [{**base, "name": f"c.fsdp2.ckpt.{seq}", "seq": seq, "config": "fsdp2_qlora", "isolate": True}
             for seq in p["memory"]["seqs"]]  # fmt: skip
    risky = [{**base, "name": f"c.none.no_ckpt.{seq}", "seq": seq, "config": None, "checkpointing": False,
              "isolate": True} for seq in p["memory"]["seqs"]]  # fmt: skip
    return safe + risky


def _plan(ctx, sc: dict):
    from hf_fsdp_qlora.doctor.checks import diagnose

    config = None if sc["config"] is None else ctx.root / "accelerate_configs" / f"{sc['config']}.yaml"
    ckpt = sc.get("checkpointing", True)
    return diagnose(str(ctx.model), accelerate_config=str(config) if config else None, quantization="4bit",
                    lora_r=ctx.profile["lora_r"], lora_dropout=0.0, seq_len=sc["seq"], batch_size=1,
                    model_checkpointing=ckpt and sc["config"] != "fsdp2_qlora",
                    activation_offloading=bool(sc.get("options", {}).get("activation_offloading")), num_gpus=1,
                    gpu_memory=ctx.gpu_memory, mixed_precision="bf16").plan  # fmt: skip


def allocator_part(plan) -> int:
    """The plan's bytes that ``torch.cuda.max_memory_allocated`` can see: its total less ``runtime_overhead`` (the
    CUDA context and library handles, which live outside PyTorch's caching allocator)."""
    return plan.total - plan.parts["runtime_overhead"]


def memory_summary(ctx, results: dict) -> dict:
    """Stage c: the plan's per-GPU total less its runtime overhead against CUDA's max allocated and reserved (dry
    run: activations only)."""
    rows, missed = [], []
    for sc in memory_scenarios(ctx):
        found = results.get(sc["name"], {"status": "not run"})
        plan = _plan(ctx, sc)
        row = {"run": sc["name"][2:], "status": found.get("status"), "plan_total_gib": plan.total / GIB,
               "plan_verdict": plan.verdict, "plan_activations_gib": plan.parts["activations"] / GIB}  # fmt: skip
        if ctx.dry:
            measured = found.get("saved_for_backward_bytes_per_step")
            row["saved_for_backward_mib"] = measured / 2**20 if measured else None
            row["plan_activations_mib"] = plan.parts["activations"] / 2**20
        elif found.get("status") == "ok":
            # Like with like: the caching allocator never counts the plan's runtime overhead (the CUDA context,
            # outside the allocator), so the goal compares the allocator's part of the plan with its peak.
            allocator = allocator_part(plan)
            row["plan_allocator_gib"] = allocator / GIB
            row["max_allocated_gib"] = found["max_allocated"] / GIB
            row["max_reserved_gib"] = found["max_reserved"] / GIB
            row["plan_vs_allocated"] = allocator / found["max_allocated"]
            row["plan_vs_reserved"] = allocator / found["max_reserved"]
            if abs(row["plan_vs_allocated"] - 1) > MEMORY_GOAL:
                missed.append(row["run"])
        elif found.get("status") == "oom":
            row["note"] = "CUDA out of memory" + (" (the plan said it would not fit)" if plan.verdict == "does_not_fit"
                                                  else " although the plan said it fits")  # fmt: skip
            if plan.verdict != "does_not_fit":
                missed.append(row["run"])
        row["plan_parts"] = {k: v / GIB for k, v in plan.parts.items()}
        rows.append(row)
    ran = [r for r in rows if r["status"] in ("ok", "oom")]
    status = "ok" if len(ran) == len(rows) else ("stopped" if ran else "failed")
    goal = (f"plan total less its runtime overhead within {MEMORY_GOAL:.0%} of CUDA max allocated: "
            f"{'met' if not missed else 'MISSED for ' + ', '.join(missed)}")  # fmt: skip
    notes = [("dry run: no CUDA allocator on CPU; the figure beside the plan's activations is the bytes autograd "
             "kept for backward per step (saved-tensor hooks)")] if ctx.dry else []  # fmt: skip
    return {"status": status, "rows": rows, "goals": [] if ctx.dry else [goal], "notes": notes}
