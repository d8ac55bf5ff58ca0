"""The benchmarks' smoke tests: a benchmark's ``main()`` run in the pytest process, its launches forked.

A benchmark builds the command a user would run and hands it to ``benchmarks/_launch.py``'s ``run``. Here that
command is read back (the accelerate config file and rank count of ``accelerate launch``, the rank count of
``torchrun``) and launched through tests/dist_utils.py's fork launcher: the ranks are forked from this process's
fork server, which imported torch, transformers, peft, bitsandbytes and accelerate once, with the environment the
real launcher gives them (tests/fork_launch.py; TESTS_FORK_LAUNCH=0: the real launcher, as for every launch of
the suite). A plain ``python`` command (one process, no launcher) runs as it is. The benchmark's own driver (the
model build, the tables) skips its interpreter start too. Every contestant still trains in its own real gloo ranks,
and the benchmark still refuses one that did not engage as it claims.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import dist_utils

BENCHMARKS = dist_utils.REPO / "benchmarks"


def _accelerate(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser()
    p.add_argument("--config_file", required=True)
    p.add_argument("--num_processes", type=int)
    p.add_argument("--main_process_port")
    return p.parse_known_args(args)


def _torchrun(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc-per-node", dest="nproc", type=int, required=True)
    p.add_argument("--master-addr")
    p.add_argument("--master-port")
    return p.parse_known_args(args)


def _extra_env(env: dict) -> dict | None:
    """What the benchmark's `env` sets beyond this process's (dist_utils adds it to its launch environment); None
    where it unsets a variable of ours that dist_utils would keep (then the command runs as it is)."""
    dropped = set(os.environ) - set(env) - {"ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU"}  # dist_utils drops those
    if dropped:
        return None
    # PYTHONPATH: the benchmark puts the repository first; the fork launches get the suite's (the package and tests).
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k != "PYTHONPATH"}


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """benchmarks/_launch.py's RUNNER: `cmd` as a fork launch where it is `accelerate launch` or `torchrun`."""
    tool, extra = Path(cmd[0]).name, _extra_env(env)
    launched.append(cmd)
    if extra is not None and tool == "accelerate" and cmd[1] == "launch":
        opts, rest = _accelerate(cmd[2:])
        return dist_utils.accelerate_launch(opts.config_file, rest[0], *rest[1:], timeout=int(timeout), env=extra,
                                            num_processes=opts.num_processes)  # fmt: skip
    if extra is not None and tool == "torchrun":
        opts, rest = _torchrun(cmd[1:])
        return dist_utils.torchrun(rest[0], *rest[1:], nproc=opts.nproc, timeout=int(timeout), env=extra)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=str(dist_utils.REPO))  # fmt: skip


launched: list[list[str]] = []  # the commands the benchmark built, as a user's run would launch them


@contextmanager
def benchmark(name: str):
    """Import benchmarks/NAME.py (its folder first on sys.path, as when it runs as a script) with its launches
    going through :func:`run`; yields the module, whose ``main(argv)`` the test calls."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _launch

        module = __import__(name)
        launched.clear()
        _launch.RUNNER = run
        try:
            yield module
        finally:
            _launch.RUNNER = None
    finally:
        sys.path.remove(str(BENCHMARKS))


def one_fsdp2_launch_smoke(name: str, argv: list[str], capsys) -> tuple[dict, str]:
    """benchmarks/NAME.py's ``main(argv)`` with ``--one-launch --json``: it succeeds, builds the one command a user's
    run launches (``accelerate launch`` with the CPU FSDP2 rehearsal config), and prints its JSON; (that JSON, the
    whole output)."""
    with benchmark(name) as bench:
        assert bench.main([*argv, "--one-launch", "--json"]) == 0
    out = capsys.readouterr().out
    assert [Path(c[0]).name for c in launched] == ["accelerate"]
    assert "cpu_fsdp2_rehearsal.yaml" in " ".join(launched[0])  # the command a user's run launches
    return json.loads(out[out.index("\n{\n") :]), out
