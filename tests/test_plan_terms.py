"""The memory plan's table of terms (hf_fsdp_qlora/doctor/terms.py): the plan is their sum, the report and the JSON
list them with their reasons, docs/doctor.md names the same terms, and the doctor's code stays in small functions.

The figures themselves are pinned by tests/test_plan_golden.py; the weight terms are measured against a loaded
model in tests/test_doctor.py (test_memory_plan_matches_a_loaded_model, test_moe_plan_matches_a_loaded_model).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from hf_fsdp_qlora.doctor import diagnose
from hf_fsdp_qlora.doctor.memory import PART_NAMES
from hf_fsdp_qlora.doctor.report import render, to_json
from hf_fsdp_qlora.doctor.terms import TERMS

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
GB = 2**30


@pytest.fixture(scope="module")
def offloaded():
    """A QLoRA plan with parameter and activation offloading: terms with GPU and host bytes."""
    return diagnose(DATA / "qwen3_30b_a3b_config.json", accelerate_config="fsdp2_qlora_offload", quantization="4bit",
                    activation_offloading=True, use_dora=True, gpu_memory=24 * GB)  # fmt: skip


def test_plan_is_the_sum_of_its_terms(offloaded):
    plan = offloaded.plan
    assert [t["name"] for t in plan.terms] == list(PART_NAMES) == [row.name for row in TERMS]
    assert {t["name"]: t["bytes"] for t in plan.terms} == plan.parts
    assert sum(t["bytes"] for t in plan.terms) == plan.total
    moved = [t for t, row in zip(plan.terms, TERMS) if row.offloadable]
    assert all(t["bytes"] == 0 and t["host_bytes"] > 0 for t in moved)
    # The host RAM of the offloaded terms, each rounded down: within a byte per term of the plan's float sum.
    assert 0 <= plan.host["offloaded"] - sum(t["host_bytes"] for t in moved) < len(moved)
    activations = next(t for t in plan.terms if t["name"] == "activations")
    assert activations["host_bytes"] == plan.host["activations_offloaded"] > 0
    assert all(t["reason"] and "\n" not in t["reason"] for t in plan.terms)


def test_json_lists_the_terms_with_their_reasons(offloaded):
    memory = json.loads(json.dumps(to_json(offloaded)))["memory"]
    assert [set(t) for t in memory["terms"]] == [{"name", "bytes", "host_bytes", "reason"}] * len(TERMS)
    assert {t["name"]: t["bytes"] for t in memory["terms"]} == {
        k: v for k, v in memory["per_gpu"].items() if k != "total"
    }


def test_report_prints_each_term_with_its_reason(offloaded):
    text = render(offloaded, width=100)
    shown = [t for t in offloaded.plan.terms if t["bytes"] or t["host_bytes"]]
    assert len(shown) >= 8
    for term in shown:
        line = next(line for line in text.splitlines() if line.strip().startswith(term["name"] + " "))
        assert term["reason"] in line
        assert ("host RAM" in line) == bool(term["host_bytes"])


def test_docs_list_the_terms_of_the_table():
    page = (REPO / "docs" / "doctor.md").read_text()
    listed = page.split("<!-- plan-terms -->", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^- `(\w+)`:", listed, flags=re.MULTILINE) == [row.name for row in TERMS]


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


DOCTOR = sorted((REPO / "hf_fsdp_qlora" / "doctor").glob("*.py")) + [REPO / "hf_fsdp_qlora" / "model_shapes.py"]


def test_doctor_functions_and_modules_stay_small():
    """Each function one job (at most 60 lines), each module at most 450 lines: the plan grows by terms."""
    long = {f"{p.name}::{name}": n for p in DOCTOR for name, n in _functions(p) if n > 60}
    assert not long, long
    big = {p.name: n for p in DOCTOR if (n := len(p.read_text().splitlines())) > 450}
    assert not big, big
    terms = {name: n for name, n in _functions(REPO / "hf_fsdp_qlora" / "doctor" / "terms.py")}
    assert max(terms.values()) <= 40, terms
