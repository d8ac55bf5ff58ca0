"""``make gpu-wheels``: the wheels a GPU machine without internet needs (Python 3.12, manylinux x86_64).

A GPU machine that has Python, a CUDA build of torch (>= 2.11), transformers, accelerate and peft but cannot reach
PyPI lacks bitsandbytes, trl and datasets. On a machine with internet this fills ``.whl/`` (git-ignored) with them
and our own wheel, and checks the folder (one version per distribution, about 44 MiB in all); copy the repository
with its ``.whl/`` to the GPU machine, where ``install_wheels.py`` installs them before the check runs.

    .venv/bin/python -m benchmarks.gpu.wheels            # download into .whl/ (pip, from PyPI), build ours, check
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ".whl"
# About 44 MiB today; a folder much bigger means a wheel of the wrong build (another CUDA, debug symbols) came in.
LIMIT = 60 * 2**20
# What the machine lacks. peft comes too: install_wheels.py installs it only where the machine's is older.
WHEELS = ["bitsandbytes==0.50.2", "trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19",
          "peft==0.21.2"]  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
REPORT = "gpu_report"  # the report folder of the commands below (docs/gpu-check.md)
_INSTALL = f"python3 benchmarks/gpu/install_wheels.py {WHEEL_DIR} /tmp/site && export PYTHONPATH=/tmp/site || exit; "
# On the GPU machine without internet: the wheels installed, then every stage in order of value, each cut at its
# deadline (budget.PLAN), the console kept beside the report. Plain shell: make may be missing there.
OFFLINE_COMMAND = (
    _INSTALL
    + f"mkdir -p {REPORT} && set -o pipefail; python3 -m benchmarks.gpu --out {REPORT} 2>&1 | tee {REPORT}/log.txt"
)
# The optional second run: the stages the first left stopped or unrun, from its report, into a second folder.
RESUME_COMMAND = (
    _INSTALL + f"mkdir -p {REPORT}_2 && set -o pipefail; python3 -m benchmarks.gpu --resume-from "
    f"{REPORT}/gpu_report.json --out {REPORT}_2 2>&1 | tee {REPORT}_2/log.txt"
)
OFFLINE_COMMANDS = [OFFLINE_COMMAND, RESUME_COMMAND]


def download(dest: Path) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *WHEELS],
                   check=True)  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dest), str(ROOT)],
                   check=True)  # fmt: skip


def check(dest: Path) -> list[str]:
    """Problems with the folder: more than one version of a distribution (pip refuses), or over the size limit."""
    problems = []
    names: dict[str, list[str]] = {}
    for wheel in dest.glob("*.whl"):
        names.setdefault(wheel.name.split("-")[0].lower().replace("_", "-"), []).append(wheel.name)
    problems += [
        f"several versions of {n}: {', '.join(v)} (delete all but one)" for n, v in names.items() if len(v) > 1
    ]
    size = sum(w.stat().st_size for w in dest.glob("*.whl"))
    if size > LIMIT:
        problems.append(f"{dest} holds {size / 2**20:.1f} MiB of wheels, over {LIMIT // 2**20} MiB: look for a "
                        "wrong build among them (another CUDA, another platform)")  # fmt: skip
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", default=str(ROOT / WHEEL_DIR))
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    if not args.check_only:
        download(dest)
    problems = check(dest)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    size = sum(w.stat().st_size for w in dest.glob("*.whl"))
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    print(
        f"copy the repository with {WHEEL_DIR}/ to the GPU machine and run there, from its root:\n  {OFFLINE_COMMAND}"
    )
    print(f"optional second run, for the stages the first left stopped:\n  {RESUME_COMMAND}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
