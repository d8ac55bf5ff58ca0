"""finish_distributed (hf_fsdp_qlora/train/finish.py): how a distributed script ends.

Two 2-rank gloo groups, one after the other (tests/scripts/finish_worker.py; the ranks forked by tests/fork_launch.py
from this process's fork server, so none pays the imports; each rank runs the worker as `python [-m MODULE] SCRIPT`
would, and the launcher lists every rank that fails on its own):
- a rank-0-only tail longer than the collective timeout, under `python -m hf_fsdp_qlora.run`: both ranks exit 0
  (a success barrier made the finished rank time out and fail the job);
- `finish_distributed(main())` with a non-daemon thread still running on rank 0 and `main()` returning None on rank
  1: the thread completes and both ranks exit 0 (os._exit killed the thread; None raised TypeError), also with an
  idle thread pool left open on rank 0, as vLLM's engine leaves one (joining its worker hung the rank forever).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from dist_utils import FORK_LAUNCH, SCRIPTS, _run, free_port

pytestmark = pytest.mark.distributed

WORKER = SCRIPTS / "finish_worker.py"


def test_finished_ranks_leave_without_waiting_and_keep_threads_and_none(tmp_path):
    outputs, walls = {}, {}
    for case in ("tail", "exit"):
        runner = ["-m", "hf_fsdp_qlora.run"] if case == "tail" else []
        cmd = [sys.executable, str(FORK_LAUNCH), "--master-port", str(free_port()), "--timeout", "240", *runner,
               str(WORKER), "--case", case, "--out", str(tmp_path), "--port", str(free_port())]  # fmt: skip
        started = time.time()
        proc = _run(cmd, 300, None)
        walls[case] = round(time.time() - started, 1)
        outputs[case] = (proc.returncode, proc.stdout + proc.stderr)
    found = {
        # the tail outlasted the collective timeout, and neither rank failed for it
        "tail ran": "rank 0: tail of 8 s done" in outputs["tail"][1],
        "tail status": outputs["tail"][0],
        # the upload thread finished before its process ended; a main() without return is a success
        "upload done": (tmp_path / "upload_done").is_file(),
        "exit status": outputs["exit"][0],
        "TypeError": "TypeError" in outputs["exit"][1],
        "failed ranks": "exited with status" in outputs["tail"][1] + outputs["exit"][1],
    }
    expected = {"tail ran": True, "tail status": 0, "upload done": True, "exit status": 0}
    assert found == {**expected, "TypeError": False, "failed ranks": False}, {
        k: o[-2000:] for k, (_, o) in outputs.items()
    }
    print("wall s per launch:", walls)


@pytest.mark.parametrize("status, code", [(None, 0), (0, 0), (75, 75), ("stopped: disk full", 1)])
def test_exit_status_reads_like_sys_exit(status, code, capsys):
    from hf_fsdp_qlora.train.finish import exit_status

    assert exit_status(status) == code
    assert capsys.readouterr().err == (f"{status}\n" if isinstance(status, str) else "")
    if isinstance(status, int) or status is None:  # the same statuses as the interpreter's own exit
        done = subprocess.run([sys.executable, "-c", f"import sys; sys.exit({status!r})"], check=False)
        assert done.returncode == code
