"""Cost of preemption safety: the per-step agreement all-reduce, and the time from a signal to the process exit.

    python benchmarks/preemption.py [--steps 30] [--config accelerate_configs/cpu_fsdp2_rehearsal.yaml]

One 2-rank launch (FSDP2 CPU rehearsal by default; pass a GPU config on a GPU machine) of a tiny QLoRA fine-tune
with our trainer. It prints the mean optimizer-step time, the mean time of the agreement all-reduce (timed apart,
200 calls, on the same process group) and its share of a step; then rank 1 sends itself SIGTERM at the start of the
last step and the launch's end is timed: one step + one checkpoint write + teardown. A tiny model's steps are short,
so the share printed here is an upper bound for real models, whose steps take seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    from tiny_models import build_tiny_model
    from transformers import TrainerCallback

    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
    from hf_fsdp_qlora.train.preemption import agree

    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.begin = [], None

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == args.steps - 1 and rank == 1:  # the last step: preempted
                (out / "signal_time").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGTERM)
            self.begin = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):  # before our agreement: the step alone
            self.times.append(time.perf_counter() - self.begin)
            if state.global_step == args.steps - 2:
                start = time.perf_counter()
                for _ in range(200):
                    agree(0)
                self.agree_s = (time.perf_counter() - start) / 200
                if rank == 0:
                    steps = sorted(self.times[2:])  # the first steps warm up
                    (out / "timing.json").write_text(
                        json.dumps({"step_s": steps[len(steps) // 2], "agree_s": self.agree_s})
                    )

    model_dir = build_tiny_model(out / "model", "llama")
    torch.manual_seed(0)
    model = load_qlora_model(str(model_dir), gradient_checkpointing=False)
    ids = torch.randint(3, 256, (256, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    targs = FSDPQLoRATrainingArguments(
        output_dir=str(out / "run"), max_steps=args.steps, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, log_memory_throughput=False, logging_steps=10,
    )  # fmt: skip
    FSDPQLoRATrainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()]).train()
    raise SystemExit("the run was not preempted")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default=str(REPO / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        accelerate = Path(sys.executable).parent / "accelerate"
        cmd = [str(accelerate), "launch", "--config_file", args.config, __file__, "--worker", "--out", tmp,
               "--steps", str(args.steps)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        ended = time.time()
        if "exitcode  : 75" not in proc.stdout + proc.stderr or not (out / "timing.json").exists():
            sys.exit(f"the benchmark run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        timing = json.loads((out / "timing.json").read_text())
        to_exit = ended - float((out / "signal_time").read_text())
        ckpt = out / "run" / f"checkpoint-{args.steps}"
        print(f"config: {Path(args.config).name}, {args.steps} steps, 2 ranks")
        print(f"optimizer step (median):      {timing['step_s'] * 1e3:8.2f} ms")
        print(f"agreement all-reduce (mean):  {timing['agree_s'] * 1e6:8.1f} us  ({timing['agree_s'] / timing['step_s']:.2%} of a step)")  # fmt: skip
        print(f"signal -> exit of the launch: {to_exit:8.2f} s  (checkpoint {ckpt.name} complete: "
              f"{(ckpt / 'trainer_state.json').is_file()})")  # fmt: skip


if __name__ == "__main__":
    main()
