"""`make test-slurm`: examples/slurm/train_qlora.sbatch through real sbatch on a throwaway one-host SLURM cluster.

Five jobs at once (a tiny Llama, trl's own sft.py, real FSDP2 on gloo, CPU only), each compared with the first:

  reference   1 node x 2 ranks, uninterrupted
  trained     1 node x 2 ranks, SIGUSR1 to the batch script once a step is logged (a checkpoint, then the requeue)
  trained_2n  2 nodes x 1 rank, the same
  at_0.2s     SIGUSR1 0.2 s after the job started running (before the trainers start)
  at_4s       SIGUSR1 4 s after it started (while the trainers start or load the model)

Each must end COMPLETED (the preempted ones requeued once, `Restarts=1`) with an adapter equal, bit for bit, to the
reference's. The cluster is stopped and its state folder removed at the end, whatever happened. Exit status 0 when
every check passed; a summary line with the wall time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "tests")]

from cluster import SlurmCluster, ensure_installed  # noqa: E402

SBATCH = REPO / "examples" / "slurm" / "train_qlora.sbatch"
MAX_STEPS = 6
CASES = {  # name: (nodes, ranks per node, when the signal comes)
    "reference": (1, 2, None),
    "trained": (1, 2, "loss"),
    "trained_2n": (2, 1, "loss"),
    "at_0.2s": (1, 2, 0.2),
    "at_4s": (1, 2, 4.0),
}
DEADLINE_S = 600


def _job_env(cluster, state: Path, name: str, ranks: int, port: int, model: Path, data: Path) -> dict:
    import trl.scripts.sft

    out = state / "runs" / name
    sft_args = [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
        "--use_peft", "--load_in_4bit", "--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "2",
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--learning_rate", "1e-3",
    ]  # fmt: skip
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("ACCELERATE_", "SLURM_JOB", "FSDP_"))}
    env.update({
        "CONFIG_NAME": "cpu_fsdp2_rehearsal", "GPUS_PER_NODE": str(ranks), "MASTER_ADDR": "127.0.0.1",
        "MAIN_PORT": str(port), "OUTPUT_DIR": str(out), "SCRIPT": trl.scripts.sft.__file__,
        "SCRIPT_ARGS": " ".join(sft_args), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })  # fmt: skip
    return env


def _jobs(cluster) -> dict[str, dict]:
    """Every job's fields, by job id (one scontrol call: polled often, on 2 cores)."""
    found = {}
    for line in cluster.run("scontrol", "show", "job", "-o", check=False).splitlines():
        info = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in info:
            found[info["JobId"]] = info
    return found


def _submit(cluster, state, name, nodes, ranks, port, model, data) -> str:
    env = _job_env(cluster, state, name, ranks, port, model, data)
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}", "--gpus-per-node=0",
           "--cpus-per-task=1", "--time=00:30:00", f"--output={state}/{name}.out", f"--chdir={REPO}",
           str(SBATCH)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def _signal_when_due(cluster, state, jobs, pending, now) -> None:
    """Send each case's SIGUSR1 (what `--signal=B:USR1@...` sends) when it is due; removes it from `pending`."""
    for name in list(pending):
        job_id, when = jobs[name], CASES[name][2]
        if now.get(job_id, {}).get("JobState") != "RUNNING":
            continue
        if isinstance(when, float):
            started = pending[name] = pending[name] or time.time()  # first seen running (polled every 0.05 s)
            if time.time() - started < when:
                continue
        else:
            log = state / f"{name}.out"
            if not log.exists() or "'loss'" not in log.read_text(errors="replace"):
                continue
        cluster.run("scancel", "--batch", "--signal=USR1", job_id)
        print(f"[{time.strftime('%X')}] {name}: SIGUSR1 sent (job {job_id}, {when})", flush=True)
        del pending[name]


def _adapter(state: Path, name: str):
    from safetensors.torch import load_file

    return load_file(str(state / "runs" / name / "adapter_model.safetensors"))


def _verdicts(cluster, state, jobs) -> list[str]:
    import torch

    problems = []
    reference = _adapter(state, "reference") if (state / "runs/reference/adapter_model.safetensors").exists() else None
    now = _jobs(cluster)
    for name, job_id in jobs.items():
        info, log = now.get(job_id, {}), (state / f"{name}.out").read_text(errors="replace")
        restarts = "0" if CASES[name][2] is None else "1"
        if info.get("JobState") != "COMPLETED" or info.get("Restarts") != restarts:
            problems.append(f"{name}: {info.get('JobState')} Restarts={info.get('Restarts')} (expected COMPLETED, "
                            f"Restarts={restarts})\n{log[-3000:]}")  # fmt: skip
            continue
        path = re.findall(r"(requeueing job \d+|before training started|before the trainers started)", log)
        print(f"{name}: COMPLETED, Restarts={info['Restarts']}; {sorted(set(path)) or 'uninterrupted'}")
        if reference is None or name == "reference":
            continue
        found = _adapter(state, name)
        same = found.keys() == reference.keys() and all(torch.equal(found[k], reference[k]) for k in reference)
        if not same:
            diff = max(float((found[k].float() - reference[k].float()).abs().max()) for k in reference)
            problems.append(f"{name}: adapter differs from the reference's (max |diff| {diff:.3g})")
    if reference is None:
        problems.append("reference: no adapter")
    return problems


def main() -> int:
    started = time.time()
    installed_s = ensure_installed()

    state = Path(tempfile.mkdtemp(prefix="hfq-slurm-"))
    try:
        problems = _run(state)
    finally:
        subprocess.run(["rm", "-rf", str(state)], check=False)
    wall = time.time() - started
    print(f"test-slurm: {'FAILED' if problems else 'passed'}: {len(CASES)} jobs in {wall:.0f} s"
          f" (SLURM install {installed_s:.0f} s)")  # fmt: skip
    for problem in problems:
        print(problem)
    return 1 if problems else 0


def _run(state: Path) -> list[str]:
    from recipe_fixtures import build_chat_dataset, build_recipe_model

    with SlurmCluster(state / "cluster") as cluster:
        model, data = build_recipe_model(state / "model"), build_chat_dataset(state / "chat")
        jobs = {}
        for port, (name, (nodes, ranks, _)) in enumerate(CASES.items(), start=29611):
            jobs[name] = _submit(cluster, state, name, nodes, ranks, port, model, data)
        pending = {name: None for name, case in CASES.items() if case[2] is not None}
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline:
            now = _jobs(cluster)
            _signal_when_due(cluster, state, jobs, pending, now)
            states = [now.get(j, {}).get("JobState") for j in jobs.values()]
            if not pending and all(s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") for s in states):
                break
            timed = any(isinstance(CASES[n][2], float) for n in pending)
            time.sleep(0.05 if timed else 0.2 if pending else 1.0)
        problems = _verdicts(cluster, state, jobs)
        if problems:
            print(cluster.logs())
        return problems


if __name__ == "__main__":
    sys.exit(main())
