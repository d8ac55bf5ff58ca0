"""Fork server: one per pytest process, it imports the third-party stack once and forks each fork launch from it.

tests/fork_launch.py already forks a launch's ranks from one parent, but that parent is a fresh interpreter per
launch and pays ~6 CPU-s importing torch, transformers, peft, bitsandbytes, accelerate, trl and datasets. This server
imports them once; each launch is then a child forked from it that runs ``fork_launch.main`` exactly as
``python tests/fork_launch.py ARGS`` would, with the launch's environment, working directory and output files.
hf_fsdp_qlora is never imported here: its import installs hooks (the CPU rehearsal hook, upstream log filters) that
some worker scripts check the absence of; a launch imports it itself, as a fresh one does.

Environment read while importing is fixed at server start, so the client (:func:`run_launch`) hands a launch to
the server only when its environment differs from the server's in keys nothing imported here reads; any other
launch, and every launch after the server fails, runs ``fork_launch.py`` as a subprocess as before.

    python tests/fork_server.py SOCKET      (started by the client; one request = one launch, one at a time)
"""

from __future__ import annotations

import atexit
import importlib
import json
import locale
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What the worker scripts and hf_fsdp_qlora import, at their top level or while they run (models, FSDP, trl).
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.device_mesh", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.run", "torch.nn.functional", "torch.utils.data", "numpy", "yaml", "safetensors.torch",
    "transformers", "transformers.trainer", "transformers.training_args", "transformers.trainer_callback",
    "transformers.modeling_utils", "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.gpt_oss.modeling_gpt_oss",
    "transformers.integrations.bitsandbytes", "transformers.quantizers.auto", "transformers.distributed.fsdp",
    "peft", "peft.tuners.lora", "bitsandbytes", "bitsandbytes.nn", "accelerate", "accelerate.state",
    "accelerate.utils.fsdp_utils", "accelerate.commands.launch", "accelerate.utils.launch",
    "datasets", "trl", "trl.trainer.sft_trainer", "trl.trainer.sft_config",
)  # fmt: skip
# Environment keys a launch may set differently from the server's (nothing preloaded reads them at import):
# pytest's per-test bookkeeping, the tests' own switches (TESTS_*), our package's settings (hf_fsdp_qlora is
# imported per launch), and the inductor cache folder torch exports into the pytest process once a test compiles
# (read when a compile runs).
_FREE_PREFIXES = ("PYTEST_", "TESTS_", "HF_FSDP_QLORA_")
_FREE_KEYS = {"TORCHINDUCTOR_CACHE_DIR", "JE_ARROW_MALLOC_CONF"}
_STARTUP_S = 300.0  # the import of the stack, on a loaded machine


# --- the server --------------------------------------------------------------------------------------------------
def _preload() -> None:
    # TESTS_FORK_SERVER_PRELOAD=a,b: preload only these (test_fork_launch's server-failure test, which needs a
    # server, not the stack: ~8 CPU-s of imports spared).
    wanted = os.environ.get("TESTS_FORK_SERVER_PRELOAD")
    for name in wanted.split(",") if wanted else PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a launch that needs it re-imports it and reports the error
            print(f"fork_server: preloading {name} failed: {err!r}", file=sys.stderr)


def _start_launch(request: dict, fds: list[int], sockets: tuple) -> None:
    """In the forked child: become what `python tests/fork_launch.py ARGS` would be, run it, exit with its status."""
    os.setsid()  # its own process group: the client's timeout kills the launch and its ranks, not the server
    for sock in sockets:
        sock.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, devnull), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
    for fd in (devnull, *fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # re-read TMPDIR
    code = 1
    try:
        import fork_launch

        sys.argv = [str(HERE / "fork_launch.py"), *request["argv"]]
        code = fork_launch.main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught error in a fresh interpreter: traceback, status 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_one(conn: socket.socket, listener: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    try:
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _start_launch(request, fds, (conn, listener))
    finally:
        for fd in fds:
            os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode())
    except OSError:  # nobody waits for this launch (the client runs it as a subprocess): stop it, then reap it
        _kill_group(pid)
        _ignore_errors(os.kill, pid, signal.SIGKILL)  # in case it had not made its group yet
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    reply = {"returncode": code, "cpu_s": usage.ru_utime + usage.ru_stime}
    try:
        conn.sendall(json.dumps(reply).encode())
    except OSError:  # the client gave up (timeout) and closed
        pass


def serve(path: str) -> int:
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")  # see fork_launch.main
    _preload()
    import fork_launch

    if "hf_fsdp_qlora" in sys.modules:
        print("fork_server: hf_fsdp_qlora was imported by the preload; refusing to serve", file=sys.stderr)
        return 2
    fork_launch.assert_single_threaded()
    parent = os.getppid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(path)
        listener.listen(4)
        print("fork_server: ready", flush=True)
        while os.getppid() == parent:  # the pytest process is gone: leave
            if not select.select([listener], [], [], 1.0)[0]:
                continue
            conn, _ = listener.accept()
            with conn:
                try:
                    _serve_one(conn, listener)
                except (OSError, ValueError) as err:  # one bad or abandoned request: the next one is served
                    print(f"fork_server: request failed: {err!r}", file=sys.stderr, flush=True)
    return 0


# --- the client (in the pytest process) --------------------------------------------------------------------------
class _Client:
    """This process's server: started on first use, stopped at exit; `broken` once it failed (then never again)."""

    def __init__(self):
        self.proc, self.dir, self.env, self.broken, self.lock = None, None, None, False, threading.Lock()
        self.skipped = ""  # why the last launch was not served (the launch log records it)

    def start(self, env: dict) -> bool:
        self.dir = tempfile.mkdtemp(prefix="fork_server_")
        self.env = {**env, "JE_ARROW_MALLOC_CONF": env.get("JE_ARROW_MALLOC_CONF", "background_thread:false")}
        log = open(Path(self.dir) / "server.log", "wb")  # noqa: SIM115 - the server's own output, for a failure
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fork_server.py"), self.socket_path()],
                                     env=self.env, cwd=str(HERE.parent), stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        log.close()
        atexit.register(self.stop)
        deadline = time.monotonic() + _STARTUP_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if b"fork_server: ready" in (Path(self.dir) / "server.log").read_bytes():
                return True
            time.sleep(0.1)
        return self.fail("did not start")

    def socket_path(self) -> str:
        return str(Path(self.dir) / "sock")

    def fail(self, why: str) -> bool:
        self.broken = True
        log = (Path(self.dir) / "server.log").read_text(errors="replace")[-3000:] if self.dir else ""
        print(f"fork_server: {why}; launches run fork_launch.py as a subprocess from now on\n{log}", file=sys.stderr)
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


_CLIENT = _Client()


def skipped() -> str:
    """Why the last launch handed to :func:`run_launch` ran as a subprocess."""
    return _CLIENT.skipped


def differing_keys(env: dict, base: dict) -> list[str]:
    """The keys in which a launch's environment differs from the server's and which the preload may have read."""
    keys = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)} - _FREE_KEYS
    return sorted(k for k in keys if not k.startswith(_FREE_PREFIXES))


def _decode(data: bytes) -> str:
    """As subprocess.run(text=True) decodes: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def run_launch(argv: list[str], timeout: float, env: dict):
    """Run `fork_launch.py ARGV` in a child of this process's fork server. Returns (returncode, stdout, stderr,
    cpu_s), raises subprocess.TimeoutExpired as subprocess.run does, or returns None (not served: the caller runs
    the subprocess)."""
    _CLIENT.skipped = "another launch in flight"
    if not _CLIENT.lock.acquire(blocking=False):  # another thread's launch is in flight: serve one at a time
        return None
    try:
        _CLIENT.skipped = "server failed"
        if _CLIENT.broken or (_CLIENT.proc is None and not _CLIENT.start(env)):
            return None
        _CLIENT.skipped = "environment differs in " + ",".join(differing_keys(env, _CLIENT.env))
        if differing_keys(env, _CLIENT.env):
            return None
        _CLIENT.skipped = "server failed"
        return _request(argv, timeout, env)
    finally:
        _CLIENT.lock.release()


def _request(argv: list[str], timeout: float, env: dict):
    """One launch: its stdout and stderr are pipes read here (as subprocess.run(capture_output=True) reads them)."""
    (out, out_w), (err, err_w) = os.pipe(), os.pipe()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        try:
            conn.connect(_CLIENT.socket_path())
            request = {"argv": argv, "env": env, "cwd": str(HERE.parent)}
            socket.send_fds(conn, [json.dumps(request).encode()], [out_w, err_w])
            os.close(out_w), os.close(err_w)
            conn.settimeout(60)
            pid = json.loads(conn.recv(4096))["pid"]
        except (OSError, ValueError, KeyError) as error:
            for fd in (out, err, out_w, err_w):
                _ignore_errors(os.close, fd)
            _CLIENT.fail(f"request failed ({error!r})")
            return None
        conn.setblocking(False)
        try:
            reply, timed_out, texts = _collect(conn, pid, {out: [], err: []}, timeout)
        except BaseException:  # interrupted (Ctrl-C, a failing hook): leave no launch running in its own session
            _kill_group(pid)
            raise
    stdout, stderr = texts
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, str(HERE / "fork_launch.py"), *argv], timeout, stdout, stderr)
    if not reply:  # the server died during the launch (now killed): run it again as a subprocess
        _CLIENT.fail("died during a launch")
        return None
    reply = json.loads(reply)
    return reply["returncode"], stdout, stderr, reply["cpu_s"]


def _collect(conn: socket.socket, pid: int, chunks: dict, timeout: float):
    """Read the launch's output until both pipes close and the server reported its status (b"" if the server
    died); at the timeout kill the launch's process group and keep reading what is left (up to 60 s more).
    Returns (reply, timed out, (stdout, stderr))."""
    reading, reply, timed_out = set(chunks), None, False
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(conn, selectors.EVENT_READ)
        while reading or reply is None:
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:
                    break
                _kill_group(pid)
                timed_out, deadline = True, time.monotonic() + 60
                continue
            for key, _ in selector.select(left):
                if key.fileobj is conn:
                    reply = conn.recv(4096)
                    selector.unregister(conn)
                    if not reply:  # the server is gone: stop the launch
                        _kill_group(pid)
                    continue
                data = os.read(key.fd, 1 << 16)
                chunks[key.fd].append(data)
                if not data:
                    selector.unregister(key.fd)
                    reading.discard(key.fd)
    for fd in chunks:
        os.close(fd)
    return reply, timed_out, tuple(_decode(b"".join(parts)) for parts in chunks.values())


def _kill_group(pid: int) -> None:
    _ignore_errors(os.killpg, pid, signal.SIGKILL)


def _ignore_errors(fn, *args):
    try:
        return fn(*args)
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
