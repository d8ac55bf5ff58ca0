"""Worker for checkpoint/resume tests: adapter-only checkpoints under FSDP, exact resume, crash safety.

Modes (several, comma-separated, run in turn in one launch; `kill` only alone):
  resume  - run A: 6 steps, checkpoint every 3; run B: fresh model, resume from A's checkpoint-3, 3 more
            steps; run C: save_only_model=True (no optimizer state). Writes losses and final adapters.
  kill    - 6 steps, checkpoint every 2; rank 0 is SIGKILLed in the middle of the step-4 save.
  after   - resume_from_checkpoint=True in the folder the killed run left.
  full    - a full fine-tune (no quantization, no adapter) with a checkpoint at step 2.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as ts
from dist_utils import finish_worker

from hf_fsdp_qlora import load_qlora_model


def make_trainer(path, out, version, **kw):
    model = load_qlora_model(path, lora_config=ts.lora_config(), gradient_checkpointing=False)
    args = ts.training_args(out, version, "llama", **kw)
    trainer = ts.LossRecorder(model=model, args=args, train_dataset=ts.TokenDataset())
    trainer.losses = []
    return trainer


def finish(trainer, version):
    weights = ts.full_trainable(trainer.model, version)
    ts.reset_accelerate()
    return weights


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument("--mode", required=True, help="resume, kill, after, full; several comma-separated")
    args = parser.parse_args()
    modes = args.mode.split(",")
    unknown = set(modes) - {"resume", "kill", "after", "full"}
    if unknown or ("kill" in modes and len(modes) > 1):
        parser.error(f"--mode: {args.mode!r}: choose from resume, after, full (comma-separated) or kill alone")
    torch.use_deterministic_algorithms(True)
    found = {}
    for mode in modes:  # each mode writes its own folder (A-C, F, K) and result keys
        run_mode(mode, Path(args.out), args.fsdp_version, str(Path(args.models) / "llama"), found)
    finish_worker(Path(args.out), found)  # results on disk, barrier, teardown, exit


def run_mode(mode, out, version, path, found):
    common = {"save_strategy": "steps", "seed": 7}
    if mode == "resume":
        a = make_trainer(path, out / "A", version, steps=6, save_steps=3, **common)
        a.train()
        found["A_losses"] = a.losses
        found["engaged"] = a.fsdp_callback.engagement
        wa = finish(a, version)
        b = make_trainer(path, out / "B", version, steps=6, save_steps=3, **common)
        b.train(resume_from_checkpoint=str(out / "A" / "checkpoint-3"))
        found["B_losses"] = b.losses
        wb = finish(b, version)
        c = make_trainer(path, out / "C", version, steps=3, save_steps=3, save_only_model=True, **common)
        c.train()
        finish(c, version)
        if dist.get_rank() == 0:
            torch.save({"A": wa, "B": wb}, out / "weights.pt")
    elif mode == "kill":
        t = make_trainer(path, out / "K", version, steps=6, save_steps=2, **common)
        original = t._save_rng_state

        def save_rng_then_die(output_dir):
            # Killed in the middle of the step-4 save: adapter and optimizer state are already on disk.
            if t.state.global_step == 4 and dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(output_dir)

        t._save_rng_state = save_rng_then_die
        t.train()
    elif mode == "full":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        targs = ts.training_args(out / "F", version, "llama", steps=2, save_steps=2, **common)
        ts.LossRecorder(model=model, args=targs, train_dataset=ts.TokenDataset()).train()
        ts.reset_accelerate()
    else:
        t = make_trainer(path, out / "K", version, steps=6, save_steps=2, **common)
        t.train(resume_from_checkpoint=True)
        found["resumed_losses"] = t.losses
        found["global_step"] = t.state.global_step
        finish(t, version)


if __name__ == "__main__":
    main()


def run_expert_lora_resume(name, path, out, version):
    """A scenario of the shared train launches (tests/test_moe.py): LoRA on 4-bit experts, 4 steps with a
    checkpoint at step 2 (run A), and a fresh model resumed from it for steps 3-4 (run B)."""

    def trainer(folder, **kw):
        model = load_qlora_model(path, lora_config=ts.expert_lora_config(), gradient_checkpointing=False)
        args = ts.training_args(out / name / folder, version, "qwen3_moe", steps=4, save_steps=2, **kw)
        t = ts.LossRecorder(model=model, args=args, train_dataset=ts.TokenDataset())
        t.losses = []
        return t

    a = trainer("A", save_strategy="steps", seed=7)
    a.train()
    weights_a = finish(a, version)
    b = trainer("B", save_strategy="no", seed=7)
    b.train(resume_from_checkpoint=str(out / name / "A" / "checkpoint-2"))
    weights_b = finish(b, version)
    if dist.get_rank() == 0:
        torch.save({"A": weights_a, "B": weights_b}, out / name / "weights.pt")
    return {"A_losses": a.losses, "B_losses": b.losses}
