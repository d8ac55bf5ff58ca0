"""Preemption-safe training: a signal (or a deadline) becomes one agreed checkpoint at the next optimizer step.

This module holds the settings, the signal flag, the agreement and the exit; it imports no transformers, so
``python -m hf_fsdp_qlora.run`` reads its environment switches cheaply. The callback is in
:mod:`hf_fsdp_qlora.train.preemption_callback`.

A scheduler (SLURM at a time limit or a preemption) sends SIGTERM or the signal named by ``--signal`` to some
processes, then kills the job. A rank that saved alone would deadlock the others in its next collective, so the
signal handler only raises a flag; :class:`~hf_fsdp_qlora.PreemptionCallback` agrees on it across ranks with one
small all-reduce (MAX of an int) per optimizer step, then every rank writes the same complete checkpoint through
the trainer's own (crash-safe) checkpoint code and the process exits with :data:`PREEMPTED_EXIT_CODE`. The same
command with ``auto_resume`` then continues from that checkpoint, bit for bit.

"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time

from ..distributed import collective_device, is_distributed, is_main_process

__all__ = [
    "DEADLINE",
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_MARKER",
    "SignalFlag",
    "agree",
    "exit_after_preemption",
    "launch_defaults",
    "parse_signals",
    "parse_stop_after",
    "process_start_time",
    "release_early_signals",
    "remember_early_signals",
    "resolve_resume",
    "write_marker",
    "set_launch_defaults",
]

logger = logging.getLogger(__name__)

# EX_TEMPFAIL (sysexits.h): "temporary failure, the user is invited to retry". Distinct from a crash (1), a bad
# command line (2) and a death by signal (128+N), so a job script can tell "checkpointed, run me again" apart.
PREEMPTED_EXIT_CODE = 75
# `accelerate launch` (torch elastic) turns any worker status into its own 1, so the main process also leaves this
# file in output_dir for a job script to find; the next train() of the run removes it.
PREEMPTED_MARKER = "preempted.json"
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
DEADLINE = 1  # agreed value for "stop_after passed"; signal numbers are larger and win the MAX

_IMPORTED_AT = time.time()  # the fallback start where /proc is missing: this module loads before any model does

# What `python -m hf_fsdp_qlora.run` read from the environment (the only place environment variables are read).
_LAUNCH_DEFAULTS = {"auto_resume": False, "stop_after": None}


def launch_defaults() -> dict:
    """What the launcher set: ``{"auto_resume": bool, "stop_after": str | None}``."""
    return dict(_LAUNCH_DEFAULTS)


def set_launch_defaults(auto_resume: bool = False, stop_after: str | None = None) -> None:
    """Defaults for trainers whose arguments lack our fields (unchanged scripts run by ``-m hf_fsdp_qlora.run``)."""
    parse_stop_after(stop_after)
    _LAUNCH_DEFAULTS.update(auto_resume=bool(auto_resume), stop_after=stop_after)


def parse_stop_after(value) -> float | None:
    """Seconds in a ``[D-]HH:MM:SS`` wall-clock budget (SLURM's time format), or None for no deadline.

    Raises:
        ValueError: not of that form, or zero.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)", str(value).strip())
    if match is None:
        raise ValueError(
            f"stop_after={value!r} is not a wall-clock budget: use HH:MM:SS (or D-HH:MM:SS), e.g. "
            "stop_after='11:50:00' for a 12-hour job with 10 minutes left for the checkpoint."
        )
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"stop_after={value!r} is a zero budget: give the time the run may train, e.g. '11:50:00'.")
    return float(total)


def process_start_time() -> float:
    """When this process started (seconds since the epoch), from ``/proc/self/stat`` on Linux; elsewhere, when this
    module was imported. ``stop_after`` counts from here, so model loading and the resume count against the budget
    as they do against the scheduler's time limit."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, starttime, in clock ticks after boot; split after the ")" closing the command name (which
            # may hold spaces): it leaves field 3 first.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def parse_signals(value) -> tuple[signal.Signals, ...]:
    """Signals from ``"SIGTERM,SIGUSR1"`` / ``"TERM,USR1"`` / a list of names or numbers; ``""`` or ``"none"``: none.

    Raises:
        ValueError: an unknown signal, or one no process can catch (SIGKILL, SIGSTOP).
    """
    if value is None:
        value = DEFAULT_SIGNALS
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    found = []
    for item in items:
        if item in ("", "none", "None"):
            continue
        try:
            if isinstance(item, int) or str(item).isdigit():
                sig = signal.Signals(int(item))
            else:
                name = str(item).upper()
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            raise ValueError(
                f"preemption_signals: unknown signal {item!r}; use names such as 'SIGTERM,SIGUSR1' (the default)."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"preemption_signals: {sig.name} cannot be caught by any process; use SIGTERM or SIGUSR1 "
                "(sbatch --signal=USR1@600 sends SIGUSR1 ten minutes before the time limit)."
            )
        if sig not in found:
            found.append(sig)
    return tuple(found)


class SignalFlag:
    """Raise a flag on the given signals; nothing else happens in the handler (a save there would run on one
    rank only, in the middle of whatever collective was interrupted)."""

    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = parse_signals(signals)
        self.received = 0  # the first signal's number; 0 while none came
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handler (main thread only, as Python requires); returns whether it was installed."""
        if self._previous:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("hf_fsdp_qlora: training runs outside the main thread: no preemption signal handler")
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def _handle(self, signum, frame):
        self.received = self.received or signum
        previous = self._previous.get(signum)
        if callable(previous):  # chain to the handler that was there before (SIG_DFL/SIG_IGN are not callable)
            previous(signum, frame)

    def restore(self, reraise: bool = False) -> None:
        """Put the previous handlers back (where ours is still the one installed).

        With `reraise`, a signal that came (and that nothing acted on) is raised again once the previous handler is
        back, when that handler is the default action: it was never run (callable handlers ran at arrival), and
        dropping it would ignore a scheduler's SIGTERM that came after the last agreement.
        """
        if not self._previous:
            return
        pending = self.received if reraise else 0
        previous_of_pending = self._previous.get(pending)
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if pending and previous_of_pending in (None, signal.SIG_DFL):
            logger.warning(
                "hf_fsdp_qlora: %s came after the last preemption check; raising it again with its default action",
                signal.Signals(pending).name,
            )
            signal.raise_signal(pending)


# Signals that came before train() installed its handler (the launcher installs this flag at process start).
_EARLY: SignalFlag | None = None
# What the launcher remembers: the scheduler's warning. The node script starts the trainers with it ignored (its
# `trap '' USR1` is inherited), so without a handler of ours from the first line a warning during model loading was
# dropped. SIGTERM keeps its default (an end at once) until train(): a script that never trains stays killable.
EARLY_SIGNALS = "SIGUSR1"


def remember_early_signals(signals=EARLY_SIGNALS) -> None:
    """Process start (``-m hf_fsdp_qlora.run``): remember `signals` until ``train()`` takes them over."""
    global _EARLY
    if _EARLY is None:
        flag = SignalFlag(signals)
        if flag.install():
            _EARLY = flag


def early_signals_remembered() -> bool:
    """Whether the launcher installed the early flag (the same on every rank of a launch)."""
    return _EARLY is not None


def early_signal(signals) -> int:
    """The first remembered signal among `signals` (a :func:`parse_signals` value), or 0."""
    received = _EARLY.received if _EARLY is not None else 0
    return received if received and received in parse_signals(signals) else 0


def release_early_signals() -> int:
    """Hand the early handlers back (train() installs its own) and return the signal that came, or 0."""
    global _EARLY
    if _EARLY is None:
        return 0
    flag, _EARLY = _EARLY, None
    received = flag.received
    flag.restore(reraise=False)
    return received


def write_marker(output_dir: str, checkpoint: str | None, step: int | None, reason: str) -> None:
    """The :data:`PREEMPTED_MARKER` a job script requeues on; ``new_checkpoint`` says whether this run wrote one
    (False: stopped before training, the latest complete checkpoint, if any, stays the resume point)."""
    os.makedirs(output_dir, exist_ok=True)
    entry = {"checkpoint": checkpoint, "step": step, "reason": reason, "new_checkpoint": checkpoint is not None}
    with open(os.path.join(output_dir, PREEMPTED_MARKER), "w") as f:
        json.dump(entry, f)


def agree(value: int) -> int:
    """Collective: the largest `value` over all ranks (one all-reduce of one int); `value` itself when alone."""
    if not is_distributed():
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def exit_after_preemption(code: int = PREEMPTED_EXIT_CODE) -> None:
    """Meet the other ranks, tear the process group down and exit with `code`, skipping the interpreter teardown
    (whose gloo abort would replace the status the job script reads)."""
    from .finish import finish_distributed

    finish_distributed(code, barrier=True)


def resolve_resume(args, resume_from_checkpoint):
    """What ``train()`` resumes from: the caller's choice, else (with auto_resume) the latest complete checkpoint
    in ``output_dir``, else nothing. Removes the previous run's :data:`PREEMPTED_MARKER` in any case."""
    # Whatever this run does, the marker of the previous one is stale now (a job script would requeue on it).
    marker = os.path.join(os.path.realpath(args.output_dir), PREEMPTED_MARKER)
    if is_main_process() and os.path.isfile(marker):
        os.remove(marker)
    if resume_from_checkpoint not in (None, False):
        return resume_from_checkpoint
    if not (getattr(args, "auto_resume", False) or _LAUNCH_DEFAULTS["auto_resume"]):
        return resume_from_checkpoint
    from .checkpoint import latest_complete_checkpoint

    found = latest_complete_checkpoint(args.output_dir)
    if is_main_process():
        logger.warning(
            "hf_fsdp_qlora: auto_resume: %s",
            f"resuming from {found}" if found else f"no complete checkpoint in {args.output_dir}: starting fresh",
        )
    return found
