"""The declared ranges: pyproject's floors are constraints-floors.txt's pins, and under `make test-floors` the
floors are what is imported (so the floors job cannot pass on the main venv's newer versions by mistake)."""

from __future__ import annotations

import os
import re
from importlib import metadata

import pytest
from dist_utils import REPO


def _floors() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints-floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = (x.strip() for x in line.split("=="))
            pins[name] = version
    return pins


def test_pyproject_floors_are_the_tested_floors():
    text = (REPO / "pyproject.toml").read_text()
    declared = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)', text))
    floors = _floors()
    for name, version in floors.items():
        if name == "torch":  # the GPU machine's 2.11 (gpu-check); CPU machines only have 2.13.0's CPU wheel
            assert declared[name] == "2.11", declared
            continue
        assert declared.get(name) == version, (name, declared.get(name), version)


@pytest.mark.skipif(not os.environ.get("HF_FSDP_QLORA_FLOORS"), reason="only under `make test-floors`")
def test_floors_are_what_is_installed():
    import transformers

    for name, version in _floors().items():
        if name != "torch":
            assert metadata.version(name) == version, name
    assert transformers.__version__ == _floors()["transformers"]
