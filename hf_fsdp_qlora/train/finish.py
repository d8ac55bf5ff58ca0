"""End a distributed run with a given exit status, without the interpreter teardown.

torch's gloo teardown at interpreter exit sometimes aborts ("terminate called without an active exception", exit
-6) after a successful run, even after a barrier and ``destroy_process_group()``; ``accelerate launch`` then reports a
failure. Scripts (ours, the examples, ``python -m hf_fsdp_qlora.run``) end with :func:`finish_distributed` instead.
"""

from __future__ import annotations

import os
import sys
import traceback

__all__ = ["finish_distributed"]


def finish_distributed(exit_code: int = 0, *, barrier: bool | None = None) -> None:
    """Meet the other ranks, tear down the process group, run exit handlers and exit with `exit_code`.

    Args:
        exit_code: the process's exit status.
        barrier: meet the other ranks before the teardown; by default only when `exit_code` is 0 (a failed rank
            may never reach a barrier, and the launcher ends the others).

    Never returns. ``atexit`` handlers run (trackers and loggers flush as at a normal exit); only the interpreter
    teardown is skipped.
    """
    code = exit_code
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if barrier if barrier is not None else code == 0:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the script's own status matters more than the teardown's
        traceback.print_exc()
        code = code or 1
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
