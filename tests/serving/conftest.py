"""The serving check's timings, printed at the end of the run (CI's log keeps them)."""

from __future__ import annotations

from timings import FINDINGS, TIMES


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("serving check timings (s)")
        for what, seconds in TIMES.items():
            terminalreporter.write_line(f"{what}: {seconds:.1f}")
    for finding in FINDINGS:
        terminalreporter.write_line(finding)
