"""Preemption-safe training: a signal (or a deadline) becomes one agreed checkpoint at the next optimizer step.

A scheduler (SLURM at a time limit or a preemption) sends SIGTERM or the signal named by ``--signal`` to some
processes, then kills the job. A rank that saved alone would deadlock the others in its next collective, so the
signal handler only raises a flag; :class:`PreemptionCallback` agrees on it across ranks with one small all-reduce
(MAX of an int) per optimizer step, then every rank writes the same complete checkpoint through the trainer's own
(crash-safe) checkpoint code and the process exits with :data:`PREEMPTED_EXIT_CODE`. The same command with
``auto_resume`` then continues from that checkpoint, bit for bit.

Where a flag is looked at:

* the end of every optimizer step (``on_step_end``): one all-reduce; a stop saves at this step;
* between gradient-accumulation micro-steps: nowhere. The checkpoint must sit at an optimizer-step boundary for
  the resume to be exact, so nothing can be done earlier, and an all-reduce per micro-step would multiply the cost
  by the accumulation count. The flag set mid-accumulation is read at the end of that step;
* each evaluation batch (``on_prediction_step``, only during ``train()``): one all-reduce per batch; a stop ends the
  evaluation early (that evaluation's metrics are dropped) and saves at the step it belongs to;
* after each checkpoint write (``on_save``): a signal that arrived during the write let it complete; this
  checkpoint is then the preemption checkpoint, and nothing is written twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time

from transformers import TrainerCallback

from ..distributed import collective_device, is_distributed, is_main_process

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_MARKER",
    "PreemptionCallback",
    "SignalFlag",
    "agree",
    "parse_signals",
    "parse_stop_after",
    "resolve_resume",
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
_DEADLINE = 1  # agreed value for "stop_after passed"; signal numbers are larger and win the MAX

# What `python -m hf_fsdp_qlora.run` read from the environment (the only place environment variables are read).
_LAUNCH_DEFAULTS = {"auto_resume": False, "stop_after": None}


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

    def restore(self) -> None:
        """Put the previous handlers back (where ours is still the one installed)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


def agree(value: int) -> int:
    """Collective: the largest `value` over all ranks (one all-reduce of one int); `value` itself when alone."""
    if not is_distributed():
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


class _EvaluationStopped(Exception):
    """Raised on every rank at the same evaluation batch; the trainer's ``evaluate`` returns no metrics."""


class PreemptionCallback(TrainerCallback):
    """Turn a signal on any rank, or a passed ``stop_after`` deadline, into one agreed checkpoint and an exit.

    Installed by every route (our trainers, a Trainer given :class:`~hf_fsdp_qlora.FSDPQLoRACallback`, and
    ``-m hf_fsdp_qlora.run``). Settings come from the arguments given here, else from
    :class:`~hf_fsdp_qlora.FSDPQLoRATrainingArguments` (``preemption_signals``, ``stop_after``), else from the
    launcher's environment.

    Args:
        signals: signals that request a checkpoint-and-exit (default SIGTERM and SIGUSR1).
        stop_after: a ``HH:MM:SS`` budget from the start of ``train()``.
        exit_code: the process's exit status after the checkpoint; None: ``train()`` returns instead and
            :attr:`stopped` says why.
    """

    def __init__(self, signals=None, stop_after: str | None = None, exit_code: int | None = PREEMPTED_EXIT_CODE):
        self._signals, self._stop_after, self.exit_code = signals, stop_after, exit_code
        if signals is not None:
            parse_signals(signals)
        parse_stop_after(stop_after)
        self.flag: SignalFlag | None = None
        self.stopped = 0  # the agreed reason: a signal number, or 1 for the deadline
        self.checkpoint: str | None = None
        self.exit_deferred = False  # set by our trainers, which exit after train() returns
        self._budget = self._start = None

    def on_train_begin(self, args, state, control, **kwargs):
        signals = self._signals if self._signals is not None else getattr(args, "preemption_signals", None)
        stop_after = self._stop_after or getattr(args, "stop_after", None) or _LAUNCH_DEFAULTS["stop_after"]
        self._budget, self._start = parse_stop_after(stop_after), time.monotonic()
        self.stopped, self.checkpoint = 0, None
        if self.flag is None:
            self.flag = SignalFlag(signals)
            self.flag.install()

    def _local(self) -> int:
        if self.flag is not None and self.flag.received:
            return self.flag.received
        if self._budget is not None and time.monotonic() - self._start >= self._budget:
            return _DEADLINE
        return 0

    def _stop(self, reason: int, control) -> None:
        self.stopped = reason
        control.should_training_stop = True
        control.should_evaluate = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.flag is None or self.stopped:
            return
        reason = agree(self._local())
        if reason:
            self._stop(reason, control)
            control.should_save = True

    def on_prediction_step(self, args, state, control, **kwargs):
        # Only inside train(), and not when something reads this evaluation's metrics (best model, plateau LR).
        if self.flag is None or self.stopped or args.metric_for_best_model is not None:
            return
        reason = agree(self._local())
        if reason:
            self._stop(reason, control)
            control.should_save = True
            raise _EvaluationStopped

    def on_save(self, args, state, control, **kwargs):
        if self.flag is None or self.checkpoint is not None:
            return
        reason = self.stopped or agree(self._local())  # a signal during a periodic write: that write is the one
        if not reason:
            return
        self._stop(reason, control)
        self.checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if is_main_process():
            why = "the stop_after deadline" if reason == _DEADLINE else signal.Signals(reason).name
            with open(os.path.join(args.output_dir, PREEMPTED_MARKER), "w") as f:
                json.dump({"checkpoint": self.checkpoint, "step": state.global_step, "reason": why}, f)
            logger.warning(
                "hf_fsdp_qlora: %s: saved %s (adapter, optimizer, scheduler, RNG, data position) at step %d of %d; "
                "%s. Run the same command with auto_resume to continue.",
                why,
                self.checkpoint,
                state.global_step,
                state.max_steps,
                f"exiting with status {self.exit_code}" if self.exit_code is not None else "train() returns",
            )

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopped:  # the loop breaks into the epoch-end hooks: no evaluation or save of a partial epoch
            control.should_save = control.should_evaluate = False

    def disarm(self) -> None:
        if self.flag is not None:
            self.flag.restore()
            self.flag = None

    def on_train_end(self, args, state, control, **kwargs):
        self.disarm()
        if self.stopped and self.exit_code is not None and not self.exit_deferred:
            exit_after_preemption(self.exit_code)


def exit_after_preemption(code: int = PREEMPTED_EXIT_CODE) -> None:
    """Meet the other ranks, tear the process group down and exit with `code`, skipping the interpreter teardown
    (whose gloo abort would replace the status the job script reads)."""
    from .launcher import _finish

    _finish(code)


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
