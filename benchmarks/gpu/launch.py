"""Launching the worker the way users launch training: plain ``python`` without FSDP, ``accelerate launch`` with a
shipped config (``--num_processes 1`` on one GPU). On CPU (dry run) the shipped GPU configs are rewritten for CPU
ranks (``use_cpu: true``, no module-state sync) and everything else in them is kept.

Each launch runs in its own process group with a timeout: on expiry the whole group is killed, so a hung CUDA or
collective call never hangs the check; the scenarios finished before are read from the worker's JSON lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_worker.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_file(name: str, work: Path, dry: bool) -> Path:
    """The shipped accelerate config `name`; on CPU a copy made runnable on CPU ranks."""
    shipped = ROOT / "accelerate_configs" / f"{name}.yaml"
    if not dry:
        return shipped
    config = yaml.safe_load(shipped.read_text())
    config["use_cpu"] = True
    # accelerate looks for a GPU-like device when either is on (see accelerate_configs/cpu_fsdp2_rehearsal.yaml).
    config["fsdp_config"].update(fsdp_cpu_ram_efficient_loading=False, fsdp_sync_module_states=False)
    path = work / "configs" / f"{name}-cpu.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def launch(ctx, config: str | None, scenarios: list[dict], tag: str, timeout: float) -> dict[str, dict]:
    """Run `scenarios` in one launch under `config` (None: plain python); returns each scenario's result by name.

    A scenario the launch did not finish gets ``status`` "timeout" (the launch ran out of time) or "crashed" (the
    process died), with the end of the launch's log.
    """
    out = ctx.work / "runs" / tag
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("results-rank*.jsonl"):
        old.unlink()  # a launch is never read from an earlier run's files
    spec = out / "spec.json"
    spec.write_text(
        json.dumps({"model": str(ctx.model), "out": str(out), "work": str(ctx.work), "scenarios": scenarios})
    )
    if config is None:
        cmd = [sys.executable, str(WORKER), str(spec)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(config_file(config, ctx.work, ctx.dry)), "--num_processes", "1", "--main_process_port",
               str(_port()), str(WORKER), str(spec)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(ctx.profile["threads"]), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")  # fmt: skip
    env.pop("ACCELERATE_USE_FSDP", None)
    log = out / "log.txt"
    ended = "crashed"
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True
        )
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            ended = "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results = {}
    rows = out / "results-rank0.jsonl"
    if rows.exists():
        for line in rows.read_text().splitlines():
            found = json.loads(line)
            results[found["name"]] = found
    tail = log.read_text(errors="replace")[-2500:]
    for sc in scenarios:
        if sc["name"] not in results:
            results[sc["name"]] = {"name": sc["name"], "status": ended, "exit": proc.returncode, "log_tail": tail}
        elif results[sc["name"]]["status"] != "ok":
            results[sc["name"]]["log_tail"] = tail
    return results
