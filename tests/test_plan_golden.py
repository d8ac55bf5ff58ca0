"""The memory plan of every documented setup, and of variants that take each branch of the plan, equals the figures
recorded in tests/data/plan_golden.json (written by tests/make_plan_golden.py before the plan became a table of
terms): a change of the plan's structure changes no figure. A figure meant to change is regenerated on purpose.

The oracle is the plan as computed before: the recorded RunSetup is rebuilt as it was resolved from the accelerate
config, the shape is built again from the same config.json, and the plan and the findings computed from it must
equal the record exactly (bytes, host bytes, totals, verdicts, notes, findings' texts).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from hf_fsdp_qlora.doctor.checks import RULES, SEVERITIES, Finding
from hf_fsdp_qlora.doctor.memory import plan_memory
from hf_fsdp_qlora.doctor.setup import FsdpSettings, RunSetup
from hf_fsdp_qlora.model_shapes import model_shape

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "plan_golden.json").read_text())["cases"]
# Keys MemoryPlan.to_dict gained after the record was written (each one additive: readers of the old keys are unaffected).
ADDED_KEYS = {"terms"}


def _setup(recorded: dict) -> RunSetup:
    fields = dict(recorded)
    fsdp = FsdpSettings(**fields.pop("fsdp"))
    return RunSetup(**fields, fsdp=fsdp)


@functools.lru_cache(maxsize=None)
def _shape(model: str, targets: str):
    return model_shape(REPO / model, json.loads(targets))


def _plan_and_findings(case: dict):
    from hf_fsdp_qlora.doctor._rules import Context

    setup = _setup(case["setup"])
    shape = _shape(case["model"], json.dumps(setup.lora_target_modules))
    plan = plan_memory(shape, setup)
    ctx = Context(setup=setup, shape=shape, plan=plan, module_classes=shape.module_classes)
    findings = [Finding(**f) for rule in RULES for f in rule(ctx)]
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    return plan, [f.to_dict() for f in findings]


def test_the_record_covers_every_documented_setup_and_branch():
    names = {case["name"] for case in GOLDEN}
    assert len(GOLDEN) >= 90 and len(names) == len(GOLDEN)
    verdicts = {case["memory"]["verdict"] for case in GOLDEN}
    assert verdicts == {"fits", "tight", "does_not_fit", "unknown"}
    assert {case["loss_path"] for case in GOLDEN} == {"ours", "stock", "sft", "dpo"}
    assert {case["setup"]["fsdp"]["version"] for case in GOLDEN} == {1, 2, None}


@pytest.mark.parametrize("case", GOLDEN, ids=[case["name"] for case in GOLDEN])
def test_plan_equals_the_record(case):
    plan, findings = _plan_and_findings(case)
    doc = plan.to_dict()
    assert set(doc) - set(case["memory"]) <= ADDED_KEYS
    assert {key: doc[key] for key in case["memory"]} == case["memory"]
    assert plan.loss_path == case["loss_path"]
    assert findings == case["findings"]
