"""Bisection for the largest value that still fits (longest sequence, largest shape), under a time cap."""

from __future__ import annotations

import time


def largest_fitting(probe, low: int, high: int, step: int, seconds: float, max_probes: int = 12) -> dict:
    """The largest multiple of `step` in [low, high] for which `probe(value)["ok"]` holds, by bisection.

    `probe` is assumed monotone (what fits at n fits below n). `low` is probed first: if it does not fit the answer
    is None. Stops after `seconds` or `max_probes`; the answer is then the largest value seen to fit, and
    ``complete`` says whether the interval closed (the next untried value is known not to fit or is past `high`).

    Returns:
        ``{"largest": int | None, "complete": bool, "probes": [{"value", "ok", ...probe's figures}]}``.
    """
    started = time.monotonic()
    probes: list[dict] = []

    def run(value: int) -> bool:
        found = dict(probe(value))
        probes.append({"value": value, **found})
        return bool(found.get("ok"))

    if not run(low):
        return {"largest": None, "complete": True, "probes": probes}
    good, bad = low, high + step
    if run(high):
        return {"largest": high, "complete": True, "probes": probes}
    bad = high
    while bad - good > step and len(probes) < max_probes and time.monotonic() - started < seconds:
        mid = (good + bad) // 2 // step * step
        mid = max(mid, good + step)
        if run(mid):
            good = mid
        else:
            bad = mid
    return {"largest": good, "complete": bad - good <= step, "probes": probes}
