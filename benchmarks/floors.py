"""Print the pins of a constraints file that differ from what is installed (torch excepted): what the floors
overlay must install (``make test-floors``). Stdlib only."""

from __future__ import annotations

import sys
from importlib import metadata


def differing(path: str) -> list[str]:
    pins = []
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        line = line.split("#")[0].strip()
        if "==" not in line:
            continue
        name, version = (x.strip() for x in line.split("=="))
        if name == "torch":  # only torch 2.13.0's CPU wheel exists on CPU machines; its floor is checked on the GPU
            continue
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            pins.append(f"{name}=={version}")
    return pins


if __name__ == "__main__":
    print(" ".join(differing(sys.argv[1])))
