"""`PreemptionCallback`: a signal on any rank, or a passed deadline, becomes one agreed checkpoint and an exit.

Where the flag raised by :class:`~hf_fsdp_qlora.train.preemption.SignalFlag` is looked at:

* the end of every optimizer step (``on_step_end``): one all-reduce; a stop saves at this step. A stop agreed
  before any checkpoint of this run could be written (in the ``eval_on_start`` evaluation) is carried to the end of
  the next step and saved there: the process exits with status 75 only after writing a checkpoint;
* between gradient-accumulation micro-steps: nowhere. The checkpoint must sit at an optimizer-step boundary for
  the resume to be exact, so nothing can be done earlier, and an all-reduce per micro-step would multiply the cost
  by the accumulation count. The flag set mid-accumulation is read at the end of that step;
* each evaluation batch (``on_prediction_step``, only during ``train()``): one all-reduce per batch; a stop ends the
  evaluation early (that evaluation's metrics are dropped, the remaining datasets of a dict ``eval_dataset`` are
  skipped) and saves at the step it belongs to. Ending it early needs our trainer's ``evaluate``: every Trainer built
  with this callback has it (``hf_fsdp_qlora.PreemptionCallback`` resolves through ``trainer_hook``, which adopts
  such trainers); on a trainer given the callback afterwards (``add_callback``), the evaluation runs to its end;
* after each checkpoint write (``on_save``): a signal that arrived during the write let it complete; this
  checkpoint is then the preemption checkpoint, and nothing is written twice.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from transformers import TrainerCallback

from ..distributed import is_main_process
from .preemption import (
    DEADLINE,
    PREEMPTED_EXIT_CODE,
    SignalFlag,
    agree,
    early_signal,
    early_signals_remembered,
    exit_after_preemption,
    launch_defaults,
    parse_signals,
    parse_stop_after,
    process_start_time,
    release_early_signals,
    resolve_resume,
    write_marker,
)

__all__ = ["PreemptionCallback"]

logger = logging.getLogger(__name__)


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
        stop_after: a ``HH:MM:SS`` budget counted from the start of the process (so loading and resuming count, as
            they do against the scheduler's time limit).
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
        self._budget = self._start = self._first_step = None

    def _configured_signals(self, args):
        return self._signals if self._signals is not None else getattr(args, "preemption_signals", None)

    def stop_if_signalled_before_training(self, args) -> None:
        """Collective (when the launcher remembered signals): a signal that came on any rank before training (during
        model loading) stops every rank here, before the first step, with the exit status and a marker whose
        ``new_checkpoint`` is False; the requeued job resumes from the latest complete checkpoint, if any."""
        if self.exit_code is None or not early_signals_remembered():
            return  # (a train() that returns carries the signal into the first step, on_train_begin)
        reason = agree(early_signal(self._configured_signals(args)))
        if not reason:
            return
        self.stopped = reason
        release_early_signals()
        if is_main_process():
            name = signal.Signals(reason).name
            write_marker(args.output_dir, None, None, name)
            logger.warning(
                "hf_fsdp_qlora: %s before training started: no new checkpoint written (the next run resumes from the "
                "latest complete one in %s, or starts afresh); exiting with status %d.",
                name,
                args.output_dir,
                self.exit_code,
            )
        exit_after_preemption(self.exit_code)

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.exit_deferred:  # our trainers checked before the stock train() began
            self.stop_if_signalled_before_training(args)
        signals = self._configured_signals(args)
        stop_after = self._stop_after or getattr(args, "stop_after", None) or launch_defaults()["stop_after"]
        self._budget, self._start = parse_stop_after(stop_after), process_start_time()
        self.stopped, self.checkpoint, self._first_step = 0, None, state.global_step
        if not self.exit_deferred:  # set by our trainers' train(): the callback was added to a plain one afterwards
            logger.warning(
                "hf_fsdp_qlora: PreemptionCallback on a trainer without hf_fsdp_qlora's trainer behaviour (added "
                "after the trainer was built?): a stop during evaluation lets it finish first, and a train() that "
                "raises leaves the signal handler installed. Pass it in callbacks= when building the trainer."
            )
        if self.flag is None:
            early = release_early_signals()
            self.flag = SignalFlag(signals)
            self.flag.install()
            if early in self.flag.signals:  # came after the agreement above: acted on at the first step's end
                self.flag.received = self.flag.received or early

    def _local(self) -> int:
        if self.flag is not None and self.flag.received:
            return self.flag.received
        if self._budget is not None and time.time() - self._start >= self._budget:
            return DEADLINE
        return 0

    def _stop(self, reason: int, control) -> None:
        self.stopped = reason
        control.should_training_stop = True
        control.should_evaluate = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.flag is None:
            return
        if self.stopped:
            if self.checkpoint is None:  # agreed in the eval_on_start evaluation: nothing to exit on yet
                self._stop(self.stopped, control)
                control.should_save = True
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
            self.stopped = reason
            # The eval_on_start evaluation has no step to save: on_step_end stops at the end of the next one. Not
            # before: the loop reads should_training_stop after each micro-step and would leave that step unfinished.
            if state.global_step != self._first_step:
                self._stop(reason, control)
                control.should_save = True
            if self.exit_deferred:  # only our trainer's evaluate() catches it
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
            why = "the stop_after deadline" if reason == DEADLINE else signal.Signals(reason).name
            write_marker(args.output_dir, self.checkpoint, state.global_step, why)
            logger.warning(
                "hf_fsdp_qlora: %s: saved %s (weights, optimizer, scheduler, RNG, data position) at step %d of %d; "
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
        """Restore the previous handlers; a signal no stop acted on is raised again (see SignalFlag.restore)."""
        if self.flag is not None:
            flag, self.flag = self.flag, None
            flag.restore(reraise=not self.stopped)

    def on_train_end(self, args, state, control, **kwargs):
        self.disarm()
        if self.stopped and self.exit_code is not None and not self.exit_deferred:
            exit_after_preemption(self.exit_code)


# -- the trainer's side: FSDPSaveMixin's train, _finalize_training and evaluate delegate here


def preemption_callback_of(trainer) -> PreemptionCallback | None:
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PreemptionCallback)), None)


def train_then_exit_if_preempted(trainer, stock, resume_from_checkpoint, trial, **kwargs):
    """`Trainer.train` with auto_resume (the latest complete checkpoint in output_dir); a preempted run exits after
    train() has returned, so every callback's on_train_end (trackers) has run."""
    resume_from_checkpoint = resolve_resume(trainer.args, resume_from_checkpoint)
    preemption = preemption_callback_of(trainer)
    if preemption is not None:
        preemption.exit_deferred = True
        preemption.stop_if_signalled_before_training(trainer.args)
    try:
        output = stock(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
    finally:
        if preemption is not None:
            preemption.disarm()  # also when training raised: the user's handlers come back
    if preemption is not None and preemption.stopped and preemption.exit_code is not None:
        exit_after_preemption(preemption.exit_code)
    return output


def finalize_training(trainer, stock, trial, num_train_samples, start_time):
    """`Trainer._finalize_training`. After a preemption stop, upstream would load the best model inside the
    kill-grace window and, with save_total_limit=1, delete every checkpoint but the best - the preemption checkpoint
    too. Neither runs."""
    preemption = preemption_callback_of(trainer)
    if preemption is None or not preemption.stopped:
        return stock(trial, num_train_samples, start_time)
    args = trainer.args
    load_best, limit = args.load_best_model_at_end, args.save_total_limit
    args.load_best_model_at_end, args.save_total_limit = False, None
    try:
        return stock(trial, num_train_samples, start_time)
    finally:
        args.load_best_model_at_end, args.save_total_limit = load_best, limit


def evaluate_unless_stopped(trainer, stock, *args, **kwargs):
    """`Trainer.evaluate`: no metrics from an evaluation a preemption stop ended."""
    preemption = preemption_callback_of(trainer)
    if preemption is not None and preemption.stopped and preemption.flag is not None:
        return {}  # the next dataset of a dict eval_dataset, after a stop: the checkpoint comes first
    try:
        return stock(*args, **kwargs)
    except _EvaluationStopped:  # every rank stopped at the same batch to checkpoint (preemption)
        return {}
