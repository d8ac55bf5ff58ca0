"""README's main command: the CPU demo runs end to end (build, FSDP2 QLoRA on 2 CPU ranks, merge, check)."""

import os
import re
import subprocess

import pytest

from dist_utils import BIN, REPO, _env

pytestmark = pytest.mark.distributed


def test_cpu_demo(tmp_path):
    env = _env({"DEMO_OUTPUT": str(tmp_path / "demo"), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    proc = subprocess.run(
        ["bash", "examples/cpu_demo.sh"], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "FSDP engaged: {'fsdp1_units': 0, 'flat_params': 0, 'fsdp2_modules'" in out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"
    assert (tmp_path / "demo" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "demo" / "merged" / "config.json").is_file()
    assert "merged vs peft (unmerged) logits" in out
