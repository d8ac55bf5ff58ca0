"""The options sweep (issue 49): every option of tests/options_grid.py under every setting this package adds gives
what stock transformers + peft give in one process, or is refused by name before the first step; docs/options.md
shows every cell and equals a fresh sweep.

One stock process and one 2-rank launch per FSDP version (tests/scripts/options_sweep.py), once per session; the
comparisons (and their tolerances) live in tests/make_options_table.py, so the page and the assertions agree.
"""

from __future__ import annotations

import pytest
from make_options_table import PAGE, render, run_sweep, statuses
from options_grid import OPTIONS, SETTINGS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    return statuses(run_sweep(tmp_path_factory.mktemp("options")))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cell_is_equal_or_refused_by_name(found, option, setting):
    status, detail = found[option, setting]
    assert status in ("equal", "refused", "n/a"), f"{option} under {setting}: {detail}"
    if status == "refused":  # named before the first step: the option (its field name) and what to use instead
        field = option.split("=")[0].split(" ")[0]
        assert field in detail or option in detail, detail


def test_page_equals_the_sweep(found):
    assert PAGE.read_text() == render(found), "docs/options.md is stale: run tests/make_options_table.py"


def test_sweep_is_not_vacuous(found):
    """The comparisons can fail: most cells ran and were compared (not all refused)."""
    equal = [k for k, (s, _) in found.items() if s == "equal"]
    assert len(equal) >= len(found) // 2, found
