"""The doctor's figures on the docs pages (outside docs/recipes/) are what a fresh doctor run prints, its whole
output quoted and labelled; figures that were measured say on what, with which versions, and when (tests/doc_figures.py)."""

from __future__ import annotations

import itertools
import re

import pytest
from doc_figures import GIB, PAGES, paragraphs, planned_figures, prose, quotes, run_doctor

QUOTES = [q for page in PAGES for q in quotes(page)]
PLANNED = re.compile(r"planned by the doctor", re.IGNORECASE)
# "Measured on <machine>, ... torch <version> ..., <YYYY-MM-DD>" within one paragraph.
# A parameter count the doctor prints ("30.53B total"), in a row that also holds a GiB figure.
PARAMETERS = re.compile(r"(?<![\w.-])\d+\.\d+B\b")
MEASURED_LABEL = re.compile(r"measured\s+on\s[\s\S]{0,300}?torch\s+\d[\s\S]{0,400}?\b20\d\d-\d\d-\d\d", re.IGNORECASE)


def test_the_pages_quote_the_doctor():
    assert len(QUOTES) >= 4, [q[0] for q in QUOTES]


@pytest.mark.parametrize("where, args, quoted, before", QUOTES, ids=[q[0] for q in QUOTES])
def test_quoted_output_is_a_fresh_run_whole_and_labelled(where, args, quoted, before):
    status, printed = run_doctor(args)
    for part in paragraphs(quoted):  # the first paragraph that differs, to say what changed
        assert part in paragraphs(printed), f"{where}: the doctor no longer prints:\n{part}\n\nbut:\n{printed}"
    assert paragraphs(quoted) == paragraphs(printed), f"{where}: quote the whole output:\n{printed}"
    errors = re.search(r"^(\d+) error\(s\)", quoted, flags=re.MULTILINE)
    if errors:  # the exit status the page implies: 0 ready, 1 errors
        assert status == (1 if int(errors.group(1)) else 0), (where, status, printed)
    if re.search(r"^ERROR ", quoted, flags=re.MULTILINE):
        assert status == 1, (where, printed)
    label = [line for line in before.rstrip().splitlines() if line.strip() and not line.startswith("<!--")][-1]
    assert PLANNED.search(label), f"{where}: the line before the output must say 'Planned by the doctor': {label!r}"


def _figure_paragraphs(text: str):
    """The prose paragraphs (table rows one by one) that hold a GiB figure, and whether each says 'measured'."""
    for part in paragraphs(prose(text)):
        rows = part.splitlines() if part.startswith("|") else [part]
        for row in rows:
            if GIB.search(row):
                yield row


# Pages whose GiB figures are neither plans nor measurements here: the GPU check's goals and thresholds.
NOT_PLANS = {"gpu-check.md"}


@pytest.mark.parametrize(
    "page", [p for p in PAGES if GIB.search(prose(p.read_text())) and p.name not in NOT_PLANS], ids=lambda p: p.name
)
def test_every_gib_figure_is_planned_by_a_command_on_the_page_or_labelled_measured(page):
    """A planned figure (GiB, or a parameter count beside one) is printed by a doctor command the page shows; a
    measured one's paragraph (or its table's caption) names the machine, the versions and the date."""
    text = prose(page.read_text(encoding="utf-8"))
    printed = planned_figures(page)
    measured_tables = _measured_table_rows(text)
    wrong = {}
    for row in _figure_paragraphs(text):
        if row in measured_tables or MEASURED_LABEL.search(row):
            continue
        figures = GIB.findall(row) + PARAMETERS.findall(row)
        missing = [f for f in (" ".join(f.split()) for f in figures) if f not in printed]
        if missing:
            wrong[row] = missing
    assert not wrong, f"{page.name}: figures no doctor command on the page prints, nor labelled measured: {wrong}"


def _measured_table_rows(text: str) -> set[str]:
    """Rows of the tables whose caption (the paragraph before) carries a measured label."""
    rows: set[str] = set()
    parts = paragraphs(text)
    labelled = False  # tables one after the other share the first one's caption
    for caption, table in itertools.pairwise(parts):
        labelled = table.startswith("|") and (MEASURED_LABEL.search(caption) or caption.startswith("|") and labelled)
        if labelled:
            rows |= set(table.splitlines())
    return rows


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_benchmark_tables_say_what_they_were_measured_on(page):
    """A table that a benchmark script produced (its caption runs `benchmarks/...`) is labelled measured."""
    parts = paragraphs(prose(page.read_text(encoding="utf-8")))
    for caption, table in itertools.pairwise(parts):
        if (
            table.startswith("|")
            and not caption.startswith("|")
            and "benchmarks/" in caption
            and "estimated" not in caption
        ):
            assert MEASURED_LABEL.search(caption), (
                f"{page.name}: label the table 'Measured on <machine>, torch X, ..., <date>':\n{caption}"
            )
