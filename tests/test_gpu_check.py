"""The GPU check (benchmarks/gpu) in its dry-run form: every stage at tiny shape on CPU (gloo, no CUDA).

One run of ``python -m benchmarks.gpu --dry-run`` (one launch per accelerate config, all stages' scenarios in it),
then each stage's figures are checked against what they must be: FSDP engaged as each shipped config asks, losses
within the stated tolerance of the no-FSDP run, the saved adapter equal to the live one, the merge equal to peft's,
activation checkpointing keeping fewer bytes than none, the bisection's answer fitting and the next step not. The
GPU figures themselves come from a run on a GPU (docs/gpu-check.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dist_utils import REPO

sys.path.insert(0, str(REPO))

from benchmarks.gpu._worker_stages import adapter_dtype_missing
from benchmarks.gpu.budget import DEFAULT_RUN_S, NAMES, PLAN, deadlines, first_run_estimate, resumed_run_estimate
from benchmarks.gpu.profiles import PROFILES
from benchmarks.gpu.report import Report
from benchmarks.gpu.stages import FAST_CUDA_TESTS
from benchmarks.gpu.wheels import OFFLINE_COMMAND, OFFLINE_COMMANDS, REPORT, RESUME_COMMAND, WHEELS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("gpu_report"), tmp_path_factory.mktemp("gpu_work")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=str(REPO), check=False)  # fmt: skip
    report = json.loads((out / "gpu_report.json").read_text())
    return proc, report, (out / "gpu_report.md").read_text(), work


RESUMED = ("fp32_vs_bf16", "moe_speed", "longest_seq")  # no share in the first run: they run in the resumed one
# fp32_vs_bf16 needs issue 34's API (adapter_dtype); a tree without it reports the stage "not yet available".
WAITING = ("fp32_vs_bf16",) if adapter_dtype_missing() else ()


class TestDryRun:
    """The dry run's figures, stage by stage. One class, so that the floors job's `--dist loadscope` (Makefile) runs
    them, and the module fixture `dry`, in one pytest-xdist worker while the other worker takes the rest."""

    def test_every_stage_ran_in_order_of_value_and_reported(self, dry):
        proc, report, md, _ = dry
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        stages = report["stages"]
        assert list(stages) == ["setup", "tests", "correctness", "memory", "speed", *RESUMED, "capacity", "tests_rest"]
        assert {k: s["status"] for k, s in stages.items()} == {
            k: "not yet available" if k in WAITING else "ok" for k in stages
        }
        for name in WAITING:
            assert "adapter_dtype" in stages[name]["waiting_for"] and f"## {name}: not yet available" in md
        for name in set(stages) - set(WAITING):
            assert f"## {name}: ok" in md
        # Written the moment each ended: the stage lines of the log come in plan order.
        assert [ln.split()[1][:-1] for ln in proc.stdout.splitlines() if ln.startswith("stage ")] == list(NAMES)
        assert report["header"]["dry_run"] is True and report["header"]["versions"]["torch"]
        assert report["header"]["plan"][0] == "tests: 40 s" and report["header"]["plan"][-1] == "tests_rest: rest s"
        # The fast CUDA tests and the rest, collected (no GPU to run them): every chosen node id still exists.
        assert stages["tests"]["collected"] >= len(FAST_CUDA_TESTS) and stages["tests_rest"]["collected"] >= 3
        setup = stages["setup"]
        assert setup["build_s"] > 0 and setup["parameters"] > 0  # the model build, timed (the wheel install: below)
        for name in NAMES:
            assert stages[name]["deadline_in_s"] >= 0 and "share_s" in stages[name]
        assert report["total_s"] <= report["header"]["budget_s"]  # every stage within the run's budget

    def test_correctness_fsdp_engaged_losses_adapters_merge(self, dry):
        stage = dry[1]["stages"]["correctness"]
        rows = {r["config"].split()[0]: r for r in stage["rows"]}
        assert set(rows) == {
            "none",
            "fsdp2_qlora",
            "fsdp1_qlora",
            "callback",
        }  # offload needs an accelerator: skipped, said so
        assert any("fsdp2_qlora_offload" in n for n in stage["notes"])
        assert any("one GPU cannot show FSDP's sharding" in n and "2-rank" in n for n in stage["notes"])
        assert rows["none"]["distributed_type"].endswith("NO")
        for name in ("fsdp2_qlora", "fsdp1_qlora", "callback"):
            assert rows[name]["distributed_type"].endswith("FSDP")
        runs = stage["runs"]
        assert (
            runs["b.fsdp2_qlora"]["engaged"]["dtensor_params"] > 0
            and runs["b.fsdp2_qlora"]["engaged"]["fsdp1_units"] == 0
        )
        assert (
            runs["b.fsdp1_qlora"]["engaged"]["flat_params"] > 0
            and runs["b.fsdp1_qlora"]["engaged"]["fsdp2_modules"] == 0
        )
        for row in rows.values():
            assert row["fsdp_engaged_as_asked"] and row["adapter_saved_reloaded_equal"], row
            assert len(row["losses"]) == 3 and all(4 < x < 7 for x in row["losses"])  # ln(256) = 5.55 at the start
            assert row["adapter_tensors"] > 0
        for name in ("fsdp2_qlora", "fsdp1_qlora", "callback"):
            assert rows[name]["max_rel_diff_vs_no_fsdp"] <= stage["loss_rtol"]
        assert rows["none"]["losses"][0] != rows["none"]["losses"][-1]  # it trained
        merge = stage["merge"]
        assert stage["merge_equal_to_peft"] and merge["tensors_beyond_one_bf16_ulp"] == 0
        assert merge["tensors_changed_vs_base"] > 0  # the adapter moved the weights: equality is not trivial

    def test_memory_plan_beside_measured(self, dry):
        stage = dry[1]["stages"]["memory"]
        rows = {r["run"]: r for r in stage["rows"]}
        assert len(rows) == 8
        for seq in (32, 64):
            ckpt, none = rows[f"none.ckpt.{seq}"], rows[f"none.no_ckpt.{seq}"]
            # Measured and planned alike: without checkpointing more is kept for backward.
            assert none["saved_for_backward_mib"] > ckpt["saved_for_backward_mib"] > 0
            assert none["plan_activations_mib"] > ckpt["plan_activations_mib"] > 0
            assert rows[f"fsdp2.ckpt.{seq}"]["plan_total_gib"] > 0
        assert rows["none.ckpt.64"]["saved_for_backward_mib"] > rows["none.ckpt.32"]["saved_for_backward_mib"]
        assert all(run["saved_tensor_hooks"] for run in stage["runs"].values())  # the CPU stand-in is on here only

    def test_speed_contestants_with_their_engines(self, dry):
        stage = dry[1]["stages"]["speed"]
        rows = {r["contestant"]: r for r in stage["rows"]}
        for name in ("stock", "ours_no_fsdp", "ours_fsdp2", "ours_compile"):
            assert rows[name]["tokens_per_s"] > 0 and rows[name]["peak_memory_gib"] > 0, rows[name]
        assert rows["ours_fsdp2"]["distributed_type"].endswith("FSDP")
        assert rows["ours_compile"]["distributed_type"].endswith("FSDP")
        assert rows["stock"]["distributed_type"].endswith("NO")
        assert stage["runs"]["d.ours_compile.r0"]["engaged"]["fsdp2_modules"] > 0
        for name, run in stage["runs"].items():  # no Python saved-tensor hook slowed a timed run
            if run.get("status") == "ok":
                assert run["saved_tensor_hooks"] is False and "saved_for_backward_bytes_per_step" not in run, name
        tt = rows["torchtune"]
        assert tt["tokens_per_s"] if tt["status"] == "ok" else "torchtune" in tt["reason"]

    def test_capacity_bisection_answers_fit_and_next_does_not(self, dry):
        stage, work = dry[1]["stages"]["capacity"], dry[3]
        c = PROFILES["dry"]["capacity_seq"]
        assert stage["largest_shape"] == "tiny-wide"  # the first (largest) shape of the chain
        assert any("set_per_process_memory_fraction" in n and "CUDA context" in n for n in stage["notes"])
        found = {(r["cap"], r["recipe"]): r["longest_seq"] for r in stage["rows"]}
        assert found[("small", "stock")] < found[("large", "stock")]
        for (cap, who), longest in found.items():
            probes = [json.loads(x) for x in (work / "runs" / "dry-none" / f"probes-e.seq.{who}.{cap}.jsonl").open()]
            ok = {p["seq"]: p["ok"] for p in probes}
            assert ok[longest] and (longest == c["high"] or ok.get(longest + c["step"]) is False), (cap, who, probes)

    def test_fp32_moe_longest_side_by_side(self, dry):
        """The resumed run's stages at tiny shape: fp32 against bf16 adapters (each trained in the dtype asked, where
        the API exists), the MoE layer's three contestants agreeing, and the longest sequence's bisection answer."""
        stages, work = dry[1]["stages"], dry[3]
        fp32 = {r["adapter_dtype"]: r for r in stages["fp32_vs_bf16"]["rows"]}
        for dtype, row in fp32.items():
            assert (
                row["trained_in"] == [dtype] and row["s_per_step"] > 0 if not WAITING else "issue 34" in row["error"]
            )
        moe = stages["moe_speed"]
        rows = {r["contestant"]: r for r in moe["rows"]}
        assert set(rows) == {"grouped", "loop", "stock", "grouped+lora", "loop+lora"}
        assert all(r["ms"] > 0 and r["operator_calls"] > 0 for r in rows.values())
        assert (
            rows["grouped"]["grouped_mm_calls"] > 0
            and rows["loop"]["grouped_mm_calls"] == 0 < rows["loop"]["mm_calls"]
        )
        assert (
            rows["stock"]["dequantize_calls"] == 0 < rows["grouped"]["dequantize_calls"]
        )  # stock holds 16-bit weights
        assert max(moe["max_rel_diff"].values()) < 0.05, moe["max_rel_diff"]  # bf16: the same layer three ways
        (row,) = stages["longest_seq"]["rows"]
        c = PROFILES["dry"]["longest"]
        probes = [json.loads(x) for x in (work / "runs" / "dry-none" / "probes-h.longest.small.small.jsonl").open()]
        ok = {p["seq"]: p["ok"] for p in probes}
        assert c["low"] < row["longest_seq"] < c["high"] and row["doctor_longest"] == 0  # the weights exceed the cap
        assert ok[row["longest_seq"]] and ok.get(row["longest_seq"] + c["step"]) is False, probes


def test_report_is_written_stage_by_stage(tmp_path):
    report = Report(tmp_path, {"dry_run": True})
    report.add("tests", {"status": "ok", "seconds": 1.0, "passed": 3})
    assert json.loads((tmp_path / "gpu_report.json").read_text())["stages"]["tests"]["passed"] == 3
    assert "## tests: ok" in (tmp_path / "gpu_report.md").read_text()
    assert not list(tmp_path.glob("*.tmp"))


def test_offline_commands_install_what_gpu_wheels_fetches():
    for command in OFFLINE_COMMANDS:
        assert command.startswith("python3 benchmarks/gpu/install_wheels.py .whl /tmp/site && export PYTHONPATH")
    # every stage, in plan order, the console beside the report
    assert f"python3 -m benchmarks.gpu --out {REPORT} 2>&1 | tee {REPORT}/log.txt" in OFFLINE_COMMAND
    assert f"--resume-from {REPORT}/gpu_report.json --out {REPORT}_2" in RESUME_COMMAND
    assert {w.split("==")[0] for w in WHEELS} >= {"bitsandbytes", "trl", "datasets", "dill", "multiprocess"}
    docs = (REPO / "docs" / "gpu-check.md").read_text()
    assert all(command in docs for command in OFFLINE_COMMANDS)  # the page gives the exact commands
    assert f"{DEFAULT_RUN_S} s" in docs
    makefile = (REPO / "Makefile").read_text()
    assert "benchmarks.gpu.wheels" in makefile and "gpu-check:" in makefile


def test_unknown_stage_is_refused():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--stages", "tests,bogus"], capture_output=True,
                          text=True, cwd=str(REPO), check=False, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--stages takes names of tests, correctness" in proc.stderr


def test_gpu_scheduling_isolates_chains_and_time_boxes(monkeypatch, tmp_path):
    """The GPU form's launch plan (no GPU needed; the launch itself is replaced by a recorder): consecutive scenarios
    of one config share a launch, `isolate` ones (OOM risks, speed rounds) get their own, a chain stops at its first
    success (largest shape), a spent time box launches nothing, and correctness launches all at once."""
    import time

    from benchmarks.gpu import check, stages, stages_speed

    launches, active, running = [], [0], [0]

    def fake_launch(ctx, config, scenarios, tag, timeout):
        launches.append((config, [sc["name"] for sc in scenarios]))
        running[0] += 1
        time.sleep(0.2)  # long enough for launches made at once to overlap
        active.append(running[0])
        running[0] -= 1
        return {sc["name"]: {"status": "oom" if sc["name"] == "e.shape.llama3.1-70b" else "ok"} for sc in scenarios}

    monkeypatch.setattr(check, "launch", fake_launch)
    ctx = check.Context(root=REPO, work=tmp_path, model=tmp_path / "m", profile=PROFILES["gpu"], dry=False,
                        device="cuda", gpu_memory=80 * 2**30)  # fmt: skip
    check.run_scenarios(ctx, stages.correctness_scenarios(ctx), time.monotonic() + 600)
    assert launches == [(None, ["b.none", "b.merge"]), ("fsdp2_qlora", ["b.fsdp2_qlora", "b.callback"]),
                        ("fsdp1_qlora", ["b.fsdp1_qlora"]), ("fsdp2_qlora_offload", ["b.fsdp2_qlora_offload"])]  # fmt: skip
    expected, active = list(launches), []
    launches.clear()
    check.run_scenarios(ctx, stages.correctness_scenarios(ctx), time.monotonic() + 600, parallel=True)
    assert sorted(launches, key=str) == sorted(expected, key=str) and max(active) == 4  # the same four, at once
    launches.clear()
    results = check.run_scenarios(ctx, stages_speed.capacity_scenarios(ctx), time.monotonic() + 600)
    assert [names for _, names in launches] == [["e.shape.llama3.1-70b"], ["e.shape.codellama-34b"], ["e.seq.ours"],
                                                ["e.seq.stock"]]  # fmt: skip
    assert "e.shape.llama2-13b" not in results  # the 34B shape ran: the smaller one is not tried
    speed = stages_speed.speed_scenarios(ctx)
    assert len({sc["name"] for sc in speed}) == len(speed) == 2 * len(stages_speed.CONTESTANTS)
    assert [sc["name"] for sc in speed][:2] == ["d.stock.r0", "d.ours_no_fsdp.r0"]
    assert [sc["name"] for sc in speed][5] == "d.ours_no_fsdp.r1"  # the order rotates each round
    launches.clear()
    stopped = check.run_scenarios(ctx, speed, time.monotonic() + 1)
    assert not launches and all(r["status"] == "stopped" for r in stopped.values())


def _gpu_ctx(tmp_path):
    from transformers import LlamaConfig

    from benchmarks.gpu import check

    model = tmp_path / "llama3.1-8b"
    LlamaConfig(**PROFILES["gpu"]["shape"]).save_pretrained(model)  # config.json only: the doctor plans from it
    return check.Context(root=REPO, work=tmp_path, model=model, profile=PROFILES["gpu"], dry=False, device="cuda",
                         gpu_memory=80 * 2**30)  # fmt: skip


def test_memory_goal_compares_the_allocator_part_of_the_plan(tmp_path):
    """Like with like: CUDA's max_memory_allocated never holds the plan's runtime overhead (the CUDA context), so a
    peak equal to the rest of the plan meets the goal exactly (the total against it was 7-12% high)."""
    from benchmarks.gpu import stages

    ctx = _gpu_ctx(tmp_path)
    results = {}
    for sc in stages.memory_scenarios(ctx):
        plan = stages._plan(ctx, sc)
        assert plan.parts["runtime_overhead"] > 0
        allocator = plan.total - plan.parts["runtime_overhead"]
        results[sc["name"]] = {"status": "ok", "max_allocated": allocator, "max_reserved": allocator}
    summary = stages.memory_summary(ctx, results)
    assert summary["status"] == "ok" and summary["goals"][0].endswith(": met"), summary["goals"]
    for row in summary["rows"]:
        assert row["plan_vs_allocated"] == pytest.approx(1.0) and row["plan_vs_reserved"] == pytest.approx(1.0), row


def test_mfu_counts_matmul_parameters_not_the_embedding(tmp_path):
    """The FLOPs per token against an oracle: the weights of the nn.Linear modules of the real 8B-shaped model
    (built on the meta device), which excludes the embedding lookup and the norms."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu import stages_speed

    ctx = _gpu_ctx(tmp_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**PROFILES["gpu"]["shape"]))
    ctx.parameters = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    s, seq = PROFILES["gpu"]["shape"], PROFILES["gpu"]["speed"]["seq"]
    assert stages_speed.matmul_parameters(ctx) == linear
    assert stages_speed._flops_per_token(ctx) == 4 * linear + 8 * s["num_hidden_layers"] * seq * s["hidden_size"]


def test_budget_plan_fits_one_run():
    """The stage plan and its arithmetic at the real shape: stages in order of value, each stage's estimate within
    its share, set-up + shares + margin within the default run's 480 s (capacity and the rest of the CUDA tests take
    what is left, most of them in a resumed run), and deadlines that pass unused time on and never exceed the end."""
    assert NAMES == ("tests", "correctness", "memory", "speed", *RESUMED, "capacity", "tests_rest")
    for stage in PLAN:
        if stage.share_s is not None:
            assert 0 <= stage.estimate_s <= (stage.resume_share_s or stage.share_s), stage
        assert not stage.waiting_for  # no slot left
        assert (stage.resume_share_s is not None) == (stage.name in RESUMED) and stage.share(False) == stage.share_s
    assert all(s.share_s == 0 and s.share(True) > 0 for s in PLAN if s.name in RESUMED)
    assert [s.name for s in PLAN if s.share_s is None] == ["capacity", "tests_rest"]
    first = first_run_estimate()
    assert first["fits"] and first["setup_s"] + first["shares_s"] + first["margin_s"] <= DEFAULT_RUN_S
    assert first["left_for_unshared_s"] >= 0
    assert not first_run_estimate(install_s=200)["fits"]  # a slow install is seen for what it costs
    marks = deadlines(list(PLAN), start=1000.0, end=1000.0 + 400)
    assert list(marks) == list(NAMES)
    assert marks["tests"] == 1040 and marks["correctness"] == 1150 and marks["speed"] == 1375  # cumulative
    assert marks["fp32_vs_bf16"] == marks["longest_seq"] == 1375 and marks["capacity"] == marks["tests_rest"] == 1400
    short = deadlines(list(PLAN), start=0.0, end=100.0)  # set-up ran long: the earliest stages keep their shares
    assert short["tests"] == 40 and short["correctness"] == 100 and short["speed"] == 100
    # The resumed run: what the first left (speed's second round) and the three stages with their own shares first,
    # capacity and the rest of the tests after them.
    again = resumed_run_estimate()
    assert again["fits"] and again["shares_s"] == 150 + sum(PLAN[NAMES.index(n)].resume_share_s for n in RESUMED)
    later = deadlines([s for s in PLAN if s.name in ("speed", *RESUMED, "capacity")], 0.0, 400.0, resumed=True)
    assert later["speed"] == 150 and later["fp32_vs_bf16"] == 230 and later["longest_seq"] == 370
    assert later["capacity"] == 400


STAND_IN_WORKER = """
import json, os, shutil, sys, time
spec = json.load(open(sys.argv[1]))
for sc in spec["scenarios"]:
    if sc.get("hang"):  # what the report holds while this stage runs, then a hang the deadline must end
        shutil.copy(os.environ["GPU_REPORT"], os.environ["GPU_REPORT"] + ".during")
        time.sleep(600)
    with open(os.path.join(spec["out"], "results-rank0.jsonl"), "a") as f:
        f.write(json.dumps({"name": sc["name"], "status": "ok"}) + "\\n")
"""


def test_stage_killed_at_its_deadline_keeps_earlier_results(monkeypatch, tmp_path):
    """A real launch (its own process group, killed at the stage's deadline) of a stand-in worker (no model: the
    kill is what is under test): the earlier stage's results were in the report folder before the kill and stay there, the killed
    stage keeps the scenario it finished and is "stopped" (a resumed run runs it again), and the next stage runs."""
    import time

    from benchmarks.gpu import check, launch
    from benchmarks.gpu.budget import Stage

    worker = tmp_path / "worker.py"
    worker.write_text(STAND_IN_WORKER)
    monkeypatch.setattr(launch, "WORKER", worker)
    out = tmp_path / "out"
    monkeypatch.setenv("GPU_REPORT", str(out / "gpu_report.json"))

    def summary(ctx, results):
        return {"status": "ok" if all(r["status"] == "ok" for r in results.values()) else "failed"}

    scenarios = {"a": [{"name": "a.1"}], "b": [{"name": "b.1"}, {"name": "b.2", "hang": True}], "c": [{"name": "c.1"}]}
    for name, mine in scenarios.items():
        runs = [{**sc, "config": None, "kind": "stand-in"} for sc in mine]
        monkeypatch.setitem(check.STAGES, name, (lambda ctx, runs=runs: runs, summary))
    ctx = check.Context(root=REPO, work=tmp_path, model=tmp_path / "m", profile=PROFILES["dry"], dry=False,
                        device="cpu", gpu_memory=None)  # fmt: skip
    report = Report(out, {"dry_run": False})
    # a's unused share goes to b. The stand-in starts in well under a second, so a launch is refused only under 1 s
    # left here (the check's 5 s is for the real worker) and the shares, the seconds this test waits, stay short.
    monkeypatch.setattr(check, "MIN_LAUNCH_S", 1.0)
    plan = [Stage("a", 2, 1, "a"), Stage("b", 2, 1, "b"), Stage("c", None, 1, "c")]
    t = time.monotonic()
    check.run_stages(ctx, report, plan, end=t + 120)
    during = json.loads((out / "gpu_report.json.during").read_text())["stages"]
    assert list(during) == ["a"] and during["a"]["status"] == "ok"  # on disk before b was killed
    final = json.loads((out / "gpu_report.json").read_text())["stages"]
    assert {k: v["status"] for k, v in final.items()} == {"a": "ok", "b": "stopped", "c": "ok"}
    assert final["b"]["runs"]["b.1"]["status"] == "ok" and final["b"]["runs"]["b.2"]["status"] == "timeout"
    b = final["b"]
    assert 2 < b["deadline_in_s"] <= 4 and b["deadline_in_s"] <= b["seconds"] < b["deadline_in_s"] + 10  # not 600
    done, kept = check.resumed(str(out / "gpu_report.json"))
    assert done.keys() == {"a", "c"} and not kept  # a resumed run runs b again (all of it: b is no RUNS_KEPT stage)
    monkeypatch.setattr(check, "RUNS_KEPT", ("b",))
    done, kept = check.resumed(str(out / "gpu_report.json"))
    assert kept == {"b": {"b.1": {**final["b"]["runs"]["b.1"], "from": str(out / "gpu_report.json")}}}
    (out / "gpu_report.json.during").unlink()
    again = Report(tmp_path / "again", {"dry_run": False})
    monkeypatch.setenv("GPU_REPORT", str(tmp_path / "again" / "gpu_report.json"))
    check.run_stages(ctx, again, plan[1:2], time.monotonic() + 60, kept=kept)  # b.1 kept, only b.2 launched
    runs = again.data["stages"]["b"]["runs"]
    assert runs["b.1"]["from"] and runs["b.2"]["status"] == "timeout"


def test_install_unpacks_what_the_check_imports(tmp_path):
    """install_wheels.py's unpacking against pip's layout: the import tree and the .dist-info (importlib.metadata
    finds the version), no .data/scripts, and the bitsandbytes kernels of the machine's CUDA major only."""
    import importlib.metadata
    import zipfile

    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import install_wheels

    wheel = tmp_path / "toy_pkg-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("toy_pkg/__init__.py", "VALUE = 7\n")
        z.writestr("toy_pkg-1.2.3.dist-info/METADATA", "Metadata-Version: 2.1\nName: toy-pkg\nVersion: 1.2.3\n")
        z.writestr("toy_pkg-1.2.3.data/scripts/toy", "#!/bin/sh\n")
    site = tmp_path / "site"
    assert install_wheels.main(str(tmp_path), str(site)) == 0
    assert (site / "toy_pkg" / "__init__.py").exists() and not list(site.glob("*.data"))
    found = list(importlib.metadata.distributions(path=[str(site)]))
    assert [(d.metadata["Name"], d.version) for d in found] == [("toy-pkg", "1.2.3")]
    assert json.loads((site / "install_seconds.json").read_text())["wheels"] == 1
    kernels = ["bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cuda128.so",
               "bitsandbytes/libbitsandbytes_rocm64.so", "bitsandbytes/libbitsandbytes_cpu.so"]  # fmt: skip
    assert [k for k in kernels if install_wheels.wanted(k, "13")] == [kernels[0], kernels[3]]
    assert all(install_wheels.wanted(k, None) for k in kernels)  # the CUDA major unknown: every kernel kept


def test_resume_from_runs_only_what_the_first_run_left(tmp_path):
    """A second run with --resume-from: the first run's finished stages are kept (marked ``from``), only the
    stopped one runs (here tests_rest, whose dry form is cheap: a collection), in plan order after the kept ones."""
    first = {"header": {}, "stages": {"setup": {"status": "ok"}}}
    for name in NAMES:
        first["stages"][name] = {"status": "ok", "seconds": 1.0}
    first["stages"]["tests_rest"] = {"status": "stopped", "seconds": 120.0}
    (tmp_path / "first.json").write_text(json.dumps(first))
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--resume-from",
                           str(tmp_path / "first.json"), "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO), check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_report.json").read_text())
    assert list(report["stages"]) == ["setup", *NAMES]
    assert [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("stage ")] == ["tests_rest:"]
    rest = report["stages"]["tests_rest"]
    assert rest["status"] == "ok" and rest["collected"] >= 3 and "from" not in rest
    assert all(report["stages"][n]["from"].endswith("first.json") for n in NAMES if n != "tests_rest")
    assert report["header"]["plan"] == ["tests_rest: rest s"] and report["header"]["resumed_from"]
