#!/usr/bin/env bash
# The CPU demo (README's `make demo`): build a tiny Llama + tokenizer locally, fine-tune it with QLoRA
# under real FSDP2 on 2 CPU processes, show the loss falling, save the adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUTPUT:-demo_output}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

python examples/build_tiny_model.py --data examples/data/capitals.jsonl --output "$OUT/tiny-llama"
accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml \
    examples/train_qlora.py --model "$OUT/tiny-llama" --data examples/data/capitals.jsonl --output "$OUT/adapter"
echo "demo done: adapter in $OUT/adapter"
