"""The GPU check's plan: its stages in order of value, each with its share of one run, and the arithmetic.

The default run takes at most ``DEFAULT_RUN_S`` wall seconds (8 minutes), the wheel install included, so a GPU
rented or borrowed for a quarter of an hour has room for the set-up around it; ``--budget`` gives it more. Each stage gets a deadline: the end of its
share counted from when the stages began, so time a stage leaves unused goes to the later ones, and an earlier
stage keeps its whole share when the set-up ran long (the later ones are cut first). A stage past its deadline is
killed and recorded as "stopped"; every stage's result is on disk the moment it ends (report.py). What one run
leaves stopped or unrun, a second run does with ``--resume-from`` the first's report.

The estimates are the seconds each part is expected to take at the real shape (Llama 3.1 8B on one H100), from the
parts of a launch: a process start with its imports and CUDA initialisation (~12 s), loading and quantizing the 8B
model from the tmpfs copy (~25 s), a step at seq 1024-2048 (~1-2 s), an 8B merge written and compared (~45 s). The
first real run's per-stage seconds (the report's ``seconds``) replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RUN_S = 480  # the default run's wall seconds, wheel install included
MARGIN_S = 20  # the report written, the log flushed and every launch's process group gone before the run's end
# Set-up before the first stage, at the real shape: the wheel install (install_wheels.py, ~44 MiB unpacked) and the
# 8B model made on the GPU and written to /dev/shm once (every stage's launches load that one copy).
SETUP_ESTIMATE_S = {"install": 15, "build": 45}


@dataclass(frozen=True)
class Stage:
    """One stage: ``share_s`` seconds of the run (None: whatever is left), ``estimate_s`` at the real shape;
    ``waiting_for`` names what a slot waits on (it reports "not yet available" until then); ``resume_share_s``: the
    share in a resumed run (``--resume-from``) of a stage the first run has no room for (share 0 there)."""

    name: str
    share_s: float | None
    estimate_s: float
    what: str
    waiting_for: str | None = None
    resume_share_s: float | None = None

    def share(self, resumed: bool) -> float | None:
        """The seconds this stage gets in the first run, or in a resumed one."""
        return self.resume_share_s if resumed and self.resume_share_s is not None else self.share_s


PLAN = (
    # Started beside the model build (check.main), so most of its estimate is spent before its share begins.
    Stage("tests", 40, 35, "the fast CUDA tests (FAST_CUDA_TESTS): merge kernels, quantized weights, one config"),
    Stage("correctness", 110, 100, "8B shape under FSDP2 and FSDP1 (and offload, callback), merge against peft"),
    Stage("memory", 75, 70, "the doctor's memory plan against max_memory_allocated"),
    Stage("speed", 150, 140, "tokens/s against the stock single-GPU QLoRA recipe (stock and ours first)"),
    # The first run has no room for these three (set-up + the shares above + margin: 455 of 480 s): share 0 there
    # (they get only what the earlier stages left, and read "stopped" otherwise), their own share in the resumed
    # call, before capacity. fp32_vs_bf16: one launch, the 8B load twice (~12 + 2 x (25 + 10) s); moe_speed: one
    # launch, no 8B model (~12 s start, a few s to build the layer on the GPU, ~5 s of steps); longest_seq: the 8B
    # load and a few probes of ~15 s (24 GB cap), the whole GPU's probes (minutes each) as far as the share goes.
    Stage("fp32_vs_bf16", 0, 80, "fp32 adapters against bf16 adapters: step time, peak memory", resume_share_s=80),
    Stage("moe_speed", 0, 30, "one Qwen3-30B-A3B MoE layer: grouped vs loop vs stock grouped_mm", resume_share_s=40),
    Stage("longest_seq", 0, 100, "longest sequence (tiled MLP, chunked loss) against the doctor", resume_share_s=100),
    Stage("capacity", None, 300, "largest shape, longest sequence per cap (mostly the resumed run)"),
    Stage("tests_rest", None, 120, "the remaining CUDA tests (every test marked cuda)"),
)
NAMES = tuple(s.name for s in PLAN)


def plan_for(names: list[str]) -> list[Stage]:
    """The stages named, in the plan's order (the order of value), whatever order they were asked in."""
    return [s for s in PLAN if s.name in names]


def deadlines(stages: list[Stage], start: float, end: float, resumed: bool = False) -> dict[str, float]:
    """Each stage's deadline: `start` plus the shares up to and including it (a resumed run's shares when
    `resumed`), never past `end`; a stage without a share runs until `end` (it and the ones after it share what the
    earlier stages left)."""
    found, t = {}, start
    for s in stages:
        share = s.share(resumed)
        t = end if share is None else min(end, t + share)
        found[s.name] = t
    return found


def first_run_estimate(install_s: float | None = None, build_s: float | None = None) -> dict:
    """The first run's arithmetic at the real shape: set-up, the stages with a share, the margin, and the seconds
    left for the stages without one (capacity, the rest of the tests), against DEFAULT_RUN_S."""
    setup = (install_s if install_s is not None else SETUP_ESTIMATE_S["install"]) + (
        build_s if build_s is not None else SETUP_ESTIMATE_S["build"]
    )
    shares = sum(s.share_s for s in PLAN if s.share_s)
    return {"setup_s": setup, "shares_s": shares, "margin_s": MARGIN_S,
            "left_for_unshared_s": DEFAULT_RUN_S - MARGIN_S - setup - shares,
            "fits": setup + shares + MARGIN_S <= DEFAULT_RUN_S}  # fmt: skip


# Stages with a first-run share that the first run is expected to leave stopped: speed's second round.
RESUMED_WITH = ("speed",)


def resumed_run_estimate(install_s: float | None = None, build_s: float | None = None) -> dict:
    """The resumed run's arithmetic: set-up, what the first run leaves (RESUMED_WITH's shares) and the stages
    that run only there (``resume_share_s``), the margin, and what is left for capacity and the rest of the tests."""
    first = first_run_estimate(install_s, build_s)
    shares = sum(s.share_s for s in PLAN if s.name in RESUMED_WITH) + sum(s.resume_share_s or 0 for s in PLAN)
    left = DEFAULT_RUN_S - MARGIN_S - first["setup_s"] - shares
    return {"setup_s": first["setup_s"], "shares_s": shares, "margin_s": MARGIN_S, "left_for_unshared_s": left,
            "fits": left >= 0}  # fmt: skip
