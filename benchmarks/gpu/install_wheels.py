"""Install the carried wheels on the GPU machine (stdlib + pip only; runs before anything of ours is importable).

    python3 benchmarks/gpu/install_wheels.py .whl /tmp/site && export PYTHONPATH=/tmp/site

Installs every wheel of the folder into the target with ``--no-index --no-deps`` (nothing can be downloaded there),
except one whose distribution the machine already has at the same or a newer version (its peft, say).
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path


def _key(version: str):
    try:
        from packaging.version import Version

        return Version(version)
    except Exception:  # noqa: BLE001  (no packaging, or an odd version: compare numerically as far as possible)
        return tuple(int(x) if x.isdigit() else 0 for x in version.split("."))


def main(folder: str, target: str) -> int:
    wheels, kept = [], []
    for wheel in sorted(Path(folder).glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and _key(have) >= _key(version):
            kept.append(f"{name} {have} (carried {version})")
        else:
            wheels.append(str(wheel))
    print("machine's own, kept: " + (", ".join(kept) or "none"))
    print("installing: " + ", ".join(Path(w).name for w in wheels))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", target, *wheels]  # fmt: skip
    return subprocess.run(cmd, check=False).returncode if wheels else 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
