"""Preemption-safe training (issue 20): a signal or a deadline becomes one agreed checkpoint, and the same command
resumes it bit for bit.

Per FSDP version, one uninterrupted baseline launch and a chain of launches of ONE command on one output_dir
(2 CPU ranks, gloo, real FSDP1/FSDP2, 10 steps of 2 micro-steps). Every fault hits ONE rank only:

  FSDP1, FSDPQLoRATrainer + auto_resume=True:
    SIGTERM between micro-steps of a seeded random step -> SIGTERM in evaluation -> a genuine external SIGUSR1 from
    this process while a checkpoint is being written -> SIGKILL in the middle of a write -> runs to the end
  FSDP2, a plain Trainer script under `-m hf_fsdp_qlora.run` with HF_FSDP_QLORA_AUTO_RESUME=1:
    SIGUSR1 between micro-steps of a seeded random step -> SIGTERM in evaluation -> SIGTERM inside a write ->
    the stop_after deadline -> runs to the end

After each stop: the job ended within GRACE_S of the signal, both ranks exited with status 75, the checkpoint is
complete and the latest one, the marker names it. At the end: every micro-step loss any run computed equals the
baseline's, and the final adapter equals the baseline's, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from dist_utils import BIN, CONFIGS, REPO, SCRIPTS, _env, free_port, read_results
from tiny_models import build_tiny_model

pytestmark = pytest.mark.distributed

GRACE_S = 30  # torch elastic's and SLURM's default wait between SIGTERM and SIGKILL
WORKER = SCRIPTS / "preempt_worker.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root / "llama", "llama")
    return root


class Chain:
    def __init__(self, version, route, models, root):
        self.version, self.route, self.models, self.root = version, route, models, root
        self.out, self.record = root / "run", root / "record"

    def command(self, run, fault, out=None, record=None):
        launcher = ["-m", "hf_fsdp_qlora.run", str(WORKER)] if self.route == "plain" else [str(WORKER)]
        return [
            str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / f"cpu_fsdp{self.version}_rehearsal.yaml"),
            "--main_process_port", str(free_port()), *launcher,
            "--models", str(self.models), "--out", str(out or self.out), "--record", str(record or self.record),
            "--route", self.route, "--run", run, "--fsdp-version", str(self.version), "--fault", fault,
        ]  # fmt: skip

    def env(self, **extra):
        env = {"HF_FSDP_QLORA_AUTO_RESUME": "1"} if self.route == "plain" else {}
        return _env({**env, **extra})

    def launch(self, run, fault="none", env=None, external=None, **where):
        (self.record / "signal_time").unlink(missing_ok=True)
        proc = subprocess.Popen(
            self.command(run, fault, **where), env=self.env(**(env or {})), cwd=str(REPO),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        if external is not None:  # a genuine signal from outside, to one rank's pid, while it writes a checkpoint
            pid_file = self.record / "pid_wait"
            deadline = time.time() + 240
            while not pid_file.exists() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            assert pid_file.exists(), proc.communicate()[0][-4000:]
            time.sleep(0.1)
            (self.record / "signal_time").write_text(repr(time.time()))
            os.kill(int(pid_file.read_text()), external)
            pid_file.unlink()
        output, _ = proc.communicate(timeout=300)
        ended = time.time()
        signalled = self.record / "signal_time"
        took = ended - float(signalled.read_text()) if signalled.exists() else None
        return proc.returncode, output, took

    def expect_stop(self, run, fault, step, env=None, external=None):
        rc, output, took = self.launch(run, fault, env=env, external=external)
        assert rc != 0, output[-4000:]
        # Both ranks exited with the documented status (accelerate launch itself reports 1).
        assert output.count("exitcode  : 75") == 2, output[-4000:]
        assert took is not None and took < GRACE_S, took
        ckpt = self.out / f"checkpoint-{step}"
        for name in ("adapter_model.safetensors", "optimizer_gathered.pt", "scheduler.pt", "trainer_state.json"):
            assert (ckpt / name).is_file(), (run, name, output[-3000:])
        assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()
        later = [p.name for p in self.out.glob("checkpoint-*") if int(p.name.split("-")[1]) > step]
        assert not later, later
        assert json.loads((self.out / "preempted.json").read_text())["step"] == step
        assert f"saved {ckpt}" in output and "exiting with status 75" in output
        return took

    def starts(self):
        runs = {}
        for line in (self.record / "losses_rank0.jsonl").read_text().splitlines():
            entry = json.loads(line)
            if "start_step" in entry:
                runs[entry["run"]] = entry["start_step"]
        return runs


def _losses(record, rank):
    found = {}
    for line in (record / f"losses_rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            found.setdefault((entry["run"], entry["step"]), []).append(entry["loss"])
    return found


def _check_against_baseline(chain, base_record):
    for rank in (0, 1):
        base = {step: v for (run, step), v in _losses(base_record, rank).items()}
        assert sorted(base) == list(range(1, 11)) and all(len(v) == 2 for v in base.values())
        seen = set()
        for (run, step), values in _losses(chain.record, rank).items():
            # A run stopped mid-step, or killed after computing steps it had not checkpointed, recomputes them.
            assert values == base[step][: len(values)], (rank, run, step, values, base[step])
            if len(values) == 2:
                seen.add(step)
        assert seen == set(base), (rank, sorted(seen))
    final, expected = torch.load(chain.record / "adapter_end.pt"), torch.load(base_record / "adapter_base.pt")
    assert final.keys() == expected.keys() and final
    for name, value in expected.items():
        assert torch.equal(final[name], value), name


def _run_chain(version, route, models, root, seed):
    chain = Chain(version, route, models, root)
    rng = random.Random(seed)
    base_record = root / "base_record"
    rc, output, _ = chain.launch("base", out=root / "base", record=base_record)
    assert rc == 0, output[-6000:]
    engaged = read_results(base_record / "base")[0]["engaged"]
    assert (engaged["flat_params"] if version == 1 else engaged["fsdp2_modules"]) > 0, engaged
    took = {}
    # 1: one rank, between the micro-steps of a seeded random step: the checkpoint is that step's.
    k, victim = rng.randint(1, 3), rng.randint(0, 1)
    sig = "SIGTERM" if version == 1 else "SIGUSR1"
    took["substep"] = chain.expect_stop("r1", f"substep:{k}:{victim}:{sig}", step=k)
    # 2: in evaluation (steps 3, 6): stopped early, the checkpoint is the evaluation's step.
    evaluated = 3 if k < 3 else 6
    took["eval"] = chain.expect_stop("r2", f"eval:{rng.randint(0, 1)}:SIGTERM", step=evaluated)
    # 3: during a periodic write (every 2 steps): that write completes and is the one; nothing is written twice.
    written = evaluated + 1 if evaluated % 2 else evaluated + 2
    if version == 1:
        took["write"] = chain.expect_stop("r3", f"external:{rng.randint(0, 1)}", step=written, external=signal.SIGUSR1)
        # 4: SIGKILL of one rank mid-write: the previous checkpoint stays the latest complete one.
        rc, output, _ = chain.launch("r4", f"kill:{rng.randint(0, 1)}")
        assert rc != 0
        assert (chain.out / ".incomplete-checkpoints" / f"checkpoint-{written + 2}").is_dir()
        assert not (chain.out / f"checkpoint-{written + 2}").exists()
        resumed_at = written
    else:
        took["write"] = chain.expect_stop("r3", f"save:{rng.randint(0, 1)}:SIGTERM", step=written)
        # 4: the deadline: rank 0's first step outlasts stop_after; every rank stops at that step.
        took["deadline"] = chain.expect_stop(
            "r4", "deadline:2.5", step=written + 1, env={"HF_FSDP_QLORA_STOP_AFTER": "00:00:02"}
        )
        resumed_at = written + 1
    rc, output, _ = chain.launch("end")
    assert rc == 0, output[-6000:]
    assert not (chain.out / "preempted.json").exists()
    assert chain.starts() == {"r1": 0, "r2": k, "r3": evaluated, "r4": written, "end": resumed_at}
    assert read_results(chain.record / "end")[0]["global_step"] == 10
    _check_against_baseline(chain, base_record)
    print(f"FSDP{version} signal->exit seconds: " + ", ".join(f"{n} {t:.1f}" for n, t in took.items()))


def test_preemption_chain_fsdp1_trainer(models, tmp_path):
    _run_chain(1, "trainer", models, tmp_path, seed=int(os.environ.get("PREEMPT_SEED", 11)))


def test_preemption_chain_fsdp2_plain_trainer_via_run(models, tmp_path):
    _run_chain(2, "plain", models, tmp_path, seed=int(os.environ.get("PREEMPT_SEED", 12)))
