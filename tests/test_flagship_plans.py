"""The flagship section of docs/families.md (tests/make_flagship_table.py) equals a fresh doctor run, and the
shipped configs are the released models' shapes: the doctor's parameter count of each equals the total its
publisher states, within 3% (the configs are written by hand from published values: a wrong width, head count or
expert count moves the total far more than that)."""

from __future__ import annotations

import pytest
from make_flagship_table import FLAGSHIPS, PAGE, plan, render_section, split_page

# Total parameters as published (model cards, release notes); Gemma 4 E2B's shape is transformers' defaults.
PUBLISHED_TOTAL = {
    "qwen3.5-35b-a3b": 35e9,
    "llama-4-scout-17b-16e": 109e9,
    "gpt-oss-120b": 116.8e9,
    "deepseek-v3": 671e9,
    "minimax-m2": 230e9,
    "kimi-linear-48b-a3b": 48e9,
}


def test_section_equals_a_fresh_doctor_run():
    _, section = split_page(PAGE.read_text())
    assert section == render_section(), "docs/families.md's flagship plans are stale: run tests/make_flagship_table.py"


@pytest.mark.parametrize("stem", sorted(PUBLISHED_TOTAL))
def test_config_has_the_published_size(stem):
    assert stem in FLAGSHIPS
    total = plan(stem, 8).plan.to_dict()["parameters"]["total"]
    assert abs(total / PUBLISHED_TOTAL[stem] - 1) < 0.03, (stem, total)
