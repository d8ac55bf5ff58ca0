"""tests/fork_launch.py, the launcher most of our worker scripts' launches use: its ranks see what a real launch
gives them, and a failing, hanging or thread-running launch fails as a real one does (tiny scripts, no torch)."""

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dist_utils import REPO, _run, accelerate_launch, read_results, torchrun

pytestmark = pytest.mark.distributed

_ENV_DUMP = """
import json, os, sys
keys = [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_", "MASTER_", "TORCHELASTIC_RUN"))]
keys += ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"]
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:], "name": __name__}, f)
"""


def _script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_ranks_get_the_environment_accelerate_launch_gives(tmp_path):
    script = _script(tmp_path, "dump.py", _ENV_DUMP)
    found = {}
    for fork in (False, True):
        out = tmp_path / f"fork{fork}"
        out.mkdir()
        proc = accelerate_launch("cpu_fsdp1_rehearsal.yaml", script, str(out), "x", fork=fork, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[fork] = read_results(out)
    assert sorted(found[True]) == [0, 1]
    for rank in (0, 1):
        real, forked = found[False][rank], found[True][rank]
        assert real.pop("argv") == [str(tmp_path / "forkFalse"), "x"]
        assert forked.pop("argv") == [str(tmp_path / "forkTrue"), "x"]
        real.pop("MASTER_PORT"), forked.pop("MASTER_PORT")  # a fresh port per launch
        assert forked == real
        assert (
            forked["ACCELERATE_USE_FSDP"] == "true" and forked["FSDP_VERSION"] == "1" and forked["name"] == "__main__"
        )


def test_torchrun_ranks(tmp_path):
    """torchrun's rank variables, and each rank its own torch seed (the parent imported torch; a fresh
    interpreter's torch seeds itself from the OS)."""
    out = tmp_path / "out"
    out.mkdir()
    script = _script(
        tmp_path, "dump.py", "import torch\n" + _ENV_DUMP.replace('"name": __name__', '"seed": torch.initial_seed()')
    )
    proc = torchrun(script, str(out), nproc=3, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert sorted(results) == [0, 1, 2]
    assert {r["WORLD_SIZE"] for r in results.values()} == {"3"} and results[2]["LOCAL_RANK"] == "2"
    assert len({r["seed"] for r in results.values()}) == 3


def test_a_failing_rank_fails_the_launch_and_stops_the_others(tmp_path):
    """Rank 1 raises while rank 0 would wait forever (a peer stuck in a collective): the launch fails with rank
    1's traceback and rank 0 is killed after the grace period (2 s here; 15 s by default), not at the timeout."""
    script = _script(
        tmp_path, "fail.py",
        """
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("rank one broke")
        time.sleep(600)
        """,
    )  # fmt: skip
    started = time.monotonic()
    cmd = [sys.executable, str(REPO / "tests" / "fork_launch.py"), "--master-port", "1", "--timeout", "100"]
    proc = _run([*cmd, "--grace", "2", script], 120, None)
    assert proc.returncode == 1
    assert "ValueError: rank one broke" in proc.stderr and "rank 1 exited with status 1" in proc.stderr
    assert "rank 0 exited" not in proc.stderr  # killed by the launcher, not failed on its own
    assert time.monotonic() - started < 60


def test_exit_status_and_timeout(tmp_path):
    code = torchrun(_script(tmp_path, "exit.py", "import sys\nsys.exit(3)\n"), timeout=60)
    assert code.returncode == 3
    hang = _script(tmp_path, "hang.py", "import time\ntime.sleep(600)\n")
    proc = _run([sys.executable, str(REPO / "tests" / "fork_launch.py"), "--master-port", "1", "--timeout", "1",
                 hang], 60, None)  # fmt: skip
    assert proc.returncode == 137 and "timed out after 1 s" in proc.stderr
    with pytest.raises(subprocess.TimeoutExpired):  # ours kills the whole launch: no rank is left behind
        _run([sys.executable, str(REPO / "tests" / "fork_launch.py"), "--master-port", "1", hang], 2, None)


def test_refuses_to_fork_a_threaded_parent(tmp_path):
    _script(
        tmp_path, "threads.py",
        """
        import threading, time
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        """,
    )  # fmt: skip
    # The thread starts at import: the parent's preload of a sibling module runs it.
    _script(tmp_path, "main.py", "import threads\n")
    proc = torchrun(str(tmp_path / "main.py"), timeout=60)
    assert proc.returncode != 0 and "forking ranks is unsafe" in proc.stderr


# --- the fork server (tests/fork_server.py): launches forked from a process that imported the stack once -----------
_WHERE = """
import json, os, sys
os.write(1, f"out {os.getcwd()} {sys.argv[1:]} {os.environ.get('HF_FSDP_QLORA_PROBE')}\\n".encode())  # one write
os.write(2, f"err {os.environ['RANK']}\\n".encode())
found = {"torch": "torch" in sys.modules, "ours": any(m.startswith("hf_fsdp_qlora") for m in sys.modules)}
json.dump(found, open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w"))
"""


def _launch_log(tmp_path, monkeypatch):
    log = tmp_path / "launches.jsonl"
    monkeypatch.setenv("TESTS_LAUNCH_LOG", str(log))
    return lambda: [json.loads(line)["via"] for line in log.read_text().splitlines()]


def test_served_launch_is_a_launch_without_our_package(tmp_path, monkeypatch):
    """Served: the ranks find the stack imported (torch) but not hf_fsdp_qlora, the launch's own environment,
    argv, working directory and separate stdout/stderr. An environment the preload may have read differently
    (HF_HOME) is launched as a subprocess instead."""
    via = _launch_log(tmp_path, monkeypatch)
    script = _script(tmp_path, "where.py", _WHERE)
    for name, extra in (("served", {"HF_FSDP_QLORA_PROBE": "p1"}), ("own", {"HF_HOME": str(tmp_path / "hf")})):
        out = tmp_path / name
        out.mkdir()
        proc = torchrun(script, str(out), timeout=120, env=extra)
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.split("\n")) == [
            "",
            *[f"out {REPO} {[str(out)]} {extra.get('HF_FSDP_QLORA_PROBE')}"] * 2,
        ]
        assert "err 0" in proc.stderr and "err 1" in proc.stderr and "err" not in proc.stdout
        found = read_results(out)
        assert found[0] == found[1] == {"torch": name == "served", "ours": False}, via()
    assert via() == ["server", "subprocess: environment differs in HF_HOME"]


def _server_children(client) -> str:
    pid = client.proc.pid
    return (Path(f"/proc/{pid}/task/{pid}/children")).read_text().strip()


def test_a_dead_server_falls_back_and_leaves_no_process(tmp_path, monkeypatch):
    """A timed-out served launch leaves no rank behind and the server no child; a killed server hands every later
    launch to the subprocess path. (This server preloads no stack: what is tested is its process handling, the
    same whatever it imported; ~8 CPU-s of imports spared.)"""
    import fork_server

    client = fork_server._Client()
    monkeypatch.setattr(fork_server, "_CLIENT", client)
    monkeypatch.setenv("TESTS_FORK_SERVER_PRELOAD", "json")
    via = _launch_log(tmp_path, monkeypatch)
    # Each pid as one marked token: the two ranks' lines may reach the captured output interleaved.
    hang = _script(tmp_path, "hang.py", "import os, time\nprint(f'pid={os.getpid()};', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        _run([sys.executable, str(REPO / "tests" / "fork_launch.py"), "--master-port", "1", hang], 8, None)
    ranks = [int(pid) for pid in re.findall(r"pid=(\d+);", timed_out.value.stdout)]
    assert len(ranks) == 2 and _server_children(client) == ""
    time.sleep(1)
    for pid in ranks:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] in "ZX", pid  # gone (or a zombie init reaps)
    client.proc.kill()
    client.proc.wait()
    out = tmp_path / "after"
    out.mkdir()
    proc = torchrun(_script(tmp_path, "where.py", _WHERE), str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert client.broken and via() == ["subprocess: server failed"]


def test_module_mode_runs_as_python_m(tmp_path):
    """`fork_launch.py -m MODULE SCRIPT ARGS` (how the recipes' resumes run `-m hf_fsdp_qlora.run`): each rank runs
    MODULE as __main__ with argv [its file, SCRIPT, ARGS], as `python -m` gives it, and its exit status counts."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "dumpmod.py").write_text(
        "import json, os, sys\n"
        "found = {'argv': sys.argv, 'name': __name__, 'path0': sys.path[0]}\n"
        "json.dump(found, open(os.path.join(sys.argv[2], 'rank' + os.environ['RANK'] + '.json'), 'w'))\n"
        "sys.exit(int(os.environ['RANK']) * 4)\n"
    )
    cmd = [sys.executable, str(REPO / "tests" / "fork_launch.py"), "--master-port", "1", "-m", "dumpmod"]
    first = tmp_path / "first.py"
    first.write_text("import json\n")  # the module's first argument (what the launch parent preloads from)
    proc = _run([*cmd, str(first), str(out)], 60, {"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 4 and "rank 1 exited with status 4" in proc.stderr, proc.stderr[-2000:]
    found = read_results(out)
    assert sorted(found) == [0, 1]
    for r in found.values():
        assert r == {
            "argv": [str(tmp_path / "dumpmod.py"), str(first), str(out)],
            "name": "__main__",
            "path0": str(REPO),
        }


_CRASHING_WORKER = """
import json, os, signal, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # as launch_scenarios calls a worker: --models M --out O ...
models, rank = args["--models"], os.environ["RANK"]
mode = open(os.path.join(models, "mode")).read()
if rank == "0":
    with open(os.path.join(models, "attempts"), "a") as f:
        f.write("x")
    first = os.path.getsize(os.path.join(models, "attempts")) == 1
    if mode == "always" or (mode == "once" and first):
        os.kill(os.getpid(), signal.SIGSEGV)  # a native crash, as torch's gloo collectives rarely do
    if mode == "fail":
        sys.exit(1)
os.makedirs(args["--out"], exist_ok=True)
with open(os.path.join(args["--out"], f"rank{rank}.json"), "w") as f:
    json.dump({"scenarios": args["--scenarios"]}, f)
"""


@pytest.mark.parametrize("mode", ["once", "always", "fail"])
def test_a_crashed_scenarios_launch_runs_once_more(tmp_path, tmp_path_factory, mode):
    """dist_utils.launch_scenarios (the shared launches ~60 tests read): a rank that segfaults once costs one more
    launch and a warning, not every test; a second crash, or any other failure, fails as before."""
    from dist_utils import launch_scenarios

    script = _script(tmp_path, "crash.py", _CRASHING_WORKER)
    (tmp_path / "mode").write_text(mode)
    warned = pytest.warns(UserWarning, match=r"crashed \(exit 139\); running it once more")
    if mode == "once":
        with warned:
            _, out, results, _ = launch_scenarios(tmp_path_factory, "crash", {}, script=script, models=tmp_path)
        assert results == {0: {"scenarios": ""}, 1: {"scenarios": ""}} and out.parent.name.startswith("crash")
    elif mode == "always":
        with warned, pytest.raises(AssertionError, match="exit code 139"):
            launch_scenarios(tmp_path_factory, "crash", {}, script=script, models=tmp_path)
    else:
        with pytest.raises(AssertionError, match="exit code 1:"):
            launch_scenarios(tmp_path_factory, "crash", {}, script=script, models=tmp_path)
    assert (tmp_path / "attempts").read_text() == ("x" if mode == "fail" else "xx")
