"""The GPU check's plan: its stages in order of value, each with its share of one device call, and the arithmetic.

A lend is 15 minutes of device time in all, the machine's start (minutes) included, so the check is one device call
of at most ``DEVICE_TIMEOUT_S`` wall seconds, the wheel install included. Each stage gets a deadline: the end of its
share counted from when the stages began, so time a stage leaves unused goes to the later ones, and an earlier
stage keeps its whole share when the set-up ran long (the later ones are cut first). A stage past its deadline is
killed and recorded as "stopped"; every stage's result is on disk the moment it ends (report.py). What one call
leaves stopped or unrun, a second call runs with ``--resume-from`` the first's report.

The estimates are the seconds each part is expected to take at the real shape (Llama 3.1 8B on one H100), from the
parts of a launch: a process start with its imports and CUDA initialisation (~12 s), loading and quantizing the 8B
model from the tmpfs copy (~25 s), a step at seq 1024-2048 (~1-2 s), an 8B merge written and compared (~45 s). The
first real run's per-stage seconds (the report's ``seconds``) replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_TIMEOUT_S = 480  # the device call's timeout_s
MARGIN_S = 20  # the report written, the log flushed and the process group gone before the device tool's kill
# Set-up before the first stage, at the real shape: the wheel install (install_wheels.py, ~44 MiB unpacked) and the
# 8B model made on the GPU and written to /dev/shm once (every stage's launches load that one copy).
SETUP_ESTIMATE_S = {"install": 15, "build": 45}


@dataclass(frozen=True)
class Stage:
    """One stage: ``share_s`` seconds of the call (None: whatever is left), ``estimate_s`` at the real shape;
    ``waiting_for`` names what a slot waits on (it reports "not yet available" until then)."""

    name: str
    share_s: float | None
    estimate_s: float
    what: str
    waiting_for: str | None = None


PLAN = (
    # Started beside the model build (check.main), so most of its estimate is spent before its share begins.
    Stage("tests", 40, 35, "the fast CUDA tests (FAST_CUDA_TESTS): merge kernels, quantized weights, one config"),
    Stage("correctness", 110, 100, "8B shape under FSDP2 and FSDP1 (and offload, callback), merge against peft"),
    Stage("memory", 75, 70, "the doctor's memory plan against max_memory_allocated"),
    Stage("speed", 150, 140, "tokens/s against the stock single-GPU QLoRA recipe (stock and ours first)"),
    Stage("fp32_vs_bf16", 0, 0, "fp32 adapters against bf16 adapters", waiting_for="issue 34 (adapter dtype)"),
    Stage("moe_speed", 0, 0, "MoE expert LoRA speed", waiting_for="its issue (MoE speed at real shape)"),
    Stage("longest_seq", 0, 0, "the longest sequence of our long-context options", waiting_for="its issue"),
    Stage("capacity", None, 300, "largest shape, longest sequence per cap (mostly the resumed call)"),
    Stage("tests_rest", None, 120, "the remaining CUDA tests (every test marked cuda)"),
)
NAMES = tuple(s.name for s in PLAN)


def plan_for(names: list[str]) -> list[Stage]:
    """The stages named, in the plan's order (the order of value), whatever order they were asked in."""
    return [s for s in PLAN if s.name in names]


def deadlines(stages: list[Stage], start: float, end: float) -> dict[str, float]:
    """Each stage's deadline: `start` plus the shares up to and including it, never past `end`; a stage without a
    share runs until `end` (it and the ones after it share what the earlier stages left)."""
    found, t = {}, start
    for s in stages:
        t = end if s.share_s is None else min(end, t + s.share_s)
        found[s.name] = t
    return found


def first_call_estimate(install_s: float | None = None, build_s: float | None = None) -> dict:
    """The first call's arithmetic at the real shape: set-up, the stages with a share, the margin, and the seconds
    left for the stages without one (capacity, the rest of the tests), against DEVICE_TIMEOUT_S."""
    setup = (install_s if install_s is not None else SETUP_ESTIMATE_S["install"]) + (
        build_s if build_s is not None else SETUP_ESTIMATE_S["build"]
    )
    shares = sum(s.share_s for s in PLAN if s.share_s)
    return {"setup_s": setup, "shares_s": shares, "margin_s": MARGIN_S,
            "left_for_unshared_s": DEVICE_TIMEOUT_S - MARGIN_S - setup - shares,
            "fits": setup + shares + MARGIN_S <= DEVICE_TIMEOUT_S}  # fmt: skip
