"""The SLURM recipe (examples/slurm/train_qlora.sbatch): its printed launch lines and its per-node signal path."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dist_utils import BIN, REPO, _env

SBATCH = REPO / "examples" / "slurm" / "train_qlora.sbatch"


@pytest.mark.parametrize("nodes", [1, 2])
def test_sbatch_dry_run_launch_line(nodes, tmp_path):
    env = {
        "DRY_RUN": "1", "SLURM_JOB_NUM_NODES": str(nodes), "GPUS_PER_NODE": "8", "MASTER_ADDR": "node01",
        "OUTPUT_DIR": str(tmp_path / "run"), "STOP_AFTER": "11:50:00", "PATH": f"{BIN}:{os.environ['PATH']}",
    }  # fmt: skip
    proc = subprocess.run(
        ["bash", str(SBATCH)], check=False, capture_output=True, text=True, env=_env(env), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "HF_FSDP_QLORA_AUTO_RESUME=1" in lines[0] and "HF_FSDP_QLORA_STOP_AFTER=11:50:00" in lines[0]
    assert lines[1].startswith(f"srun --kill-on-bad-exit=0 --nodes={nodes} --ntasks-per-node=1 bash ")
    node_lines = [line for line in lines if line.startswith("node ")]
    assert len(node_lines) == nodes
    config = "fsdp2_qlora_multinode.yaml" if nodes > 1 else "fsdp2_qlora.yaml"
    for rank, line in enumerate(node_lines):
        words = line.split(": ", 1)[1].split()
        assert words[:2] == ["accelerate", "launch"]
        opts = dict(zip(words[2:-5:2], words[3:-5:2], strict=True))
        assert Path(opts["--config_file"]).name == config and Path(opts["--config_file"]).is_file()
        assert opts["--num_machines"] == str(nodes) and opts["--num_processes"] == str(8 * nodes)
        assert opts["--machine_rank"] == str(rank) and opts["--main_process_ip"] == "node01"
        assert words[-5:] == [
            "-m",
            "hf_fsdp_qlora.run",
            "examples/train_qlora.py",
            "--output_dir",
            str(tmp_path / "run"),
        ]
    assert "preempted.json" in lines[-1]
    syntax = subprocess.run(["bash", "-n", str(SBATCH)], check=False, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


STUB_LAUNCHER = """#!/bin/bash
# Stands in for `accelerate launch`: records its arguments, starts one "trainer" child and reports its status.
echo "$@" > "$STUB_DIR/args"
python3 -c '
import os, signal, sys, time
stub = os.environ["STUB_DIR"]
signal.signal(signal.SIGUSR1, lambda *a: (open(stub + "/trainer_got_usr1", "w").close(), os._exit(75)))
open(stub + "/trainer_ready", "w").close()
time.sleep(60)
os._exit(3)
' &
wait $!
echo "launcher survived, trainer status $?" > "$STUB_DIR/launcher_done"
"""


def test_sbatch_node_part_passes_usr1_to_the_trainers_only(tmp_path):
    """The per-node wrapper (NODE_ONLY=1 runs it without srun): a SIGUSR1 it receives reaches the trainer processes,
    while the launcher between them, which would die of it, ignores it."""
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    (stub_bin / "accelerate").write_text(STUB_LAUNCHER)
    (stub_bin / "accelerate").chmod(0o755)
    env = _env({
        "NODE_ONLY": "1", "SLURM_NODEID": "0", "STUB_DIR": str(tmp_path), "OUTPUT_DIR": str(tmp_path / "run"),
        "PATH": f"{stub_bin}:{BIN}:{os.environ['PATH']}",
    })  # fmt: skip
    wrapper = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while not (tmp_path / "trainer_ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "trainer_ready").exists(), wrapper.communicate(timeout=5)[0]
    wrapper.send_signal(signal.SIGUSR1)
    output = wrapper.communicate(timeout=30)[0].decode()
    assert wrapper.returncode == 0, (
        output,
        sorted(p.name for p in tmp_path.iterdir()),
    )  # the stub launcher exits 0 after reporting, as its last command
    assert (tmp_path / "trainer_got_usr1").exists(), output
    assert (tmp_path / "launcher_done").read_text().strip() == "launcher survived, trainer status 75"
    assert "--machine_rank 0" in (tmp_path / "args").read_text()
