"""finish_distributed (hf_fsdp_qlora/train/finish.py): how a distributed script ends.

One launch of two 2-rank gloo groups side by side (4 plain processes, tests/scripts/finish_worker.py):
- a rank-0-only tail longer than the collective timeout, under `python -m hf_fsdp_qlora.run`: both ranks exit 0
  (a success barrier made the finished rank time out and fail the job);
- `finish_distributed(main())` with a non-daemon thread still running on rank 0 and `main()` returning None on rank
  1: the thread completes and both ranks exit 0 (os._exit killed the thread; None raised TypeError).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from dist_utils import BIN, REPO, SCRIPTS, _env, free_port

pytestmark = pytest.mark.distributed

WORKER = SCRIPTS / "finish_worker.py"


def test_finished_ranks_leave_without_waiting_and_keep_threads_and_none(tmp_path):
    procs, logs = {}, {}
    for case in ("tail", "exit"):
        port = free_port()
        runner = ["-m", "hf_fsdp_qlora.run"] if case == "tail" else []
        for rank in (0, 1):
            logs[case, rank] = tmp_path / f"{case}_rank{rank}.log"
            with logs[case, rank].open("w") as log:  # files, not pipes: nothing blocks while the test polls
                procs[case, rank] = subprocess.Popen(
                    [str(BIN / "python"), *runner, str(WORKER), "--case", case, "--out", str(tmp_path),
                     "--port", str(port)],
                    env=_env({"RANK": str(rank)}), cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
    started, ended = time.time(), {}
    try:
        while len(ended) < len(procs) and time.time() - started < 300:
            ended.update(
                {key: time.time() - started for key, p in procs.items() if key not in ended and p.poll() is not None}
            )
            time.sleep(0.1)
    finally:
        for proc in procs.values():
            proc.kill()
    outputs = {key: path.read_text() for key, path in logs.items()}
    found = {
        # the tail outlasted the collective timeout, and neither rank failed for it
        "tail ran": "rank 0: tail of 8 s done" in outputs["tail", 0],
        "tail statuses": (procs["tail", 0].returncode, procs["tail", 1].returncode),
        # the upload thread finished before its process ended; a main() without return is a success
        "upload done": (tmp_path / "upload_done").is_file(),
        "exit statuses": (procs["exit", 0].returncode, procs["exit", 1].returncode),
        "TypeError": "TypeError" in outputs["exit", 1],
    }
    expected = {"tail ran": True, "tail statuses": (0, 0), "upload done": True, "exit statuses": (0, 0)}
    assert found == {**expected, "TypeError": False}, {key: out[-2000:] for key, out in outputs.items()}
    print("wall s per process:", {f"{case}/{rank}": round(t, 1) for (case, rank), t in ended.items()})


@pytest.mark.parametrize("status, code", [(None, 0), (0, 0), (75, 75), ("stopped: disk full", 1)])
def test_exit_status_reads_like_sys_exit(status, code, capsys):
    from hf_fsdp_qlora.train.finish import exit_status

    assert exit_status(status) == code
    assert capsys.readouterr().err == (f"{status}\n" if isinstance(status, str) else "")
    if isinstance(status, int) or status is None:  # the same statuses as the interpreter's own exit
        done = subprocess.run([sys.executable, "-c", f"import sys; sys.exit({status!r})"], check=False)
        assert done.returncode == code
