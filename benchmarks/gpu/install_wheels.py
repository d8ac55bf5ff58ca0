"""Install the wheels of ``make gpu-wheels`` on a GPU machine without internet (stdlib only; runs before anything of ours is importable).

    python3 benchmarks/gpu/install_wheels.py .whl /tmp/site && export PYTHONPATH=/tmp/site

Unpacks every wheel of the folder into the target (nothing can be downloaded there; the wheels come without
their dependencies), except one whose distribution the machine already has at the same or a newer version (its
peft, say). A wheel is a zip of its import tree and its ``.dist-info``: unpacking it is what ``pip install --target
--no-deps --no-compile`` does with these wheels, less pip's start-up and checks, and less two things no check uses:
a wheel's ``.data/scripts`` (dill's command-line tools) and the bitsandbytes kernels built for other CUDA majors or
for ROCm (112 of bitsandbytes' 129 MB unpacked). The install counts against the check's budget: the seconds taken are
left in ``<target>/install_seconds.json`` for its report. A wheel with other ``.data`` parts goes through pip.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path


def _key(version: str):
    try:
        from packaging.version import Version

        return Version(version)
    except Exception:  # noqa: BLE001  (no packaging, or an odd version: compare numerically as far as possible)
        return tuple(int(x) if x.isdigit() else 0 for x in version.split("."))


def needed(folder: str) -> tuple[list[Path], list[str]]:
    """The wheels to install, and the machine's own distributions kept instead of a wheel of the folder."""
    wheels, kept = [], []
    for wheel in sorted(Path(folder).glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and _key(have) >= _key(version):
            kept.append(f"{name} {have} (wheel: {version})")
        else:
            wheels.append(wheel)
    return wheels, kept


def cuda_major() -> str | None:
    """The CUDA major the machine's torch was built for, read from torch/version.py (importing torch costs seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    version = Path(spec.origin).with_name("version.py") if spec and spec.origin else None
    found = re.search(r"^cuda[^=]*=\s*'(\d+)\.", version.read_text(), re.M) if version and version.exists() else None
    return found.group(1) if found else None


def wanted(name: str, major: str | None) -> bool:
    """Whether a wheel member is unpacked: not a ``.data/scripts`` file, not a bitsandbytes kernel for ROCm or
    another CUDA major (all are kept when the major is unknown)."""
    if re.match(r"[^/]+\.data/scripts/", name):
        return False
    kernel = re.fullmatch(r"bitsandbytes/libbitsandbytes_(rocm|cuda)(\d+)\.so", name)
    return not (kernel and major and (kernel.group(1) == "rocm" or not kernel.group(2).startswith(major)))


def install(wheels: list[Path], target: str) -> int:
    """Unzip each wheel's wanted members into `target`; one with other ``.data`` parts through pip."""
    Path(target).mkdir(parents=True, exist_ok=True)
    major, by_pip = cuda_major(), []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if wanted(n, major)]
            if any(re.match(r"[^/]+\.data/", n) for n in members):
                by_pip.append(str(wheel))
            else:
                z.extractall(target, members)
    if not by_pip:
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", target, *by_pip]  # fmt: skip
    return subprocess.run(cmd, check=False).returncode


def main(folder: str, target: str) -> int:
    started = time.monotonic()
    Path(target).mkdir(parents=True, exist_ok=True)
    wheels, kept = needed(folder)
    print("machine's own, kept: " + (", ".join(kept) or "none"))
    print("installing: " + ", ".join(w.name for w in wheels))
    rc = install(wheels, target) if wheels else 0
    seconds = time.monotonic() - started
    (Path(target) / "install_seconds.json").write_text(json.dumps({"seconds": seconds, "wheels": len(wheels)}))
    print(f"installed in {seconds:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
