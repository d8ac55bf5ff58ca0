"""Worker for the preemption tests: one run of a chain that always uses the same command (same output_dir).

Routes:
  trainer - FSDPQLoRATrainer with FSDPQLoRATrainingArguments(auto_resume=True)
  plain   - a plain transformers.Trainer subclass with plain TrainingArguments, launched through
            `-m hf_fsdp_qlora.run` with HF_FSDP_QLORA_AUTO_RESUME=1 (the route of trl's unchanged scripts)

--fault (what this run suffers; the worker signals itself so the step is deterministic):
  none                 run to the end, write the final adapter (oracle gather) and rank JSON
  substep:K:R:SIG      rank R sends itself SIG between the two micro-steps of optimizer step K
  eval:R:SIG           rank R sends itself SIG after the first evaluation batch of this run; eval_dataset is a
                       dict of two datasets (the second must not be evaluated after the stop)
  starteval:R:SIG      the same with eval_on_start=True: in the evaluation before the first step
  save:R:SIG           rank R sends itself SIG inside this run's first checkpoint write
  external:R           rank R waits inside its first checkpoint write for a signal from the test process
  kill:R               rank R is SIGKILLed inside this run's first checkpoint write
  deadline:SECS        rank 0 sleeps SECS in the run's first step (stop_after is set shorter by the test)
  load:R:SIG           rank R sends itself SIG before loading the model (before train(); the test starts the
                       launch with SIGUSR1 ignored, as the SLURM recipe's node script does)
Each micro-step's training loss is appended to RECORD/losses_rank<R>.jsonl as it is computed, and at the end of
train() the number of evaluation batches this rank's Fault callback saw (ours runs first and ends the evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as ts
from dist_utils import finish_worker
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model

MAX_STEPS, SAVE_STEPS, EVAL_STEPS = 10, 2, 3


def rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def note(record: Path, **entry):
    with open(record / f"losses_rank{rank()}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def recording(base, record, run):
    class Recorded(base):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            if model.training:
                value = loss[0] if return_outputs else loss
                note(record, run=run, step=self.state.global_step + 1, loss=float(value.detach()))
            return loss

    return Recorded


class Fault(TrainerCallback):
    def __init__(self, spec, record, run):
        self.kind, *self.params = spec.split(":")
        self.record, self.run, self.trainer, self.done = record, run, None, False
        self.eval_batches = 0

    def fire(self, sig):
        if self.done:
            return
        self.done = True
        (self.record / "signal_time").write_text(repr(time.time()))
        os.kill(os.getpid(), sig)

    def on_step_begin(self, args, state, control, **kw):
        if not getattr(self, "started", False):
            self.started = True
            note(self.record, run=self.run, start_step=state.global_step)
            if self.kind == "deadline" and rank() == 0:
                time.sleep(float(self.params[0]))
                (self.record / "signal_time").write_text(repr(time.time()))  # the budget has run out by now

    def on_substep_end(self, args, state, control, **kw):
        if self.kind == "substep" and state.global_step + 1 == int(self.params[0]) and rank() == int(self.params[1]):
            self.fire(getattr(signal, self.params[2]))

    def on_prediction_step(self, args, state, control, **kw):
        self.eval_batches += 1
        if self.kind in ("eval", "starteval") and rank() == int(self.params[0]):
            self.fire(getattr(signal, self.params[1]))

    def on_train_end(self, args, state, control, **kw):
        note(self.record, run=self.run, eval_batches=self.eval_batches)

    def in_save(self):
        if self.kind not in ("save", "external", "kill") or rank() != int(self.params[0]) or self.done:
            return
        if self.kind == "save":
            self.fire(getattr(signal, self.params[1]))
        elif self.kind == "kill":
            self.fire(signal.SIGKILL)
        else:  # wait here, in the middle of the write, for the test process's signal
            self.done = True
            flag = self.trainer.preemption_callback.flag
            (self.record / "pid_wait").write_text(str(os.getpid()))
            deadline = time.time() + 120
            while not flag.received and time.time() < deadline:
                time.sleep(0.02)


def train_once(args, out: Path, run: str, fault_spec: str):
    record = Path(args.record)
    fault = Fault(fault_spec, record, run)
    if fault.kind == "load" and rank() == int(fault.params[0]):
        fault.fire(getattr(signal, fault.params[1]))
    set_seed(7)  # the same fresh adapter in every launch (a resumed run loads it from the checkpoint instead)
    model = load_qlora_model(
        str(Path(args.models) / "llama"), lora_config=ts.lora_config(), gradient_checkpointing=False
    )
    settings = dict(  # noqa: C408 - keyword form reads as TrainingArguments
        output_dir=str(out), per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=2, max_steps=MAX_STEPS, learning_rate=1e-2, logging_steps=1, report_to=[],
        save_strategy="steps", save_steps=SAVE_STEPS, eval_strategy="steps", eval_steps=EVAL_STEPS, seed=7,
        use_cpu=True, dataloader_drop_last=True,
    )  # fmt: skip
    data = ts.TokenDataset()
    settings["eval_on_start"] = fault.kind == "starteval"
    evaluated = {"a": data, "b": data} if fault.kind == "eval" else data
    if args.route == "trainer":
        targs = FSDPQLoRATrainingArguments(**settings, auto_resume=True)
        cls = recording(FSDPQLoRATrainer, record, run)
    else:  # a plain Trainer; -m hf_fsdp_qlora.run gives it our behaviour, the environment auto_resume
        targs = TrainingArguments(**settings)
        cls = recording(Trainer, record, run)
    trainer = cls(model=model, args=targs, train_dataset=data, eval_dataset=evaluated, callbacks=[fault])
    fault.trainer = trainer
    original = trainer._save_rng_state

    def save_rng_state(output_dir):  # adapter and optimizer state are on disk already
        fault.in_save()
        return original(output_dir)

    trainer._save_rng_state = save_rng_state
    trainer.train()  # a stopped run exits inside, with status 75
    weights = ts.full_trainable(trainer.model, args.fsdp_version)
    if rank() == 0:
        torch.save(weights, record / f"adapter_{run}.pt")
    found = {"global_step": trainer.state.global_step, "engaged": trainer.fsdp_callback.engagement}
    ts.reset_accelerate()
    return found


def main():
    parser = argparse.ArgumentParser()
    for name in ("--models", "--out", "--record", "--route", "--run"):
        parser.add_argument(name, required=True)
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--baseline-out", help="after this run, the uninterrupted run from scratch, in this folder")
    args = parser.parse_args()
    record = Path(args.record)
    record.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    found = {args.run: train_once(args, Path(args.out), args.run, args.fault)}
    if args.baseline_out:  # the oracle: a fresh output_dir, so nothing to resume, no fault
        found["base"] = train_once(args, Path(args.baseline_out), "base", "none")
    finish_worker(record, found)


if __name__ == "__main__":
    main()
