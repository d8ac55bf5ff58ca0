"""Helpers for multi-process tests: real torch.distributed on gloo, launched as users launch.

Every launch gets its own free port, OMP_NUM_THREADS=1 and a timeout. Worker scripts live in
tests/scripts/, batch several scenarios per launch, and write their findings as JSON for the test to
assert on (a green exit alone proves nothing).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CONFIGS = REPO / "accelerate_configs"
BIN = Path(sys.executable).parent
# The one switch: our worker scripts' launches fork their ranks (tests/fork_launch.py) unless a call says
# fork=False or TESTS_FORK_LAUNCH=0 is exported (real launchers everywhere: to compare, or to rule forking out).
FORK_DEFAULT = os.environ.get("TESTS_FORK_LAUNCH", "1") != "0"
# Fork launches are forked from this process's fork server (tests/fork_server.py) unless TESTS_FORK_SERVER=0.
FORK_SERVER = os.environ.get("TESTS_FORK_SERVER", "1") != "0"
FORK_LAUNCH = Path(__file__).resolve().parent / "fork_launch.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_port(job_out: Path, used: set[str], timeout: float = 300.0) -> str:
    """The port one job of a batched launch meets on: chosen by rank 0 just before the job's rendezvous and handed
    to the other ranks through a file beside `job_out` (the job's own, fresh folder; left untouched itself). A port chosen when the launch started can be taken by
    the time a later job meets (by some connection's ephemeral port: EADDRINUSE on rank 0, the other ranks waiting
    out their store timeout); never one an earlier job used (a rank still leaving the old group must not meet the
    new one)."""
    path = job_out.parent / f"{job_out.name}.master_port"
    path.parent.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("RANK", "0")) == 0:
        port = str(free_port())
        while port in used:
            port = str(free_port())
        path.with_suffix(".tmp").write_text(port)
        os.replace(path.with_suffix(".tmp"), path)
    else:
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 wrote no port into {path} within {timeout:.0f} s")
            time.sleep(0.05)
        port = path.read_text()
    used.add(port)
    return port


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(SCRIPTS), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.pop("ACCELERATE_USE_FSDP", None)
    env.pop("ACCELERATE_USE_CPU", None)
    if extra:
        env.update(extra)
    return env


def _run(cmd: list[str], timeout: int, env: dict | None) -> subprocess.CompletedProcess:
    """Run `cmd` like subprocess.run(capture_output=True, text=True, timeout=...), in its own session so that a
    timeout kills the whole launch (launcher and ranks), not just the launcher. A tests/fork_launch.py command
    runs in a child of this process's fork server (tests/fork_server.py: the stack imported once) when it can.
    With TESTS_LAUNCH_LOG=FILE exported, each launch appends a JSON line (test, command, how it ran, wall and CPU
    seconds; a served launch's CPU excludes the server's one-time imports) to FILE: the suite profile."""
    started, cpu, env = time.monotonic(), _children_cpu(), _env(env)
    served = _serve(cmd, timeout, env)
    if served is not None:
        code, stdout, stderr, cpu_s = served
    else:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO),
            start_new_session=True,
        ) as proc:  # fmt: skip
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from None
        code, cpu_s = proc.returncode, _children_cpu() - cpu
    _log_launch({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "cmd": [Path(c).name for c in cmd[:8]],
                 "via": "server" if served is not None else _not_served_why(cmd), "rc": code,
                 "wall_s": round(time.monotonic() - started, 1), "cpu_s": round(cpu_s, 1)})  # fmt: skip
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _log_launch(entry: dict) -> None:
    """Append `entry` as a JSON line to the launch log, when TESTS_LAUNCH_LOG=FILE is exported."""
    if os.environ.get("TESTS_LAUNCH_LOG"):
        with open(os.environ["TESTS_LAUNCH_LOG"], "a") as log:
            log.write(json.dumps(entry) + "\n")


def _not_served_why(cmd: list[str]) -> str:
    if not FORK_SERVER or cmd[:2] != [sys.executable, str(FORK_LAUNCH)]:
        return "subprocess"
    from fork_server import skipped

    return "subprocess: " + skipped()


def _serve(cmd: list[str], timeout: int, env: dict):
    """A fork_launch.py command run by the fork server: (returncode, stdout, stderr, CPU s), or None (not a fork
    launch, TESTS_FORK_SERVER=0 exported, or the server could not take it: run the subprocess)."""
    if not FORK_SERVER or cmd[:2] != [sys.executable, str(FORK_LAUNCH)]:
        return None
    from fork_server import run_launch

    return run_launch(cmd[2:], timeout, env)


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far, grandchildren included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _fork_cmd(script: str, args: tuple, timeout: int, nproc: int = 2, config: Path | None = None, num_processes=None):
    """The tests/fork_launch.py command for one of our worker scripts: one parent imports the stack, the ranks
    are forked from it (see that module). Its own timeout kills the ranks a little before ours kills it."""
    cmd = [sys.executable, str(FORK_LAUNCH), "--nproc", str(nproc),
           "--master-port", str(free_port()), "--timeout", str(max(timeout - 5, 1))]  # fmt: skip
    cmd += ["--accelerate-config", str(config)] if config is not None else []
    cmd += ["--num-processes", str(num_processes)] if num_processes else []
    return [*cmd, str(SCRIPTS / script), *args]


def accelerate_launch(
    config: str | Path,
    script: str,
    *args: str,
    timeout: int = 300,
    env: dict | None = None,
    num_processes=None,
    fork: bool | None = None,
):
    """`accelerate launch --config_file CONFIG tests/scripts/SCRIPT ARGS` on a fresh port
    (`num_processes`: override the config's, e.g. 1 for a single-GPU user).

    `fork` (the default, for our own worker scripts): the ranks are forked from one parent that imported the
    stack, with the environment accelerate's launcher computes for CONFIG (tests/fork_launch.py), which spares
    the launcher's and all but one rank's imports. ``fork=False``: the real `accelerate launch`, for the paths
    users take (and the rehearsal probe, so each FSDP version keeps a real launch)."""
    config = Path(config)
    if not config.is_absolute():
        config = CONFIGS / config
    if FORK_DEFAULT if fork is None else fork:
        return _run(_fork_cmd(script, args, timeout, config=config, num_processes=num_processes), timeout, env)
    cmd = [
        str(BIN / "accelerate"), "launch", "--config_file", str(config),
        "--main_process_port", str(free_port()),
        *(["--num_processes", str(num_processes)] if num_processes else []), str(SCRIPTS / script), *args,
    ]  # fmt: skip
    return _run(cmd, timeout, env)


def run_single(script: str, *args: str, timeout: int = 300, env: dict | None = None, fork: bool | None = None):
    """`python tests/scripts/SCRIPT ARGS` (or SCRIPT, a path): one plain process (a single-process oracle, a
    sweep), with the launches' environment. `fork` (default as accelerate_launch's): the process is forked from
    this process's fork server (fork_launch.py --single), which spares its ~8 CPU-s of imports; no rank or launcher
    environment either way."""
    if FORK_DEFAULT if fork is None else fork:
        cmd = [sys.executable, str(FORK_LAUNCH), "--single", "--timeout", str(max(timeout - 5, 1))]
        return _run([*cmd, str(SCRIPTS / script), *args], timeout, env)
    return _run([sys.executable, str(SCRIPTS / script), *args], timeout, env)


def launch_via_run(
    config: str | Path, script: str | Path, *args: str, timeout: int = 420, fork: bool | None = None, env=None
):
    """`accelerate launch --config_file CONFIG -m hf_fsdp_qlora.run SCRIPT ARGS` (SCRIPT: a path, e.g. trl's own
    sft.py, or a name in tests/scripts/). `fork` as in accelerate_launch: by default the ranks are forked and run
    `python -m hf_fsdp_qlora.run SCRIPT ARGS` with that launch's environment (fork_launch.py's ``-m``); keep
    ``fork=False`` for the launch that is a user path's only proof through the real launcher."""
    config = Path(config) if Path(config).is_absolute() else CONFIGS / config
    if FORK_DEFAULT if fork is None else fork:
        cmd = _fork_cmd(str(script), args, timeout, config=config)
        at = len(cmd) - len(args) - 1  # before the script: fork_launch's `-m MODULE SCRIPT ARGS`
        return _run([*cmd[:at], "-m", "hf_fsdp_qlora.run", *cmd[at:]], timeout, env)
    cmd = [
        str(BIN / "accelerate"), "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
        "-m", "hf_fsdp_qlora.run", str(SCRIPTS / script), *args,
    ]  # fmt: skip
    return _run(cmd, timeout, env)


def torchrun(
    script: str, *args: str, nproc: int = 2, timeout: int = 300, env: dict | None = None, fork: bool | None = None
):
    """`torchrun --nproc-per-node N tests/scripts/SCRIPT ARGS` on a fresh port (`fork`: see accelerate_launch;
    the ranks get torchrun's RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* environment)."""
    if FORK_DEFAULT if fork is None else fork:
        return _run(_fork_cmd(script, args, timeout, nproc), timeout, env)
    cmd = [
        str(BIN / "torchrun"), f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", str(SCRIPTS / script), *args,
    ]  # fmt: skip
    return _run(cmd, timeout, env)


def check(proc: subprocess.CompletedProcess) -> None:
    """Fail with the worker's output when a launch exited non-zero."""
    if proc.returncode != 0:
        tail = (proc.stdout[-6000:] + "\n----- stderr -----\n" + proc.stderr[-12000:]).strip()
        raise AssertionError(f"launch failed with exit code {proc.returncode}:\n{tail}")


def read_results(out_dir: Path) -> dict:
    """Merge the per-rank JSON files a worker script wrote: {rank: findings}."""
    results = {}
    for path in sorted(Path(out_dir).glob("rank*.json")):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    return results


def launch_scenarios(tmp_path_factory, name, scenarios, script="train_scenarios.py", version=2, models=None):
    """Build the tiny models `scenarios` ({key: (arch, kind)}) need (in `models`, or a new folder), run them in
    one 2-rank accelerate launch with the shipped CPU rehearsal config, and return (models dir, out dir, per-rank
    results, the process)."""
    from tiny_models import build_tiny_model

    models = Path(models) if models else tmp_path_factory.mktemp("models")
    for arch in {arch for arch, _ in scenarios.values()}:
        build_tiny_model(models / arch, arch)
    spec = ",".join(f"{key}={arch}:{kind}" for key, (arch, kind) in scenarios.items())
    for attempt in (1, 2):
        out = tmp_path_factory.mktemp(name) / "run"
        proc = accelerate_launch(
            f"cpu_fsdp{version}_rehearsal.yaml", script,
            "--models", str(models), "--out", str(out), "--fsdp-version", str(version), "--scenarios", spec,
            timeout=600,
        )  # fmt: skip
        if attempt == 2 or not crashed(proc):
            break
        _warn_crash(name, proc)
    check(proc)
    return models, out, read_results(out), proc


# Exit codes of a launch whose rank died of a signal that no test sends: a crash in native code, not a failed check.
CRASH_CODES = {128 + signal.SIGSEGV, 128 + signal.SIGBUS, 128 + signal.SIGABRT}


def crashed(proc: subprocess.CompletedProcess) -> bool:
    """Whether a launch ended because a rank crashed in native code (segfault, bus error, abort)."""
    return proc.returncode in CRASH_CODES


def _warn_crash(name: str, proc: subprocess.CompletedProcess) -> None:
    """A shared launch runs ~36 scenarios for ~60 tests: one rare native crash would fail them all. torch 2.13's
    gloo collectives on CPU segfaulted once in ~200 such launches here and once in CI (at a random scenario; here in
    a DTensor all-gather, faulthandler's stack in the warning), so the launch runs once more in a fresh folder; a
    second crash fails, as does any other failure. The warning shows in pytest's summary and in the launch log."""
    import warnings

    tail = proc.stderr[-4000:]
    _log_launch({"test": name, "relaunched_after_crash": proc.returncode})
    warnings.warn(f"launch {name} crashed (exit {proc.returncode}); running it once more. Its stderr's end:\n{tail}")


def shared_scenarios_launch(session, tmp_path_factory, models, version):
    """ONE launch per FSDP version for the trainer scenarios of every selected test module (`session.items`).

    A module takes part by defining ``SHARED_TRAIN_SCENARIOS = {version: {key: (arch, kind)}}`` (keys unique across
    modules); ``SHARED_TRAIN_ORDER`` (default 1) puts a module's scenarios earlier (test_trainer_fsdp's first
    scenario must be the first of its launch). The worker is low_ram_worker.py, train_scenarios.py plus its
    `lowram` kinds. Each launch costs its ranks ~10 s of imports on 2 cores before any work: this spares one
    launch per contributing module. Returns what :func:`launch_scenarios` returns.
    """
    modules = []
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "SHARED_TRAIN_SCENARIOS") and module not in modules:
            modules.append(module)
    scenarios = {}
    for module in sorted(modules, key=lambda m: getattr(m, "SHARED_TRAIN_ORDER", 1)):
        for key, spec in module.SHARED_TRAIN_SCENARIOS.get(version, {}).items():
            assert scenarios.get(key, spec) == spec, f"scenario key {key!r} used twice: {scenarios[key]} vs {spec}"
            scenarios[key] = spec
    return launch_scenarios(
        tmp_path_factory,
        f"shared_fsdp{version}",
        scenarios,
        script="low_ram_worker.py",
        version=version,
        models=models,
    )


def assert_first_logits_equal(model, out, name, first_batch, batch_size):
    """Bit-exact: the unsharded `model`'s logits on each rank's first batch equal what that rank saved."""
    import torch

    ids = torch.tensor(first_batch)
    with torch.no_grad():
        for rank, chunk in enumerate(ids.split(batch_size)):
            expected = model(input_ids=chunk, attention_mask=torch.ones_like(chunk)).logits.float()
            got = torch.load(Path(out) / name / f"logits_rank{rank}.pt")
            assert torch.equal(got, expected), (rank, (got - expected).abs().max())


def exit_worker(code: int = 0) -> None:
    """End a worker process right after its results are on disk and its ranks have met at a barrier.

    torch 2.13's gloo/FSDP teardown at interpreter exit sometimes aborts with "terminate called without
    an active exception" (rc 1) even after barrier + destroy_process_group (seen in CI: 1 launch of ~30);
    skipping the interpreter's teardown makes the launch's exit code reflect the work, not the teardown.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def finish_worker(out: Path, results: dict) -> None:
    """End a 2-rank worker: this rank's `results` to ``out/rank{N}.json``, a barrier, the process group torn
    down, and the process ended by :func:`exit_worker` (works for single-process torchrun-less runs too)."""
    import json

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    exit_worker()


def packed_digests(model, rank: int = 0, world: int | None = None) -> dict:
    """sha1 of each 4-bit weight's packed bytes and of every tensor/field of its quant state.

    `world`: hash only the bytes FSDP2 over `world` ranks keeps on `rank` (a low-RAM load holds only those).
    """
    import hashlib

    import torch

    from hf_fsdp_qlora.loading._transfer import _row_bytes

    found = {}
    for name, param in model.named_parameters():
        if type(param).__name__ != "Params4bit":
            continue
        data = param.data.contiguous().reshape(-1).view(torch.uint8)
        if world:
            first, end, _ = _row_bytes(tuple(param.shape), param.dtype, rank, world)
            data = data[first:end]
        h = hashlib.sha1(data.numpy().tobytes())
        for key, value in sorted(param.quant_state.as_dict(packed=False).items()):
            h.update(key.encode())
            h.update(
                value.contiguous().view(torch.uint8).numpy().tobytes()
                if torch.is_tensor(value)
                else repr(value).encode()
            )
        found[name] = h.hexdigest()
    return found


def assert_scenario_trained_under_fsdp(found: dict, version: int) -> None:
    """A shared-launch trainer scenario's rank result: it trained, as FSDP, with FSDP engaged (FlatParameters for
    FSDP1, FSDP2 modules for FSDP2)."""
    assert found["ok"], found.get("traceback")
    assert found["distributed_type"] == "DistributedType.FSDP"
    engaged = found["engagement"]
    assert engaged["flat_params"] > 0 if version == 1 else engaged["fsdp2_modules"] > 0, engaged


def whole_grads(model) -> dict:
    """Every trainable parameter's gradient, whole (FSDP2: ``full_tensor()``, a collective every rank calls), under
    its name without FSDP1's and the checkpoint wrappers' segments."""
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is not None:
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            clean = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
            grads[clean] = grad.detach().float().clone()
    return grads


def trained_from_launch_start(build, init: dict, steps: int) -> dict:
    """A one-process oracle's trainable weights after training: `build()` makes the trainer (trl's, say), whose
    trainable tensors must be the launch's and start from the launch's `init`, in float32 as stock peft makes them
    (trl casts a quantized model's adapters to bf16); it must run `steps` steps. accelerate's state is reset after,
    whatever happens, so the next oracle starts fresh."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    try:
        trainer = build()
        params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert sorted(params) == sorted(init), "the oracle's trainable tensors are the launch's"
        for name, value in init.items():
            params[name].data = value.to(torch.float32).clone()
        trainer.train()
        assert trainer.state.global_step == steps
        return {n: p.detach().float().clone() for n, p in params.items()}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def with_initial_adapters(model, init: dict):
    """`model` (a single-process oracle) with the run's initial trainable weights `init` copied in, in train mode."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value.to(params[name].dtype))
    return model.train()
