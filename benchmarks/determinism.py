"""Cost of determinism: the same QLoRA fine-tune with and without transformers' `full_determinism=True`
(seed + torch.use_deterministic_algorithms + deterministic cuDNN/cuBLAS settings), side by side in one run.

    python benchmarks/determinism.py [--steps 40]

Prints seconds per run, the ratio, and whether two deterministic runs gave identical losses. Each run
is a fresh subprocess (deterministic settings are process-wide). On a GPU the cost comes mostly from
deterministic cuBLAS workspaces and scatter/index kernels; on CPU it is close to nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[4])
import hf_fsdp_qlora
from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
from tiny_models import build_tiny_model
path, steps, deterministic = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
build_tiny_model(path, "llama")
args = FSDPQLoRATrainingArguments(output_dir=path + "-out", max_steps=steps, per_device_train_batch_size=4,
    logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, full_determinism=deterministic,
    log_memory_throughput=False)
torch.manual_seed(0)
model = load_qlora_model(path, gradient_checkpointing=False)
ids = torch.randint(3, 256, (64, 64), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": r, "labels": r} for r in ids]
trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=data)
start = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - start
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print(json.dumps({"seconds": seconds, "losses": losses}))
"""


def run(tmp: Path, steps: int, deterministic: bool) -> dict:
    tests = Path(__file__).resolve().parents[1] / "tests"
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp / "model"), str(steps), "1" if deterministic else "0", str(tests)],
        capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                          "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run(tmp, 2, False)  # warm-up: builds the model, fills caches
        plain, det_a, det_b = run(tmp, args.steps, False), run(tmp, args.steps, True), run(tmp, args.steps, True)
    print(f"{'run':<28}{'seconds':>10}")
    print(f"{'default':<28}{plain['seconds']:>10.2f}")
    print(f"{'full_determinism=True':<28}{det_a['seconds']:>10.2f}")
    print(f"{'full_determinism=True (2)':<28}{det_b['seconds']:>10.2f}")
    print(f"cost: {det_a['seconds'] / plain['seconds']:.2f}x the default run's time")
    print(f"two deterministic runs identical: {det_a['losses'] == det_b['losses']}")
    return 0


if __name__ == "__main__":
    started = time.time()
    raise SystemExit(main())
