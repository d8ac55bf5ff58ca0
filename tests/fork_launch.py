"""Fork launcher for the tests' own 2-rank worker scripts: import the heavy stack once, fork the ranks.

`accelerate launch` / `torchrun` start one fresh interpreter per rank plus the launcher's own, and each pays the
import of torch, transformers, peft, bitsandbytes and accelerate (~6 CPU-s each on this 2-core machine, far more
wall time when both ranks import at once). Here one parent process imports what the worker script imports, then
forks the ranks, which run the script as ``__main__`` with the environment torchrun (and, with
``--accelerate-config``, accelerate's launcher for that config file) would give them. The ranks still are separate
processes with real gloo process groups: the scenario code, and its FSDP-engagement assertions, are unchanged.

Fork is safe only from a single-threaded parent: OMP_NUM_THREADS=1 keeps torch's OpenMP pool unstarted, pyarrow's
jemalloc is told to start no background thread, and the parent checks it has one OS thread before forking. The
users' paths (recipes, README/docs commands, trl's scripts, the demo, multi-node) keep real launchers: see
tests/dist_utils.py. In the suite this parent is itself forked from a per-pytest-process fork server that imported
the third-party stack once (tests/fork_server.py); run as a command, it imports for itself.

    python tests/fork_launch.py --nproc 2 --master-port P [--accelerate-config FILE] SCRIPT [ARGS...]
    python tests/fork_launch.py ... -m MODULE SCRIPT [ARGS...]   (the ranks run `python -m MODULE SCRIPT ARGS`)
    python tests/fork_launch.py --single SCRIPT [ARGS...]   (one plain process, as `python SCRIPT ARGS`: no rank
                                                              environment; a single-process oracle's imports spared)
"""

from __future__ import annotations

import argparse
import ast
import faulthandler
import gc
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

# After one rank fails, the others get this long to fail on their own (their messages are often what a test
# asserts) before they are killed, as torchrun kills them.
_GRACE_S = 15.0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--master-port", type=int, help="required unless --single")
    parser.add_argument("--single", action="store_true", help="one plain process, no rank or launcher environment")
    parser.add_argument("--accelerate-config", help="an accelerate config file whose launch environment to give")
    parser.add_argument("--num-processes", type=int, help="override the config's num_processes (as --num_processes)")
    parser.add_argument("--timeout", type=float, default=600.0, help="kill the ranks after this many seconds")
    parser.add_argument("--grace", type=float, default=_GRACE_S, help="after a rank failed, kill the rest this late")
    parser.add_argument("-m", dest="module", help="run this module as __main__ with SCRIPT ARGS as its arguments")
    parser.add_argument("--ignore-signal", action="append", default=[], metavar="NAME",
                        help="start the ranks with this signal ignored, as a launcher started under `trap '' NAME` "
                        "passes it on (the SLURM recipe's node script: USR1)")  # fmt: skip
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def accelerate_env(config: str, port: int, num_processes: int | None) -> tuple[dict, int]:
    """The environment (and rank count) `accelerate launch --config_file config` gives its processes, computed by
    accelerate's own launcher code (the doctor uses the same calls; _validate_launch_command is in the compat
    registry)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", config, "--main_process_port", str(port)]
    argv += ["--num_processes", str(num_processes)] if num_processes else []
    args = _validate_launch_command(launch_command_parser().parse_args([*argv, "script.py"]))[0]
    if not (args.use_fsdp or args.multi_gpu):
        raise SystemExit(f"fork_launch: {config} is not a multi-process FSDP/DDP config; launch it for real instead")
    env = prepare_multi_gpu_env(args)
    return env, int(args.num_processes)


def preload(script: Path) -> None:
    """Import what `script` imports at its top level (names too: hf_fsdp_qlora's API is lazy), so the ranks
    inherit it. A failing import is left for the rank to hit and report."""
    tree = ast.parse(script.read_text(), str(script))
    for node in tree.body:
        if isinstance(node, ast.Import):
            wanted = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            wanted = [(node.module, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in wanted:
            try:
                loaded = importlib.import_module(module)
                for name in names:
                    getattr(loaded, name, None)
            except Exception:  # noqa: BLE001,S112 - the rank re-imports and reports the error itself
                continue


def preload_module(name: str) -> None:
    """Import `name` (as `python -m PACKAGE.MODULE` imports PACKAGE first); a failure is left for the ranks."""
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001,S110 - the rank re-imports and reports the error itself
        pass


def assert_single_threaded() -> None:
    """Refuse to fork a parent that runs other threads (a forked child would inherit their locks held)."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["main"]
    if threading.active_count() != 1 or len(tasks) != 1:
        names = [t.name for t in threading.enumerate()]
        raise SystemExit(
            f"fork_launch: the parent runs {len(tasks)} OS threads ({names}) after its imports, so forking ranks "
            "is unsafe; set OMP_NUM_THREADS=1, or launch this script with dist_utils' fork=False."
        )


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the parent dies (a timed-out test kills the parent)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fresh_seeds() -> None:
    """Give this rank its own random seeds, as a fresh interpreter has (torch 2.13 seeds its default generator
    from the OS per process; forked ranks would otherwise share the parent's state). Python's `random` reseeds
    itself at fork."""
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def run_rank(rank: int, world: int, script: Path, args: list[str], module: str | None = None) -> None:
    """In the forked child: become rank `rank` (world 0: a plain process, no rank environment), run `script` (or
    `module`, given `script` as its first argument) as __main__, and leave with its exit status."""
    _die_with_parent()
    faulthandler.enable(all_threads=True)  # a crashing rank prints its Python stack, as `python -X faulthandler`
    if world:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world), GROUP_WORLD_SIZE="1", ROLE_NAME="default",
            TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
        )  # fmt: skip
    code = 0
    try:
        _fresh_seeds()
        import runpy

        if module:  # as `python -m MODULE SCRIPT ARGS`: the module's path in argv[0], the working directory first
            sys.argv = [module, str(script), *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [str(script), *args]
            sys.path[0] = str(script.parent)
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the rank's traceback, then a failing status, as a launched rank
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: see dist_utils.exit_worker


def wait_ranks(pids: dict[int, int], timeout: float, grace: float = _GRACE_S) -> int:
    """Wait for every rank; kill the rest once one fails (after a grace) or at the timeout. The launch's status:
    0, or the first failing rank's (128+signal for a killed rank). Each rank that fails on its own gets a line (as
    torchrun's summary lists every failed rank's exitcode): a test can tell that every rank exited with 75."""
    deadline, first_failure, kill_at, killed = time.monotonic() + timeout, None, None, False
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline or (kill_at is not None and now > kill_at):
                if now > deadline:
                    print(
                        f"fork_launch: timed out after {timeout:.0f} s; killing ranks {sorted(pids)}", file=sys.stderr
                    )
                for other in pids:
                    os.kill(other, signal.SIGKILL)
                kill_at, deadline, killed = float("inf"), float("inf"), True
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
        if code != 0 and (first_failure is None or not killed):
            print(f"fork_launch: rank {rank} exited with status {code}", file=sys.stderr)
        if code != 0 and first_failure is None:
            first_failure, kill_at = code, time.monotonic() + grace
    return first_failure or 0


def main(argv: list[str] | None = None) -> int:
    opts = _parse(sys.argv[1:] if argv is None else argv)
    script = Path(opts.script).resolve()
    world = opts.num_processes or opts.nproc
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # pyarrow (datasets) bundles a jemalloc that starts a background purge thread when loaded; without it the
    # parent stays single-threaded (arrow's default pool is mimalloc anyway).
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    if opts.single:  # `python SCRIPT ARGS`: one process, world 0 = no rank environment (run_rank)
        world = 0
    elif opts.master_port is None:
        raise SystemExit("fork_launch: --master-port is required for a multi-process launch (or pass --single)")
    else:
        if opts.accelerate_config:
            env, world = accelerate_env(opts.accelerate_config, opts.master_port, opts.num_processes)
            os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(opts.master_port))
    sys.path.insert(0, str(script.parent))
    preload(script)
    if opts.module:  # what the module imports (our run module: our package), inherited by the ranks
        preload_module(opts.module.rpartition(".")[0] or opts.module)
    assert_single_threaded()
    for name in opts.ignore_signal:  # inherited by the ranks, as exec keeps an ignored disposition
        signal.signal(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"), signal.SIG_IGN)
    # The ~500k objects the imports made live as long as the process: moved out of the collector's generations, so
    # each rank's full collections (Trainer.train() runs one, accelerate's free_memory: ~0.25 CPU-s each) only walk
    # what the rank made itself. Python's advice for fork without exec; nothing imported is freed either way.
    if not os.environ.get("TESTS_NO_GC_FREEZE"):  # TESTS_NO_GC_FREEZE=1: to rule the freeze out of a crash hunt
        gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(max(world, 1)):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, world, script, opts.args, opts.module)
        pids[pid] = rank
    return wait_ranks(pids, opts.timeout, opts.grace)


if __name__ == "__main__":
    sys.exit(main())
