"""Preemption-safe training (issue 20): a signal or a deadline becomes one agreed checkpoint, and the same command
resumes it bit for bit.

Per FSDP version, a chain of launches of ONE command on one output_dir (2 CPU ranks, gloo, real FSDP1/FSDP2, 10
steps of 2 micro-steps); the last launch also trains the uninterrupted baseline from scratch in a fresh folder (one
launch fewer). FSDP1's SIGKILL launch is the user's real `accelerate launch`: torch elastic's own answer to a dead
rank (it stops the survivor) is what it proves. The others fork their ranks from the fork server
(tests/fork_launch.py: the same worker, environment and real signals, ~15 CPU-s of imports spared per launch),
whose launcher lists each failed rank's status as torch elastic's summary does; FSDP2's first launch starts its
ranks with SIGUSR1 ignored, as the SLURM node script's `trap '' USR1` starts the launcher (the real `accelerate
launch -m hf_fsdp_qlora.run` under that node script, signalled, is tests/test_slurm_recipe.py's real job).
Every fault hits ONE rank only:

  FSDP1, FSDPQLoRATrainer + auto_resume=True:
    SIGTERM between micro-steps of a seeded random step -> SIGTERM in evaluation of a dict eval_dataset (the second
    dataset is skipped) -> a genuine external SIGUSR1 from
    this process while a checkpoint is being written -> SIGKILL in the middle of a write -> runs to the end
  FSDP2, a plain Trainer script under `-m hf_fsdp_qlora.run` with HF_FSDP_QLORA_AUTO_RESUME=1:
    SIGUSR1 before the model loads, in a launch started with SIGUSR1 ignored (the SLURM node script's `trap '' USR1`):
    every rank exits 75 before training, no checkpoint (issue 39) -> SIGUSR1 between micro-steps of a seeded random step -> SIGTERM in the eval_on_start evaluation (checkpointed at
    the end of the next step) -> SIGTERM inside a write ->
    the stop_after deadline -> runs to the end

After each stop: the job ended within GRACE_S of the signal, both ranks exited with status 75, the checkpoint is
complete and the latest one, the marker names it. At the end: every micro-step loss any run computed equals the
baseline's, and the final adapter equals the baseline's, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from dist_utils import BIN, CONFIGS, FORK_DEFAULT, FORK_LAUNCH, REPO, SCRIPTS, _env, _run, free_port, read_results
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
    """One command's launches on one output_dir. A launch is forked (tests/fork_launch.py, run by this process's
    fork server: the stack imported once) unless `real`: the user's `accelerate launch`, one step per chain."""

    def __init__(self, version, route, models, root):
        self.version, self.route, self.models, self.root = version, route, models, root
        self.out, self.record = root / "run", root / "record"
        self.walls = {}

    def command(self, run, fault, baseline_out=None, real=False, ignore_usr1=False):
        config = CONFIGS / f"cpu_fsdp{self.version}_rehearsal.yaml"
        module = ["-m", "hf_fsdp_qlora.run"] if self.route == "plain" else []
        if real:
            launcher = [str(BIN / "accelerate"), "launch", "--config_file", str(config),
                        "--main_process_port", str(free_port())]  # fmt: skip
        else:
            launcher = [sys.executable, str(FORK_LAUNCH), "--nproc", "2", "--master-port", str(free_port()),
                        "--timeout", "290", "--accelerate-config", str(config),
                        *(["--ignore-signal", "USR1"] if ignore_usr1 else [])]  # fmt: skip
        return [
            *launcher, *module, str(WORKER),
            "--models", str(self.models), "--out", str(self.out), "--record", str(self.record),
            "--route", self.route, "--run", run, "--fsdp-version", str(self.version), "--fault", fault,
            *(["--baseline-out", str(baseline_out)] if baseline_out else []),
        ]  # fmt: skip

    def env(self, **extra):
        return {"HF_FSDP_QLORA_AUTO_RESUME": "1", **extra} if self.route == "plain" else extra

    def launch(self, run, fault="none", env=None, external=None, baseline_out=None, ignore_usr1=False, real=False):
        """Returns (status, stdout + stderr, seconds from the signal to the launch's end or None). A forked launch
        runs in a thread (dist_utils._run) while this one may signal a rank; a real one is a Popen."""
        (self.record / "signal_time").unlink(missing_ok=True)
        real = real or not FORK_DEFAULT  # TESTS_FORK_LAUNCH=0: every step a real launch, to compare
        started, cmd = time.time(), self.command(run, fault, baseline_out, real, ignore_usr1)
        done = {}

        def run_forked():
            try:
                done["proc"] = _run(cmd, 300, self.env(**(env or {})))
            except BaseException as error:  # noqa: BLE001 - raised again in the test's thread
                done["error"] = error

        def inherit_ignored_usr1():  # what the recipe's node script does to the launcher (and so to its ranks)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

        if real:
            proc = subprocess.Popen(
                cmd, env=_env(self.env(**(env or {}))), cwd=str(REPO), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, preexec_fn=inherit_ignored_usr1 if ignore_usr1 else None,
            )  # fmt: skip
            running = lambda: proc.poll() is None  # noqa: E731
        else:
            thread = threading.Thread(target=run_forked, daemon=True)
            thread.start()
            running = thread.is_alive
        if external is not None:  # a genuine signal from outside, to one rank's pid, while it writes a checkpoint
            pid_file = self.record / "pid_wait"
            deadline = time.time() + 240
            while not pid_file.exists() and running() and time.time() < deadline:
                time.sleep(0.05)
            assert pid_file.exists(), "the rank never waited in its checkpoint write"
            time.sleep(0.1)
            (self.record / "signal_time").write_text(repr(time.time()))
            os.kill(int(pid_file.read_text()), external)
            pid_file.unlink()
        if real:
            output, _ = proc.communicate(timeout=300)
            code = proc.returncode
        else:
            thread.join()
            if "error" in done:
                raise done["error"]
            code, output = done["proc"].returncode, done["proc"].stdout + done["proc"].stderr
        ended = time.time()
        self.walls[run] = ended - started
        signalled = self.record / "signal_time"
        took = ended - float(signalled.read_text()) if signalled.exists() else None
        return code, output, took

    def expect_stop(self, run, fault, step, env=None, external=None, real=False):
        rc, output, took = self.launch(run, fault, env=env, external=external, real=real)
        assert rc != 0, output[-4000:]
        # Both ranks exited with the documented status (accelerate launch itself reports 1).
        assert _rank_statuses(output, real or not FORK_DEFAULT) == [75, 75], output[-4000:]
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

    def eval_batches(self, run):
        found = []
        for rank in (0, 1):
            lines = (self.record / f"losses_rank{rank}.jsonl").read_text().splitlines()
            found += [e["eval_batches"] for e in map(json.loads, lines) if e.get("run") == run and "eval_batches" in e]
        return found

    def starts(self):
        runs = {}
        for line in (self.record / "losses_rank0.jsonl").read_text().splitlines():
            entry = json.loads(line)
            if "start_step" in entry:
                runs[entry["run"]] = entry["start_step"]
        return runs


def _rank_statuses(output, real):
    """Each failed rank's exit status, as the real launcher's summary ("exitcode  : 75") or fork_launch lists them."""
    pattern = r"exitcode  : (-?\d+)" if real else r"fork_launch: rank \d+ exited with status (-?\d+)"
    return sorted(int(code) for code in re.findall(pattern, output))


def _losses(record, rank):
    found = {}
    for line in (record / f"losses_rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            found.setdefault((entry["run"], entry["step"]), []).append(entry["loss"])
    return found


def _check_against_baseline(chain):
    for rank in (0, 1):
        recorded = _losses(chain.record, rank)
        base = {step: v for (run, step), v in recorded.items() if run == "base"}
        assert sorted(base) == list(range(1, 11)) and all(len(v) == 2 for v in base.values())
        seen = set()
        for (run, step), values in recorded.items():
            if run == "base":
                continue
            # A run stopped mid-step, or killed after computing steps it had not checkpointed, recomputes them.
            assert values == base[step][: len(values)], (rank, run, step, values, base[step])
            if len(values) == 2:
                seen.add(step)
        assert seen == set(base), (rank, sorted(seen))
    final, expected = torch.load(chain.record / "adapter_end.pt"), torch.load(chain.record / "adapter_base.pt")
    assert final.keys() == expected.keys() and final
    for name, value in expected.items():
        assert torch.equal(final[name], value), name


def _run_chain(version, route, models, root, seed):
    chain = Chain(version, route, models, root)
    rng = random.Random(seed)
    took = {}
    if version == 2:  # 0: one rank signalled before train(): every rank stops before the first step, no checkpoint
        # Ranks started with SIGUSR1 ignored, as under the SLURM node script's `trap '' USR1`.
        rc, output, took["load"] = chain.launch("r0", f"load:{rng.randint(0, 1)}:SIGUSR1", ignore_usr1=True)
        assert _rank_statuses(output, not FORK_DEFAULT) == [75, 75] and took["load"] < 120, output[-4000:]
        marker = json.loads((chain.out / "preempted.json").read_text())
        assert marker["checkpoint"] is None and marker["new_checkpoint"] is False, marker
        assert "SIGUSR1 before training started: no new checkpoint written" in output, output[-4000:]
        assert not list(chain.out.glob("checkpoint-*"))
    # 1: one rank, between the micro-steps of a seeded random step: the checkpoint is that step's.
    k, victim = rng.randint(1, 3), rng.randint(0, 1)
    sig = "SIGTERM" if version == 1 else "SIGUSR1"
    took["substep"] = chain.expect_stop("r1", f"substep:{k}:{victim}:{sig}", step=k)
    # 2: FSDP1: in evaluation (steps 3, 6) of two datasets: stopped early, the second skipped, the checkpoint is the
    # evaluation's step. FSDP2: in the eval_on_start evaluation: checkpointed at the end of the next step (issue 25).
    evaluated, kind = (3 if k < 3 else 6, "eval") if version == 1 else (k + 1, "starteval")
    took["eval"] = chain.expect_stop("r2", f"{kind}:{rng.randint(0, 1)}:SIGTERM", step=evaluated)
    # Each rank's callback saw the batch at which the signal came; ours ended the evaluation at the next.
    assert chain.eval_batches("r2") == [1, 1]
    # 3: during a periodic write (every 2 steps): that write completes and is the one; nothing is written twice.
    written = evaluated + 1 if evaluated % 2 else evaluated + 2
    if version == 1:
        took["write"] = chain.expect_stop("r3", f"external:{rng.randint(0, 1)}", step=written, external=signal.SIGUSR1)
        # 4: SIGKILL of one rank mid-write: the previous checkpoint stays the latest complete one. The chain's real
        # `accelerate launch`: torch elastic's own reaction to a dead rank (it stops the survivor).
        rc, output, took["kill"] = chain.launch("r4", f"kill:{rng.randint(0, 1)}", real=True)
        assert rc != 0 and took["kill"] < GRACE_S, took  # the surviving rank does not hang in a collective
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
    # 5: the same command runs to the end; then, in the same launch, the uninterrupted baseline on a fresh folder.
    rc, output, _ = chain.launch("end", baseline_out=root / "base")
    assert rc == 0, output[-6000:]
    assert not (chain.out / "preempted.json").exists()
    found = read_results(chain.record)[0]
    engaged = found["end"]["engaged"]
    assert (engaged["flat_params"] if version == 1 else engaged["fsdp2_modules"]) > 0, engaged
    assert found["end"]["global_step"] == found["base"]["global_step"] == 10
    assert chain.starts() == {"r1": 0, "r2": k, "r3": evaluated, "r4": written, "end": resumed_at, "base": 0}
    _check_against_baseline(chain)
    print(f"FSDP{version} signal->exit s: " + ", ".join(f"{n} {t:.1f}" for n, t in took.items()))
    print(f"FSDP{version} launch wall s: " + ", ".join(f"{n} {t:.1f}" for n, t in chain.walls.items()))


def test_preemption_chain_fsdp1_trainer(models, tmp_path):
    _run_chain(1, "trainer", models, tmp_path, seed=int(os.environ.get("PREEMPT_SEED", "11")))


def test_preemption_chain_fsdp2_plain_trainer_via_run(models, tmp_path):
    _run_chain(2, "plain", models, tmp_path, seed=int(os.environ.get("PREEMPT_SEED", "12")))


# ---- fast single-process checks ----


def test_stock_trainer_structure_preemption_relies_on():
    """Canary (_compat/transformers.py "preemption_trainer_hooks"): the stock loop calls on_step_end before deciding to save,
    saves when control.should_save is set after an evaluation, calls on_save after the write and
    on_prediction_step per evaluation batch, and reaches evaluate() through _evaluate."""
    import inspect

    from transformers import Trainer, TrainerCallback

    names = Trainer._maybe_log_save_evaluate.__code__.co_names
    assert {"should_evaluate", "_evaluate", "should_save", "_save_checkpoint", "on_save"} <= set(names)
    assert "on_prediction_step" in Trainer.evaluation_loop.__code__.co_names
    assert "evaluate" in Trainer._evaluate.__code__.co_names
    loop = inspect.getsource(Trainer._run_epoch)
    assert loop.index("on_step_end") < loop.index("_maybe_log_save_evaluate") < loop.index("on_substep_end")
    assert list(inspect.signature(Trainer.train).parameters)[:3] == ["self", "resume_from_checkpoint", "trial"]
    assert not any("signal" in name.lower() for name in vars(TrainerCallback))  # still nothing upstream


def test_signal_flag_chains_and_restores():
    from hf_fsdp_qlora.train.preemption import SignalFlag

    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        before = signal.getsignal(signal.SIGUSR1)
        flag = SignalFlag("SIGUSR1")
        assert flag.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert flag.received == signal.SIGUSR1 and seen == [signal.SIGUSR1]  # ours raised the flag, theirs ran
        flag.restore()
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_signal_flag_ignored_default_is_not_called_and_threads_are_refused():
    import threading

    from hf_fsdp_qlora.train.preemption import SignalFlag

    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        flag = SignalFlag("USR2")
        assert flag.install()
        os.kill(os.getpid(), signal.SIGUSR2)  # SIG_IGN is not chained to (and SIG_DFL would kill us)
        time.sleep(0.01)
        assert flag.received == signal.SIGUSR2
        flag.restore()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(SignalFlag("USR2").install()))
        thread.start()
        thread.join()
        assert outcome == [False]  # Python allows handlers in the main thread only: no error, no handler
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_latest_complete_checkpoint(tmp_path):
    from hf_fsdp_qlora.train.checkpoint import latest_complete_checkpoint

    assert latest_complete_checkpoint(tmp_path / "missing") is None
    assert latest_complete_checkpoint(tmp_path) is None
    for step, complete in ((2, True), (10, True), (9, True), (12, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    staged = tmp_path / ".incomplete-checkpoints" / "checkpoint-14"
    staged.mkdir(parents=True)
    (staged / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-20").write_text("a file")
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # numeric, not string order


@pytest.mark.parametrize(
    "value, seconds", [("11:50:00", 42600), ("0:00:05", 5), ("1-00:00:01", 86401), (None, None), ("", None)]
)
def test_stop_after_parsing(value, seconds):
    from hf_fsdp_qlora.train.preemption import parse_stop_after

    assert parse_stop_after(value) == seconds


@pytest.mark.parametrize("value", ["90", "1:60:00", "00:00:00", "1h", "-1:00:00"])
def test_stop_after_bad_input(value):
    from hf_fsdp_qlora.train.preemption import parse_stop_after

    with pytest.raises(ValueError, match=r"stop_after=.*'11:50:00'"):
        parse_stop_after(value)


def test_signals_parsing_and_bad_input():
    from hf_fsdp_qlora.train.preemption import parse_signals

    assert parse_signals(None) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("term, usr1,SIGTERM") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("") == () and parse_signals(["SIGUSR2"]) == (signal.SIGUSR2,)
    with pytest.raises(ValueError, match="SIGKILL cannot be caught.*SIGUSR1"):
        parse_signals("SIGTERM,SIGKILL")
    with pytest.raises(ValueError, match="unknown signal 'SIGFOO'"):
        parse_signals("SIGFOO")


def test_training_arguments_refuse_bad_settings(tmp_path):
    from hf_fsdp_qlora import FSDPQLoRATrainingArguments

    with pytest.raises(ValueError, match="stop_after='12h'"):
        FSDPQLoRATrainingArguments(output_dir=str(tmp_path), stop_after="12h", use_cpu=True)
    with pytest.raises(ValueError, match="SIGSTOP cannot be caught"):
        FSDPQLoRATrainingArguments(output_dir=str(tmp_path), preemption_signals="SIGSTOP", use_cpu=True)
    assert not any(tmp_path.iterdir())  # nothing written


def test_resolve_resume(tmp_path):
    from types import SimpleNamespace

    from hf_fsdp_qlora.train.preemption import PREEMPTED_MARKER, resolve_resume

    args = SimpleNamespace(output_dir=str(tmp_path), auto_resume=True)
    assert resolve_resume(args, None) is None  # nothing to resume: start fresh
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
    (tmp_path / PREEMPTED_MARKER).write_text("{}")
    assert resolve_resume(args, None) == str(tmp_path / "checkpoint-4")
    assert not (tmp_path / PREEMPTED_MARKER).exists()  # the requeued run owns the folder again
    assert resolve_resume(args, "elsewhere") == "elsewhere"  # an explicit choice wins
    (tmp_path / PREEMPTED_MARKER).write_text("{}")
    assert resolve_resume(SimpleNamespace(output_dir=str(tmp_path)), None) is None  # auto_resume off
    assert not (tmp_path / PREEMPTED_MARKER).exists()


def test_launcher_refuses_a_bad_deadline_and_documents_the_switches(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    bad = subprocess.run(
        [str(BIN / "python"), "-m", "hf_fsdp_qlora.run", str(script)], check=False, capture_output=True, text=True,
        timeout=120,
        env=_env({"HF_FSDP_QLORA_STOP_AFTER": "2 hours"}),
    )  # fmt: skip
    assert bad.returncode == 2 and "HF_FSDP_QLORA_STOP_AFTER" in bad.stderr and "HH:MM:SS" in bad.stderr
    usage = subprocess.run(
        [str(BIN / "python"), "-m", "hf_fsdp_qlora.run", "--help"], check=False, capture_output=True, text=True
    )
    assert "HF_FSDP_QLORA_AUTO_RESUME=1" in usage.stdout and "status 75" in usage.stdout


def test_single_process_signal_returns_with_exit_code_none(tmp_path):
    """One process, `PreemptionCallback(exit_code=None)`: a SIGUSR1 during step 2 ends train() at step 2 with a
    complete checkpoint-2 (no save_strategy needed), `stopped` names the signal, and the previous handler is back."""
    from transformers import TrainerCallback

    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, PreemptionCallback, load_qlora_model

    path = build_tiny_model(tmp_path / "llama", "llama")
    ids = torch.randint(3, 256, (16, 16), generator=torch.Generator().manual_seed(0))

    class SignalAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.getsignal(signal.SIGUSR1)
    args = FSDPQLoRATrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", auto_resume=True,
    )  # fmt: skip
    stop = PreemptionCallback(exit_code=None)
    trainer = FSDPQLoRATrainer(
        model=load_qlora_model(str(path), gradient_checkpointing=False), args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in ids], callbacks=[stop, SignalAtStep2()],
    )  # fmt: skip
    trainer.train()
    assert stop.stopped == signal.SIGUSR1 and trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").is_file()
    assert json.loads((tmp_path / "out" / "preempted.json").read_text())["step"] == 2
    assert signal.getsignal(signal.SIGUSR1) == before


# ---- issue 25: stops that left no checkpoint, lost it, crashed, over-ran or dropped a signal ----


def _fault(at_step=None, in_eval=False):
    """A callback that sends SIGUSR1 to this process at the start of step `at_step`, or at the first evaluation batch
    (`in_eval`), and counts the evaluation batches it sees after that."""
    from transformers import TrainerCallback

    class Fault(TrainerCallback):
        fired, batches_after = False, 0

        def fire(self):
            if not self.fired:
                self.fired = True
                os.kill(os.getpid(), signal.SIGUSR1)

        def on_step_begin(self, args, state, control, **kwargs):
            if at_step is not None and state.global_step + 1 == at_step:
                self.fire()

        def on_prediction_step(self, args, state, control, **kwargs):
            if self.fired:
                self.batches_after += 1
            elif in_eval:
                self.fire()

    return Fault()


def _in_process_run(tmp_path, fault, plain=False, eval_dataset=True, **settings):
    """A tiny single-process QLoRA run (real bitsandbytes 4-bit) with PreemptionCallback(exit_code=None)."""
    from transformers import Trainer, TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, PreemptionCallback, load_qlora_model

    path = tmp_path / "llama"
    if not path.exists():
        build_tiny_model(path, "llama")
    ids = torch.randint(3, 256, (16, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    base = dict(  # noqa: C408 - keyword form reads as TrainingArguments
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        report_to=[], use_cpu=True, save_strategy="no",
    )  # fmt: skip
    args = (TrainingArguments if plain else FSDPQLoRATrainingArguments)(**{**base, **settings})
    stop = PreemptionCallback(exit_code=None)
    trainer = (Trainer if plain else FSDPQLoRATrainer)(
        model=load_qlora_model(str(path), gradient_checkpointing=False), args=args, train_dataset=data,
        eval_dataset=eval_dataset and {"a": data[:8], "b": data[8:]}, callbacks=[stop, fault],
    )  # fmt: skip
    return trainer, stop


def _assert_stopped_at(tmp_path, trainer, stop, step):
    assert stop.stopped == signal.SIGUSR1 and trainer.state.global_step == step
    assert (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert json.loads((tmp_path / "out" / "preempted.json").read_text())["checkpoint"] == str(
        tmp_path / "out" / f"checkpoint-{step}"
    )


def test_plain_trainer_with_the_callback_stops_in_evaluation_and_skips_the_other_datasets(tmp_path):
    """Items 8 and 9: a plain `Trainer` given only PreemptionCallback, a signal at the first batch of dataset "a" of
    a dict eval_dataset at step 2: train() returns (the stop no longer escapes it), checkpoint-2 and the marker are
    written, no batch of "a" or "b" is evaluated after the stop, the previous handler is back - also after a train()
    that raises."""
    from hf_fsdp_qlora.train._trainer_mixin import FSDPSaveMixin

    before = signal.getsignal(signal.SIGUSR1)
    fault = _fault(in_eval=True)
    trainer, stop = _in_process_run(tmp_path, fault, plain=True, eval_strategy="steps", eval_steps=2)
    trainer.train()  # was: _EvaluationStopped escaped it
    assert isinstance(trainer, FSDPSaveMixin)  # adopted: the callback's guarantees live in our trainer's methods
    _assert_stopped_at(tmp_path, trainer, stop, 2)
    assert fault.batches_after == 0  # was 4: all of "b" (4 batches of 2) after "a" was cut
    assert signal.getsignal(signal.SIGUSR1) == before

    class Boom(Exception):
        pass

    def boom(*args, **kwargs):
        raise Boom

    trainer.training_step = boom
    with pytest.raises(Boom):
        trainer.train()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_signal_in_the_eval_on_start_evaluation_writes_a_checkpoint(tmp_path):
    """Item 7: eval_on_start=True and a signal during that first evaluation: the stop is carried to the end of the
    first step - both of its micro-steps - which is checkpointed (was: no checkpoint, no marker, and the process
    would exit 75 all the same)."""
    fault = _fault(in_eval=True)
    trainer, stop = _in_process_run(
        tmp_path, fault, eval_on_start=True, eval_strategy="steps", eval_steps=100, gradient_accumulation_steps=2
    )
    trainer.train()
    _assert_stopped_at(tmp_path, trainer, stop, 1)


def test_best_model_at_end_keeps_the_preemption_checkpoint(tmp_path):
    """Item 6: save_total_limit=1 + load_best_model_at_end: the stop at step 5 writes checkpoint-5, and the stock
    end of training no longer deletes it (nor loads the best model in the grace time)."""
    fault = _fault(at_step=5)
    trainer, stop = _in_process_run(
        tmp_path, fault, max_steps=8, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
        save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="eval_a_loss",
    )  # fmt: skip
    trainer.train()
    _assert_stopped_at(tmp_path, trainer, stop, 5)
    assert trainer.state.best_model_checkpoint in (str(tmp_path / "out" / f"checkpoint-{s}") for s in (2, 4))
    assert trainer.args.load_best_model_at_end and trainer.args.save_total_limit == 1  # the settings are back


def test_a_signal_after_the_last_agreement_is_raised_again():
    """Item 10: SIGUSR1 after the last agreement: when our handler is removed, the signal is raised again with its
    default action, so the process dies of it as it would have without us (was: dropped, the process went on). In a
    forked child of this process: the default action of SIGUSR1 ends it."""
    from types import SimpleNamespace

    from hf_fsdp_qlora import PreemptionCallback

    pid = os.fork()
    if pid == 0:  # the child: one "run" whose signal comes after the last check, then the end of training
        code = 3
        try:
            stop = PreemptionCallback(signals="SIGUSR1")
            args, state = SimpleNamespace(preemption_signals=None, stop_after=None), SimpleNamespace(global_step=0)
            stop.on_train_begin(args, state, None)
            stop.on_step_end(args, state, SimpleNamespace())  # the last agreement: nothing yet
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives during the final save / the end of training
            code = 4 if stop.flag.received != signal.SIGUSR1 else 5
            stop.on_train_end(args, state, None)
            code = 0  # survived: the signal was dropped
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1, os.WIFEXITED(status) and os.WEXITSTATUS(
        status
    )


def test_stop_after_counts_from_the_process_start():
    """Item 12: the budget counts from the start of the process (loading and resume count against the scheduler's
    limit), not from train(). Oracle: the process's age as `ps` reports it."""
    from types import SimpleNamespace

    from hf_fsdp_qlora import PreemptionCallback

    def age():
        ps = ["ps", "-o", "etimes=", "-p", str(os.getpid())]
        return int(subprocess.run(ps, check=True, capture_output=True, text=True).stdout)

    while age() < 3:
        time.sleep(0.2)
    stop = PreemptionCallback(signals="", stop_after="00:00:02")
    stop.on_train_begin(
        SimpleNamespace(preemption_signals=None, stop_after=None), SimpleNamespace(global_step=0), None
    )
    assert stop._local() == 1  # the deadline has passed at the first check (was: 2 s after train() began)
    assert abs((time.time() - stop._start) - age()) <= 2
    stop.disarm()


def test_save_strategy_no_keeps_only_the_latest_preemption_checkpoint(tmp_path):
    """save_strategy="no" (examples/train_qlora.py): two preemptions of one run (the second resumed from the first)
    leave only the second checkpoint (before: one per requeue piled up beside the final adapter)."""
    trainer, stop = _in_process_run(tmp_path, _fault(at_step=2), eval_dataset=False)
    trainer.train()
    assert stop.stopped == signal.SIGUSR1 and trainer.state.global_step == 2
    trainer, stop = _in_process_run(tmp_path, _fault(at_step=4), eval_dataset=False, auto_resume=True)
    trainer.train()
    assert stop.stopped == signal.SIGUSR1 and trainer.state.global_step == 4
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-4"]
