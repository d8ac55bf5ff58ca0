"""The GPU form of the resumed run's stages (benchmarks/gpu/stages_new.py), without a GPU: the scenarios the 8B
profile builds, how they are launched, and the summaries' figures and goals from given worker results. The dry run
(tests/test_gpu_check.py) runs the same code at tiny shape on CPU."""

from __future__ import annotations

import sys
import time

import pytest
from dist_utils import REPO

sys.path.insert(0, str(REPO))

from benchmarks.gpu import check, stages_new
from benchmarks.gpu.profiles import GIB, PROFILES

pytestmark = pytest.mark.distributed  # the check's group (tests/test_gpu_check.py)


@pytest.fixture
def ctx(tmp_path):
    from transformers import LlamaConfig

    model = tmp_path / "llama3.1-8b"
    LlamaConfig(**PROFILES["gpu"]["shape"]).save_pretrained(model)  # config.json only: the doctor plans from it
    return check.Context(root=REPO, work=tmp_path, model=model, profile=PROFILES["gpu"], dry=False, device="cuda",
                         gpu_memory=80 * 2**30)  # fmt: skip


def test_longest_searches_around_the_doctors_answer_in_one_launch(ctx, monkeypatch):
    """Each cap's interval holds the doctor's answer (0.8x-1.1x, whole steps), the options are the long-context ones,
    the whole GPU comes after the 24 GB cap and the two share one launch (the 24 GB answer is written first)."""
    runs = stages_new.longest_scenarios(ctx)
    assert [sc["name"] for sc in runs] == ["h.longest.24GB", "h.longest.gpu"]
    answers = []
    for sc in runs:
        (cap,) = sc["caps"].values()
        answer = stages_new.doctor_longest(ctx, cap)
        answers.append(answer)
        step = sc["step"]
        assert sc["low"] % step == sc["high"] % step == 0 and sc["low"] <= answer <= sc["high"] + step, (sc, answer)
        assert sc["options"] == {"tiled_mlp": True, "tiled_mlp_tokens": 1024, "chunked_loss": True}
        assert sc["recipe"] == "ours" and not sc["count_saved"]
    assert runs[1]["caps"] == {"gpu": ctx.gpu_memory} and 0 < answers[0] < answers[1]
    launches = []
    monkeypatch.setattr(check, "launch", lambda c, config, scs, tag, t: launches.append([s["name"] for s in scs])
                        or {s["name"]: {"status": "ok"} for s in scs})  # fmt: skip
    check.run_scenarios(
        ctx, runs + stages_new.fp32_scenarios(ctx) + stages_new.moe_scenarios(ctx), time.monotonic() + 60
    )
    assert launches == [["h.longest.24GB", "h.longest.gpu", "f.float32", "f.bfloat16"], ["g.moe_layer"]]


def _fp32_run(dtype: str, s_per_step: float, gib: float) -> dict:
    return {"status": "ok", "adapter_dtypes": [dtype], "s_per_step": s_per_step, "tokens_per_s": 2048 / s_per_step,
            "max_allocated": gib * GIB, "losses": [11.9, 11.8]}  # fmt: skip


def test_fp32_summary_side_by_side_and_its_goal(ctx):
    within = {"f.float32": _fp32_run("float32", 1.02, 10.2), "f.bfloat16": _fp32_run("bfloat16", 1.0, 10.0)}
    found = stages_new.fp32_summary(ctx, within)
    assert found["status"] == "ok" and found["goals"][0].endswith(": met"), found["goals"]
    assert found["step_time_fp32_vs_bf16"] == pytest.approx(1.02) and found["extra_memory_gib"] == pytest.approx(0.2)
    slow = {**within, "f.float32": _fp32_run("float32", 1.2, 10.2)}
    assert stages_new.fp32_summary(ctx, slow)["goals"][0].endswith("MISSED")
    wrong = {**within, "f.float32": _fp32_run("bfloat16", 1.0, 10.0)}  # the setting did not reach the weights
    assert stages_new.fp32_summary(ctx, wrong)["status"] == "failed"
    waiting = {n: {"status": "not yet available", "reason": "no adapter_dtype"} for n in within}
    found = stages_new.fp32_summary(ctx, waiting)
    assert found["status"] == "not yet available" and found["waiting_for"] == "no adapter_dtype"


def test_moe_summary_ratios_and_goals(ctx):
    def row(ms, calls):
        return {"ms": ms, "operator_calls": calls, "grouped_mm_calls": 0, "mm_calls": 0, "dequantize_calls": 0,
                "max_allocated": 2 * GIB}  # fmt: skip

    run = {"status": "ok", "device": "cuda", "routed_experts": 128,
           "contestants": {"grouped": row(4.0, 75), "loop": row(40.0, 5774), "stock": row(2.0, 47)}}  # fmt: skip
    found = stages_new.moe_summary(ctx, {"g.moe_layer": run})
    assert found["status"] == "ok" and found["grouped_vs_loop"] == 0.1 and found["grouped_vs_stock"] == 2.0
    assert [g.rsplit(": ", 1)[1] for g in found["goals"]] == ["met", "met"]
    assert all(r["max_allocated_gib"] == 2.0 for r in found["rows"])
    run["contestants"]["grouped"] = row(30.0, 75)
    assert stages_new.moe_summary(ctx, {"g.moe_layer": run})["goals"][0].endswith("MISSED")
    del run["contestants"]["stock"]
    assert stages_new.moe_summary(ctx, {"g.moe_layer": run})["status"] == "failed"
