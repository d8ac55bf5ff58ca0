"""``make gpu-wheels``: the wheels the bare GPU machine lacks (Python 3.12, manylinux x86_64), and the command it runs.

The device machine (../.library/device there) has torch 2.11, transformers 5.17, accelerate 1.15 and peft, and no
bitsandbytes, trl or datasets, and cannot download anything; the device tool carries an ignored folder of at most
64 MiB with each call. This fills that folder (``.whl/``) and checks its size; ``install_wheels.py`` installs it
there first.

    .venv/bin/python -m benchmarks.gpu.wheels            # download into .whl/ (pip, from PyPI), build ours, check
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ".whl"
LIMIT = 64 * 2**20  # the device tool's limit on what travels per call (wheels + working tree)
# What the machine lacks. peft travels too: install_wheels.py installs it only where the machine's is older.
WHEELS = ["bitsandbytes==0.50.2", "trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19",
          "peft==0.21.2"]  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
_INSTALL = f"python3 benchmarks/gpu/install_wheels.py {WHEEL_DIR} /tmp/site && export PYTHONPATH=/tmp/site || exit; "
RESULTS = "benchmarks/gpu/results"  # where each call's report is committed (docs/gpu-check.md)
# The device command: one call (`timeout_s` 480, `carry: [".whl"]`), every stage in order of value, each cut at its
# deadline (budget.PLAN). Under 2000 characters; make is left out (the bare image may lack it).
DEVICE_COMMAND = _INSTALL + "set -o pipefail; python3 -m benchmarks.gpu 2>&1 | tee $OUT/log.txt"
# The optional second call, when device time is left: the stages the first left stopped or unrun, from its report
# (copied into RESULTS, which travels with the working tree).
RESUME_COMMAND = (
    _INSTALL + f"set -o pipefail; python3 -m benchmarks.gpu --resume-from {RESULTS}/gpu_report.json 2>&1 | "
    "tee $OUT/log2.txt"
)
DEVICE_COMMANDS = [DEVICE_COMMAND, RESUME_COMMAND]


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
    if size > LIMIT - 4 * 2**20:  # leave room for the working tree
        problems.append(f"{dest} holds {size / 2**20:.1f} MiB of wheels; the device carries 64 MiB in all")
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
    print(f"device command (timeout_s 480, carry .whl):\n  {DEVICE_COMMAND}")
    print(f"optional second call, after copying the report into {RESULTS}/:\n  {RESUME_COMMAND}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
