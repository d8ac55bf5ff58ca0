"""End a distributed run with a given exit status, without the interpreter teardown.

torch's gloo teardown at interpreter exit sometimes aborts ("terminate called without an active exception", exit
-6) after a successful run, even after a barrier and ``destroy_process_group()``; ``accelerate launch`` then reports a
failure. Scripts (ours, the examples, ``python -m hf_fsdp_qlora.run``) end with :func:`finish_distributed` instead.

A finished rank does not wait for the others: a rank-0-only tail (``push_to_hub``, a merge, generation) may take
longer than the process group's collective timeout, and a rank waiting for it in a barrier would time out (NCCL's
watchdog would kill it) and fail a job whose work is done. Nothing is lost by leaving early: the launcher waits for
every rank, and no rank talks to the others after its script has ended.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

__all__ = ["finish_distributed"]


def exit_status(status) -> int:
    """The process status for `status` as :func:`sys.exit` reads it: ``None`` is 0, an int itself, anything else
    (``sys.exit("message")``) is printed to stderr and is 1."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1


def _stop_idle_thread_pools() -> None:
    """Ask ``concurrent.futures`` thread pools left open to stop once their queued work is done, as the interpreter
    does first at a normal exit: an idle pool worker (vLLM's engine leaves one) is a non-daemon thread that would
    otherwise wait for work forever, and the rank would never exit."""
    pools = sys.modules.get("concurrent.futures.thread")
    stop = getattr(pools, "_python_exit", None)  # the hook the interpreter runs (threading._register_atexit)
    if stop is not None:
        stop()


def _join_non_daemon_threads() -> None:
    """Wait for the non-daemon threads, as the interpreter does at a normal exit (``os._exit`` would kill them:
    an upload started with ``push_to_hub(blocking=False)`` would be cut off while the job reports success)."""
    _stop_idle_thread_pools()
    current = threading.current_thread()
    while True:
        waiting = [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]
        if not waiting:
            return
        for thread in waiting:  # a thread may start another before it ends: look again until none is left
            thread.join()


def finish_distributed(exit_code: int | str | None = 0, *, barrier: bool = False) -> None:
    """Tear down the process group, wait for the script's threads, run exit handlers and exit with `exit_code`.

    Args:
        exit_code: the process's exit status, as :func:`sys.exit` takes it: ``None`` (what a ``main()`` without a
            ``return`` gives) is 0, a string is printed and is 1.
        barrier: meet the other ranks first, in a collective bounded by the process group's timeout. Only where
            every rank arrives at the same moment (after a preemption checkpoint, which the ranks wrote together);
            never after a tail that one rank runs alone.

    Never returns. Non-daemon threads are joined and ``atexit`` handlers run (uploads, trackers and loggers finish
    as at a normal exit); only the interpreter teardown is skipped. The process group is gone before the threads
    are joined: a thread must not use it after the script has ended.
    """
    code = exit_status(exit_code)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the script's own status matters more than the teardown's
        traceback.print_exc()
        code = code or 1
    import atexit

    _join_non_daemon_threads()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
