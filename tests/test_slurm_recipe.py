"""The SLURM recipe (examples/slurm/train_qlora.sbatch), run as a plain bash script with the SLURM variables set here.

- its printed launch lines (DRY_RUN), and its default SCRIPT_ARGS accepted by its default SCRIPT;
- its per-node wrapper passes SIGUSR1 to the trainers only (a stub launcher);
- a stale preempted.json does not requeue a job that fails before training (a stub launcher);
- the whole job for real, without a SLURM install: two "nodes" on localhost (LOCAL_NODES=1, one CPU rank each, real
  FSDP2 on gloo), trl's own sft.py as SCRIPT, SIGUSR1 to the batch script -> both ranks exit 75 -> one checkpoint
  -> the requeue taken (REQUEUE_CMD records it) -> the same command resumes from that checkpoint and ends.
  That the resumed adapter equals an uninterrupted run's, bit for bit, is `make test-slurm`'s to check
  (tests/slurm/check_recipe.py: real sbatch, 1x2 and 2x1 nodes, each compared with an uninterrupted job; CI runs it
  right after `make test`) and test_preemption's (the same `-m hf_fsdp_qlora.run` route, every loss and the final
  adapter against a baseline): this test no longer trains an uninterrupted reference job beside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dist_utils import BIN, REPO, _env, free_port

SBATCH = REPO / "examples" / "slurm" / "train_qlora.sbatch"
RECORD_REQUEUE = """#!/bin/bash
echo "$@" >> "$(dirname "$0")/requeued"
"""


def _requeue_recorder(folder: Path) -> Path:
    """A REQUEUE_CMD that records each call (its arguments, a line each) in folder/requeued."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "requeue"
    script.write_text(RECORD_REQUEUE)
    script.chmod(0o755)
    return script


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
        opts = dict(zip(words[2:-11:2], words[3:-11:2], strict=True))
        assert Path(opts["--config_file"]).name == config and Path(opts["--config_file"]).is_file()
        assert opts["--num_machines"] == str(nodes) and opts["--num_processes"] == str(8 * nodes)
        assert opts["--machine_rank"] == str(rank) and opts["--main_process_ip"] == "node01"
        assert words[-11:-8] == ["-m", "hf_fsdp_qlora.run", "examples/train_qlora.py"]
        # The defaults are the arguments of their script: it gets past its argparse (it stopped there), with the
        # recipe's settings file (a checkpoint every 100 steps: tests/test_recipes_settings.py).
        args = _train_qlora_parser()(words[-8:])
        assert (args.model, args.data, args.output) == ("meta-llama/Llama-3.1-8B", "examples/data/capitals.jsonl",
                                                        str(tmp_path / "run"))  # fmt: skip
        assert args.config == "examples/recipes/slurm-multinode.yaml"
        assert args.training["save_strategy"] == "steps" and args.training["save_steps"] == 100
    assert "preempted.json" in lines[-1] and lines[-1].endswith(": scontrol requeue")
    syntax = subprocess.run(["bash", "-n", str(SBATCH)], check=False, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def _train_qlora_parser():
    spec = importlib.util.spec_from_file_location("train_qlora_example", REPO / "examples" / "train_qlora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


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


FAILING_LAUNCHER = """#!/bin/bash
# Stands in for `accelerate launch` of a job that fails while loading (before train() could remove the marker).
echo "node $SLURM_NODEID: out of memory while loading" >&2
exit 1
"""


def test_sbatch_stale_marker_does_not_requeue_a_failing_job(tmp_path):
    """A preempted.json from an earlier job is removed before the launch: a job that then fails before training
    ends with its failure, not with a requeue (before: requeued up to MAX_REQUEUES times)."""
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    (stub_bin / "accelerate").write_text(FAILING_LAUNCHER)
    (stub_bin / "accelerate").chmod(0o755)
    out = tmp_path / "run"
    out.mkdir()
    (out / "preempted.json").write_text(json.dumps({"checkpoint": str(out / "checkpoint-4"), "step": 4}))
    env = _env({
        "LOCAL_NODES": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_RESTART_COUNT": "3",
        "GPUS_PER_NODE": "1", "OUTPUT_DIR": str(out), "REQUEUE_CMD": str(_requeue_recorder(tmp_path / "rq")),
        "PATH": f"{stub_bin}:{BIN}:{os.environ['PATH']}",
    })  # fmt: skip
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, check=False)
    found = {
        "status": proc.returncode,
        "requeued": (tmp_path / "rq" / "requeued").is_file(),
        "marker": (out / "preempted.json").exists(),
        "nodes failed": sorted(line for line in proc.stderr.splitlines() if "out of memory" in line),
    }
    assert found == {
        "status": 1, "requeued": False, "marker": False,
        "nodes failed": [f"node {n}: out of memory while loading" for n in (0, 1)],
    }, (proc.stdout, proc.stderr)  # fmt: skip


# ---- the whole job, for real ----

MAX_STEPS = 6


def _trl_sft() -> str:
    import trl.scripts.sft

    return trl.scripts.sft.__file__


def _job_env(tmp_path, name, models, data, requeue):
    out = tmp_path / name
    sft_args = [
        "--model_name_or_path", str(models), "--dataset_name", str(data), "--output_dir", str(out),
        "--use_peft", "--load_in_4bit", "--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "2",
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--learning_rate", "1e-3",
    ]  # fmt: skip
    return out, _env({
        "LOCAL_NODES": "1", "SLURM_JOB_ID": f"{name}-4242", "SLURM_JOB_NUM_NODES": "2", "GPUS_PER_NODE": "1",
        "CONFIG_NAME": "cpu_fsdp2_rehearsal", "MAIN_PORT": str(free_port()), "OUTPUT_DIR": str(out),
        "SCRIPT": _trl_sft(), "SCRIPT_ARGS": " ".join(sft_args), "REQUEUE_CMD": str(requeue),
        "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}:{os.environ['PATH']}",
    })  # fmt: skip


@pytest.mark.distributed
def test_sbatch_job_preempted_requeued_and_resumed_on_two_local_nodes(tmp_path):
    from recipe_fixtures import build_chat_dataset, build_recipe_model

    models, data = build_recipe_model(tmp_path / "model"), build_chat_dataset(tmp_path / "chat")
    requeue = _requeue_recorder(tmp_path / "rq")
    out, env = _job_env(tmp_path, "run", models, data, requeue)
    walls, started = {}, time.time()
    job = subprocess.Popen(["bash", str(SBATCH)], env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, signalled = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            if signalled is None and "'loss'" in line:  # step 1 is logged: training runs; SLURM's warning now
                job.send_signal(signal.SIGUSR1)
                signalled = time.time()
        job.wait(timeout=60)
        walls["interrupted"] = time.time() - started
    finally:
        job.kill()
    output = "".join(lines)
    assert signalled is not None, output[-6000:]
    assert job.returncode == 0, output[-6000:]  # requeued: the batch script itself ends well
    assert output.count("exitcode  : 75") == 2, output[-6000:]  # both ranks, one per node, stopped for a requeue
    marker = json.loads((out / "preempted.json").read_text())
    step = marker["step"]
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert 1 <= step < MAX_STEPS and checkpoints == [f"checkpoint-{step}"], (marker, checkpoints)
    assert (out / checkpoints[0] / "trainer_state.json").is_file()
    assert "requeueing job run-4242" in output
    assert (tmp_path / "rq" / "requeued").read_text().split() == ["run-4242"]

    # The requeued job: the same command (SLURM counts the restart), resumed from the checkpoint to the end.
    resumed = subprocess.run(["bash", str(SBATCH)], env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=str(REPO),
                             capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    walls["resumed"] = time.time() - started
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text[-6000:]
    assert f"resuming from {out / checkpoints[0]}" in text, text[-6000:]
    assert not (out / "preempted.json").exists()
    assert (tmp_path / "rq" / "requeued").read_text().split() == ["run-4242"]  # no second requeue
    assert "hf_fsdp_qlora: FSDP2 engaged on 2 rank(s)" in text
    assert (out / "adapter_model.safetensors").is_file(), sorted(p.name for p in out.iterdir())
    print(f"checkpoint at step {step}; walls s {walls}")


# ---- signals at any moment, and the requeue limit (issue 39) ----

SLOW_CONFIG = """#!/bin/bash
# Stands in for `hf-fsdp-qlora config NAME`: slow, as a cold Python start on shared storage is.
sleep 2
echo "$STUB_DIR/config.yaml"
"""

RECORDING_LAUNCHER = """#!/bin/bash
# Stands in for `accelerate launch`: records that the trainers were started.
echo "$@" >> "$STUB_DIR/launched"
"""


def _stub_bin(tmp_path, **scripts) -> Path:
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (stub_bin / name).write_text(text)
        (stub_bin / name).chmod(0o755)
    return stub_bin


def test_sbatch_signal_before_the_launch_requeues_at_once(tmp_path):
    """SIGUSR1 0.3 s after the job started, while it still resolves the accelerate config: the batch script survives
    (before: bash died of it, the job ended FAILED with `Broken pipe`), starts no trainers and requeues the job."""
    stub_bin = _stub_bin(tmp_path, **{"hf-fsdp-qlora": SLOW_CONFIG, "accelerate": RECORDING_LAUNCHER})
    env = _env({
        "LOCAL_NODES": "1", "SLURM_JOB_ID": "78", "SLURM_JOB_NUM_NODES": "1", "GPUS_PER_NODE": "1",
        "STUB_DIR": str(tmp_path), "OUTPUT_DIR": str(tmp_path / "run"),
        "REQUEUE_CMD": str(_requeue_recorder(tmp_path / "rq")), "PATH": f"{stub_bin}:{BIN}:{os.environ['PATH']}",
    })  # fmt: skip
    job = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.3)
    job.send_signal(signal.SIGUSR1)
    output = job.communicate(timeout=30)[0]
    requeued = tmp_path / "rq" / "requeued"
    found = {
        "status": job.returncode,
        "requeued": requeued.read_text().split() if requeued.exists() else [],
        "launched": (tmp_path / "launched").exists(),
    }
    assert found == {"status": 0, "requeued": ["78"], "launched": False}, output
    assert "SIGUSR1 before the trainers started (no new checkpoint); requeueing job 78" in output, output


PREEMPTED_LAUNCHER = """#!/bin/bash
# Stands in for `accelerate launch` of trainers that were preempted: marker written, status 75 (reported as 1).
echo '{"checkpoint": null, "step": null, "reason": "SIGUSR1", "new_checkpoint": false}' > "$OUTPUT_DIR/preempted.json"
exit 1
"""


@pytest.mark.parametrize("restarts", [1, 2])
def test_sbatch_max_requeues_is_said_in_one_line(restarts, tmp_path):
    """With SLURM_RESTART_COUNT at MAX_REQUEUES, a preempted job is not requeued, and one log line says so and why."""
    stub_bin = _stub_bin(tmp_path, accelerate=PREEMPTED_LAUNCHER)
    out = tmp_path / "run"
    out.mkdir()
    env = _env({
        "LOCAL_NODES": "1", "SLURM_JOB_ID": "79", "SLURM_JOB_NUM_NODES": "1", "GPUS_PER_NODE": "1",
        "SLURM_RESTART_COUNT": str(restarts), "MAX_REQUEUES": "2", "OUTPUT_DIR": str(out),
        "REQUEUE_CMD": str(_requeue_recorder(tmp_path / "rq")), "PATH": f"{stub_bin}:{BIN}:{os.environ['PATH']}",
    })  # fmt: skip
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, check=False)
    requeued = (tmp_path / "rq" / "requeued").exists()
    said = [line for line in proc.stdout.splitlines() if "MAX_REQUEUES=2 reached" in line]
    if restarts < 2:
        assert (proc.returncode, requeued, said) == (0, True, []), proc.stdout + proc.stderr
    else:
        assert (proc.returncode, requeued, len(said)) == (1, False, 1), proc.stdout + proc.stderr
        assert "not requeueing job 79" in said[0] and "SLURM_RESTART_COUNT=2" in said[0], said
