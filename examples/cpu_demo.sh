#!/usr/bin/env bash
# The CPU demo (README's `make demo`): build a tiny Llama + tokenizer locally, fine-tune it with QLoRA
# under real FSDP2 on 2 CPU processes, show the loss falling, save the adapter, then merge it into the
# 16-bit base with merge-adapters (streamed, shard by shard) and check the merged model against peft.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUTPUT:-demo_output}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

python examples/build_tiny_model.py --data examples/data/capitals.jsonl --output "$OUT/tiny-llama"
accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml \
    examples/train_qlora.py --model "$OUT/tiny-llama" --data examples/data/capitals.jsonl --output "$OUT/adapter"
merge-adapters --base "$OUT/tiny-llama" --adapter "$OUT/adapter" --output "$OUT/merged" --force --no-progress
python examples/check_merged.py --base "$OUT/tiny-llama" --adapter "$OUT/adapter" --merged "$OUT/merged"
echo "demo done: adapter in $OUT/adapter, merged model in $OUT/merged"
