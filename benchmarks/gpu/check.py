"""The GPU check: one command that measures correctness, memory and speed of hf_fsdp_qlora on one GPU.

    python -m benchmarks.gpu --out gpu_report    # on a GPU machine: every stage, report into gpu_report/
    python -m benchmarks.gpu --resume-from gpu_report/gpu_report.json --out gpu_report_2   # what a first run left
    python -m benchmarks.gpu --dry-run            # every stage at tiny shape on CPU (gloo, no CUDA): the CI form

Stages (docs/gpu-check.md), in order of value (budget.PLAN): the fast CUDA tests, correctness (Llama 3.1 8B shape,
each shipped GPU config and no FSDP, merge against peft), memory (the doctor's plan against CUDA's peak), speed
(against the stock recipe), fp32 against bf16 adapters, MoE expert speed and our longest sequence (these three
in the resumed run), capacity (largest shape, longest sequence) and the rest of the CUDA tests. ``gpu_report.json``
and ``gpu_report.md`` are rewritten as each stage ends. The run keeps to ``--budget`` seconds (8 minutes by default):
each stage has its deadline (budget.deadlines) and every launch is killed at it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import stages, stages_new, stages_speed
from .budget import DEFAULT_RUN_S, MARGIN_S, NAMES, Stage, deadlines, plan_for
from .launch import launch
from .profiles import PROFILES
from .report import Report

ROOT = Path(__file__).resolve().parents[2]
TEST_STAGES = ("tests", "tests_rest")  # they run pytest (stages.start_tests)
# Stages whose runs need nothing of each other (no adapter passed on, no chain): a resumed run keeps their runs
# that ended "ok" and runs only the rest (speed's rounds do not fit one run).
RUNS_KEPT = ("memory", "speed")
STAGES = {  # name -> (scenarios, summary): every stage of budget.PLAN that launches the worker (all but TEST_STAGES)
    "correctness": (stages.correctness_scenarios, stages.correctness_summary),
    "memory": (stages.memory_scenarios, stages.memory_summary),
    "speed": (stages_speed.speed_scenarios, stages_speed.speed_summary),
    "fp32_vs_bf16": (stages_new.fp32_scenarios, stages_new.fp32_summary),
    "moe_speed": (stages_new.moe_scenarios, stages_new.moe_summary),
    "longest_seq": (stages_new.longest_scenarios, stages_new.longest_summary),
    "capacity": (stages_speed.capacity_scenarios, stages_speed.capacity_summary),
}
# A launch with less time than this left is not started (its scenarios read "stopped"): it could not finish one.
MIN_LAUNCH_S = 5.0
PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "trl", "datasets", "hf-fsdp-qlora")


@dataclass
class Context:
    root: Path
    work: Path
    model: Path
    profile: dict
    dry: bool
    device: str
    gpu_memory: int | None
    parameters: int = 0


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def run_scenarios(ctx: Context, scenarios: list[dict], deadline: float, parallel: bool = False) -> dict:
    """Launch `scenarios`: consecutive ones that share a config and are not ``isolate`` share a launch (on CPU all
    of one config do); an ``isolate`` one gets its own. A ``chain`` stops at its first success (largest shape).
    ``parallel``: every launch at once (correctness: its figures are not timings, and its launches fit one GPU
    together), so the stage costs its longest launch rather than their sum."""
    results: dict = {}
    groups: list[tuple[str | None, list[dict]]] = []
    for sc in scenarios:
        alone = sc.get("isolate") and not ctx.dry
        if groups and not alone and groups[-1][0] == sc["config"] and not groups[-1][1][-1].get("_alone"):
            groups[-1][1].append(sc)
        else:
            groups.append((sc["config"], [{**sc, "_alone": alone}]))
    if parallel:
        return _launch_together(ctx, groups, deadline)
    done_chains: set[str] = set()
    for config, group in groups:
        todo = [sc for sc in group if sc.get("chain") not in done_chains or ctx.dry]
        left = deadline - time.monotonic()
        if not todo:
            continue
        if left < MIN_LAUNCH_S:
            results.update({sc["name"]: {"status": "stopped", "note": "stage time box spent"} for sc in todo})
            continue
        results.update(launch(ctx, config, todo, todo[0]["name"], left))
        done_chains.update(sc["chain"] for sc in todo if sc.get("chain") and results[sc["name"]]["status"] == "ok")
    return results


def _launch_together(ctx: Context, groups: list[tuple[str | None, list[dict]]], deadline: float) -> dict:
    """Every launch of `groups` at once (threads wait on the processes), each killed at `deadline`."""
    from concurrent.futures import ThreadPoolExecutor

    left = deadline - time.monotonic()
    if left < MIN_LAUNCH_S:
        return {sc["name"]: {"status": "stopped", "note": "stage time box spent"} for _, g in groups for sc in g}
    results: dict = {}
    with ThreadPoolExecutor(len(groups)) as pool:
        for found in pool.map(lambda g: launch(ctx, g[0], g[1], g[1][0]["name"], left), groups):
            results.update(found)
    return results


def build_model(ctx: Context, deadline: float) -> dict:
    """The random bf16 Llama every stage loads: made on the device in a worker (in this process on CPU)."""
    if ctx.dry and not (ctx.model / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**ctx.profile["shape"], max_position_embeddings=4096)).to(torch.bfloat16)
        model.save_pretrained(ctx.model)
        (ctx.model / "params.json").write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
    if (ctx.model / "config.json").exists() and (ctx.model / "params.json").exists():
        ctx.parameters = json.loads((ctx.model / "params.json").read_text())["parameters"]
        return {"status": "ok", "reused": str(ctx.model), "parameters": ctx.parameters}
    sc = {"name": "build", "kind": "build", "shape": ctx.profile["shape"], "config": None}
    found = launch(ctx, None, [sc], "build", deadline - time.monotonic())["build"]
    if found["status"] == "ok":
        ctx.parameters = found["parameters"]
        (ctx.model / "params.json").write_text(json.dumps({"parameters": ctx.parameters}))
    return found


def _work_dir(dry: bool) -> Path:
    """Where the 8B checkpoint is written once and read by every launch: /dev/shm when it holds it with room to
    spare (tmpfs: the write and every load skip the disk), else /tmp."""
    shm = Path("/dev/shm")
    if not dry and shm.is_dir() and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 40 * 2**30:
        return shm / "hf_fsdp_qlora_gpu_check"
    return Path("/tmp/hf_fsdp_qlora_gpu_check")


def install_seconds(dry: bool, work: Path) -> float | None:
    """The wheel install's seconds, as install_wheels.py left them in its target (on PYTHONPATH). A dry run with
    the wheels of ``make gpu-wheels`` at hand unpacks them into its work folder to time it (used by nothing)."""
    for folder in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        found = Path(folder) / "install_seconds.json"
        if found.exists():
            return json.loads(found.read_text())["seconds"]
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not (dry and wheels):
        return None
    from . import install_wheels

    t = time.monotonic()
    install_wheels.install(wheels, str(work / "site"))
    return time.monotonic() - t


def _stage_result(ctx: Context, stage: Stage, deadline: float, pooled: dict, tests: dict, kept: dict) -> dict:
    """Run one stage until `deadline` (a slot reports what it waits for), less the runs `kept` from a first run;
    the figures its summary makes of them all."""
    if stage.waiting_for:
        return {"status": "not yet available", "waiting_for": stage.waiting_for, "what": stage.what}
    if stage.name in TEST_STAGES:
        proc = tests.get(stage.name) or stages.start_tests(ctx, stage.name)
        return stages.finish_tests(ctx, proc, max(10.0, deadline - time.monotonic()))
    scenarios, summary = STAGES[stage.name]
    mine = scenarios(ctx)
    todo = [sc for sc in mine if sc["name"] not in kept]
    found = pooled if ctx.dry else run_scenarios(ctx, todo, deadline, parallel=stage.name == "correctness")
    found = {sc["name"]: kept.get(sc["name"]) or found.get(sc["name"], {"status": "not run"}) for sc in mine}
    result = summary(ctx, found)
    if result["status"] != "ok" and any(f.get("status") in ("timeout", "stopped") for f in found.values()):
        result["status"] = "stopped"  # cut at its deadline: --resume-from runs it again
    if ctx.dry:
        result["goals"] = [f"(dry run, not judged) {g}" for g in result.get("goals", [])]
    result["runs"] = found
    return result


def run_stages(ctx: Context, report: Report, plan: list[Stage], end: float, pooled=None, tests=None,
               kept=None, resumed: bool = False) -> None:  # fmt: skip
    """Each stage of `plan` in order, cut at its deadline (a resumed run's shares when `resumed`), its result
    written to the report the moment it ends."""
    for stage, deadline in zip(plan, deadlines(plan, time.monotonic(), end, resumed).values()):
        t = time.monotonic()
        try:
            result = _stage_result(ctx, stage, deadline, pooled or {}, tests or {}, (kept or {}).get(stage.name, {}))
        except Exception as e:  # noqa: BLE001  (the report says which stage broke; later stages still run)
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        result.update(seconds=time.monotonic() - t, share_s=stage.share(resumed), deadline_in_s=deadline - t)
        report.add(stage.name, result)
        print(f"stage {stage.name}: {result['status']} ({result['seconds']:.0f} s)", flush=True)


def resumed(path: str | None) -> tuple[dict, dict]:
    """From a first run's report: the stages it finished (any status but "stopped"; not run again), and of each
    stopped stage whose runs stand alone (RUNS_KEPT) the runs that ended "ok" (only the others run again)."""
    if not path:
        return {}, {}
    earlier = json.loads(Path(path).read_text())["stages"]
    done = {k: {**v, "from": path} for k, v in earlier.items() if k != "setup" and v.get("status") != "stopped"}
    kept = {k: {n: {**r, "from": path} for n, r in v.get("runs", {}).items() if r.get("status") == "ok"}
            for k, v in earlier.items() if k in RUNS_KEPT and v.get("status") == "stopped"}  # fmt: skip
    return done, kept


def _dry_pool(ctx: Context, plan: list[Stage], end: float) -> dict:
    """Dry run: every stage's scenarios in one launch per config, the launches at once (the dry run's cost is
    process start-up and single-threaded CPU work: two cores overlap them)."""
    from concurrent.futures import ThreadPoolExecutor

    by_config: dict = {}
    for stage in plan:
        if stage.name in STAGES and STAGES[stage.name][0]:
            for sc in STAGES[stage.name][0](ctx):
                by_config.setdefault(sc["config"], []).append(sc)
    pooled: dict = {}
    with ThreadPoolExecutor(max(1, len(by_config))) as pool:
        jobs = [
            pool.submit(launch, ctx, c, g, f"dry-{c or 'none'}", end - time.monotonic()) for c, g in by_config.items()
        ]
        for job in jobs:
            pooled.update(job.result())
    return pooled


def _share_text(share: float | None) -> str:
    return "rest" if share is None else f"{share:g}"


def _header(args, argv, profile: dict, budget: float, plan: list[Stage]) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    return {"dry_run": args.dry_run, "device": torch.cuda.get_device_name(0) if cuda else platform.processor()
            or "cpu", "python": platform.python_version(), "shape": profile["shape_name"], "budget_s": budget,
            "command": " ".join(["python -m benchmarks.gpu", *(argv if argv is not None else sys.argv[1:])]),
            "resumed_from": args.resume_from,
            "plan": [f"{s.name}: {_share_text(s.share(bool(args.resume_from)))} s" for s in plan],
            "versions": {k: _version(k) for k in PACKAGES}}  # fmt: skip


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every stage at tiny shape on CPU (no CUDA)")
    p.add_argument("--out", default="gpu_check_out", help="report folder (default: ./gpu_check_out)")
    p.add_argument("--stages", default=",".join(NAMES), help=f"comma-separated, of {', '.join(NAMES)}; they run "
                   "in this order (of value) whatever order they are given in")  # fmt: skip
    p.add_argument("--resume-from", help="a partial gpu_report.json: run only the stages it did not finish")
    p.add_argument("--budget", type=float, help=f"seconds for the whole run (default on GPU: {DEFAULT_RUN_S} "
                   f"less {MARGIN_S} and the wheel install's seconds; dry: 900)")  # fmt: skip
    p.add_argument("--work", help="folder for the model and runs (default: /dev/shm/hf_fsdp_qlora_gpu_check when "
                   "it has room, else /tmp/...; dry: a temporary folder)")  # fmt: skip
    args = p.parse_args(argv)
    names = [s for s in args.stages.split(",") if s]
    if not names or any(s not in NAMES for s in names):
        p.error(f"--stages takes names of {', '.join(NAMES)}; got {args.stages!r}")
    return p, args, names


def main(argv=None) -> int:
    started = time.monotonic()
    p, args, names = _parse(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device is visible: run on a GPU machine, or add --dry-run for the tiny CPU form")
    profile = PROFILES["dry" if args.dry_run else "gpu"]
    out = Path(args.out).resolve()
    tmp = tempfile.TemporaryDirectory(prefix="gpu_check_") if args.dry_run and not args.work else None
    work = Path(args.work or (tmp.name if tmp else _work_dir(args.dry_run))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    installed = install_seconds(args.dry_run, work)
    budget = args.budget or (900.0 if args.dry_run else DEFAULT_RUN_S - MARGIN_S - (installed or 0))
    end = started + budget
    cuda = torch.cuda.is_available() and not args.dry_run
    ctx = Context(root=ROOT, work=work, model=work / f"model-{profile['shape_name']}", profile=profile,
                  dry=args.dry_run, device="cuda" if cuda else "cpu",
                  gpu_memory=torch.cuda.get_device_properties(0).total_memory if cuda else 80 * 10**9)  # fmt: skip
    done, kept = resumed(args.resume_from)
    plan = [s for s in plan_for(names) if s.name not in done]
    report = Report(out, _header(args, argv, profile, budget, plan))
    # The fast CUDA tests run beside the model build (small models: both fit the GPU; neither is a timing), so their
    # stage mostly waits for what already ran; the dry run collects both test stages then.
    early = TEST_STAGES if ctx.dry else ("tests",)
    tests = {s.name: stages.start_tests(ctx, s.name) for s in plan if s.name in early}
    t = time.monotonic()
    found = build_model(ctx, end)
    report.add("setup", {"status": found["status"], "install_s": installed, "build_s": time.monotonic() - t,
                         "seconds": time.monotonic() - started, "parameters": ctx.parameters, "work": str(work),
                         "error": found.get("error") or found.get("log_tail", "")[-500:]})  # fmt: skip
    for name, result in done.items():  # the first run's finished stages, kept as they were
        report.add(name, result)
    if found["status"] != "ok":
        for proc in tests.values():  # no stage will wait for them
            os.killpg(proc.pid, signal.SIGKILL)
        return 1
    run_stages(
        ctx,
        report,
        plan,
        end,
        _dry_pool(ctx, plan, end) if ctx.dry else None,
        tests,
        kept,
        resumed=bool(args.resume_from),
    )
    report.data["total_s"] = time.monotonic() - started
    report.write()
    print(f"report: {out / 'gpu_report.md'}")
    bad = [k for k, s in report.data["stages"].items() if s.get("status") not in ("ok", "not yet available")]
    return 1 if bad else 0
