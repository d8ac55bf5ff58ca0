"""Where the benchmarks start their contestants' processes: one seam, so the smoke tests can start them cheaper.

Each benchmark builds the command a user would run (``accelerate launch --config_file ...`` for FSDP ranks,
``torchrun`` for DDP ranks, plain ``python`` for one process) and hands it to :func:`run`, which runs it as a
subprocess. The suite's smoke tests call a benchmark's ``main()`` in the pytest process and set ``RUNNER`` to the
suite's launcher (tests/bench_runner.py), which reads the same command and forks the ranks from a process that has
the stack imported already (tests/fork_launch.py): the same ranks, launch environment and gloo groups, without the
launcher's and every rank's imports. Users' runs never set it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (command, env, timeout) -> CompletedProcess with text stdout/stderr; None: run the command as a subprocess.
RUNNER: Callable[[list[str], dict, float], subprocess.CompletedProcess] | None = None


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run one launch `cmd` from the repository root with `env`; its output captured as text, never raising on a
    non-zero exit (the benchmark reads the status and the rank files)."""
    if RUNNER is not None:
        return RUNNER(cmd, env, timeout)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=str(ROOT))
