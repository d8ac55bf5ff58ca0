"""The GPU check: one command that measures correctness, memory and speed of hf_fsdp_qlora on one GPU.

    python -m benchmarks.gpu                      # on a GPU machine: every stage, report into $OUT (or --out)
    python -m benchmarks.gpu --stages speed,capacity --budget 540
    python -m benchmarks.gpu --dry-run            # every stage at tiny shape on CPU (gloo, no CUDA): the CI form

Stages (docs/gpu-check.md): tests (pytest -m cuda), correctness (Llama 3.1 8B shape, each shipped GPU config and no
FSDP), memory (the doctor's plan against CUDA's peak), speed (against the stock recipe and torchtune), capacity
(largest shape, longest sequence). ``gpu_report.json`` and ``gpu_report.md`` are rewritten after every stage.
The whole run keeps to ``--budget`` seconds: after the model is built each stage gets its share of what is left,
and every launch is killed at its stage's deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import stages, stages_speed
from .launch import launch
from .profiles import PROFILES
from .report import Report

ROOT = Path(__file__).resolve().parents[2]
STAGES = {  # name -> (scenarios, summary); tests has no worker scenarios
    "tests": (None, None),
    "correctness": (stages.correctness_scenarios, stages.correctness_summary),
    "memory": (stages.memory_scenarios, stages.memory_summary),
    "speed": (stages_speed.speed_scenarios, stages_speed.speed_summary),
    "capacity": (stages_speed.capacity_scenarios, stages_speed.capacity_summary),
}
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


def run_scenarios(ctx: Context, scenarios: list[dict], deadline: float) -> dict:
    """Launch `scenarios`: consecutive ones that share a config and are not ``isolate`` share a launch (on CPU all
    of one config do); an ``isolate`` one gets its own. A ``chain`` stops at its first success (largest shape)."""
    results: dict = {}
    groups: list[tuple[str | None, list[dict]]] = []
    for sc in scenarios:
        alone = sc.get("isolate") and not ctx.dry
        if groups and not alone and groups[-1][0] == sc["config"] and not groups[-1][1][-1].get("_alone"):
            groups[-1][1].append(sc)
        else:
            groups.append((sc["config"], [{**sc, "_alone": alone}]))
    done_chains: set[str] = set()
    for config, group in groups:
        todo = [sc for sc in group if sc.get("chain") not in done_chains or ctx.dry]
        left = deadline - time.monotonic()
        if not todo:
            continue
        if left < 5:
            results.update({sc["name"]: {"status": "stopped", "note": "stage time box spent"} for sc in todo})
            continue
        results.update(launch(ctx, config, todo, todo[0]["name"], left))
        done_chains.update(sc["chain"] for sc in todo if sc.get("chain") and results[sc["name"]]["status"] == "ok")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every stage at tiny shape on CPU (no CUDA)")
    p.add_argument("--out", help="report folder (default: $OUT, else ./gpu_check_out)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default: 540 on GPU, 900 dry)")
    p.add_argument("--work", help="folder for the model and runs (default: /tmp/hf_fsdp_qlora_gpu_check; dry: a "
                   "temporary folder)")  # fmt: skip
    args = p.parse_args(argv)
    names = [s for s in args.stages.split(",") if s]
    if not names or any(s not in STAGES for s in names):
        p.error(f"--stages takes names of {', '.join(STAGES)}; got {args.stages!r}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device is visible: run on a GPU machine, or add --dry-run for the tiny CPU form")
    profile = PROFILES["dry" if args.dry_run else "gpu"]
    budget = args.budget or profile["budget_s"]
    started = time.monotonic()
    deadline = started + budget
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
    tmp = tempfile.TemporaryDirectory(prefix="gpu_check_") if args.dry_run and not args.work else None
    work = Path(args.work or (tmp.name if tmp else "/tmp/hf_fsdp_qlora_gpu_check")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.dry_run
    ctx = Context(root=ROOT, work=work, model=work / f"model-{profile['shape_name']}", profile=profile,
                  dry=args.dry_run, device="cuda" if cuda else "cpu",
                  gpu_memory=torch.cuda.get_device_properties(0).total_memory if cuda else 80 * 10**9)  # fmt: skip
    header = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name(0) if cuda else platform.processor()
              or "cpu", "python": platform.python_version(), "shape": profile["shape_name"], "budget_s": budget,
              "command": " ".join(["python -m benchmarks.gpu", *(argv if argv is not None else sys.argv[1:])]),
              "versions": {k: _version(k) for k in PACKAGES}}  # fmt: skip
    report = Report(out, header)
    t = time.monotonic()
    found = build_model(ctx, deadline)
    report.add("setup", {"status": found["status"], "seconds": time.monotonic() - t, "parameters": ctx.parameters,
                         "error": found.get("error") or found.get("log_tail", "")[-500:]})  # fmt: skip
    if found["status"] != "ok":
        return 1
    pooled: dict = {}
    tests = stages.start_tests(ctx) if ctx.dry and "tests" in names else None  # collection beside the launches
    if ctx.dry:  # one launch per config for every stage's scenarios: the dry run's cost is process start-up
        everything = [sc for n in names if STAGES[n][0] for sc in STAGES[n][0](ctx)]
        by_config: dict = {}
        for sc in everything:
            by_config.setdefault(sc["config"], []).append(sc)
        for config, group in by_config.items():
            pooled.update(launch(ctx, config, group, f"dry-{config or 'none'}", deadline - time.monotonic()))
    weights = profile["weights"]
    for i, name in enumerate(names):
        t = time.monotonic()
        share = weights[name] / sum(weights[n] for n in names[i:])
        stage_deadline = t + share * max(0.0, deadline - t)
        scenarios, summary = STAGES[name]
        try:
            if scenarios is None:
                result = stages.finish_tests(ctx, tests or stages.start_tests(ctx), max(10.0, stage_deadline - t))
            else:
                mine = scenarios(ctx)
                results = pooled if ctx.dry else run_scenarios(ctx, mine, stage_deadline)
                results = {sc["name"]: results.get(sc["name"], {"status": "not run"}) for sc in mine}
                result = summary(ctx, results)
                if ctx.dry:
                    result["goals"] = [f"(dry run, not judged) {g}" for g in result.get("goals", [])]
                result["runs"] = results
        except Exception as e:  # noqa: BLE001  (the report says which stage broke; later stages still run)
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.monotonic() - t
        report.add(name, result)
        print(f"stage {name}: {result['status']} ({result['seconds']:.0f} s)", flush=True)
    report.data["total_s"] = time.monotonic() - started
    report.write()
    print(f"report: {out / 'gpu_report.md'}")
    return 0 if all(s.get("status") == "ok" for s in report.data["stages"].values()) else 1
