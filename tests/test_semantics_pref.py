"""Preference losses do not depend on the FSDP version (issue 12 item 9).

trl's DPO, ORPO and CPO trainers (stock, with FSDPQLoRACallback, trl's default bf16=True, no gradient
checkpointing) on a tiny preference set: the first logged loss, margins and log-probabilities are equal,
bit for bit, under DDP (torchrun), FSDP1 and FSDP2 (accelerate launch with the CPU rehearsal configs).
Before the fix, FSDP2 handed the trainers bf16 logits (accelerate wraps the forward in autocast with fp32
outputs for DDP and FSDP1 only): CPO's step-1 margin was -0.0508 under FSDP2 against -0.0430 elsewhere.
"""

from __future__ import annotations

import math

import pytest

from dist_utils import accelerate_launch, check, read_results, torchrun
from tiny_models import build_tiny_model

pytestmark = pytest.mark.distributed

TRAINERS = ("dpo", "orpo", "cpo")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    build_tiny_model(models / "llama", "llama")
    found = {}
    for mode in ("ddp", "fsdp1", "fsdp2"):
        out = tmp_path_factory.mktemp(mode)
        args = ("--models", str(models), "--out", str(out))
        if mode == "ddp":
            proc = torchrun("semantics_pref.py", *args, timeout=400)
        else:
            version = mode[-1]
            proc = accelerate_launch(f"cpu_fsdp{version}_rehearsal.yaml", "semantics_pref.py", *args,
                                     "--fsdp-version", version, timeout=400)  # fmt: skip
        check(proc)
        found[mode] = read_results(out)
    return found


def test_preference_metrics_equal_across_ddp_fsdp1_fsdp2(runs):
    for mode, results in runs.items():
        assert set(results) == {0, 1}, mode
        for found in results.values():
            for kind in TRAINERS:
                assert "error" not in found[kind], (mode, kind, found[kind].get("error"))
                expected_type = "MULTI_CPU" if mode == "ddp" else "FSDP"
                assert found[kind]["distributed_type"].endswith(expected_type), (mode, found[kind])
                if mode != "ddp":  # FSDP engaged, as asked
                    key = "fsdp1_units" if mode == "fsdp1" else "fsdp2_modules"
                    assert found[kind]["engaged"][key] > 0, (mode, kind, found[kind]["engaged"])
    for kind in TRAINERS:
        reference = runs["ddp"][0][kind]
        assert "rewards/margins" in reference and "loss" in reference, reference
        for mode in ("fsdp1", "fsdp2"):
            got = runs[mode][0][kind]
            for key, value in reference.items():
                if key in ("engaged", "distributed_type"):
                    continue
                assert got[key] == value, (kind, mode, key, got[key], value)
    # DPO's first loss is ln 2: the policy equals its reference before the first step.
    assert runs["fsdp2"][0]["dpo"]["loss"] == pytest.approx(math.log(2), abs=1e-6)
