#!/usr/bin/env bash
# The CPU demo (README's `make demo`): a tiny Llama learns the language of the data by a short full pre-training
# (single process: "The capital of X is Y." about 60 other countries), then QLoRA under real FSDP2 on 2 CPU
# processes teaches it 20 capitals it does not know. It prints exact match on those facts before and after, writes
# the loss curve as a PNG beside the adapter, merges the adapter into the 16-bit base with merge-adapters and
# checks that the merged model answers as base+adapter does.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO_DIR=${DEMO_OUTPUT:-demo_output}
SEED=${DEMO_SEED:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
DATA=examples/data

python examples/build_tiny_model.py --data $DATA/world.jsonl $DATA/facts.jsonl --pretrain $DATA/world.jsonl \
    --pretrain-steps 250 --seed "$SEED" --output "$DEMO_DIR/tiny-llama" --force
accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml examples/train_qlora.py \
    --model "$DEMO_DIR/tiny-llama" --data $DATA/facts.jsonl --output "$DEMO_DIR/adapter" --seed "$SEED" \
    --epochs 12 --lr 5e-3 --logging-steps 4
merge-adapters --base "$DEMO_DIR/tiny-llama" --adapter "$DEMO_DIR/adapter" --output "$DEMO_DIR/merged" --force --no-progress
python examples/evaluate_facts.py --base "$DEMO_DIR/tiny-llama" --adapter "$DEMO_DIR/adapter" --merged "$DEMO_DIR/merged" \
    --data $DATA/facts.jsonl
echo "demo done: adapter in $DEMO_DIR/adapter, loss curve in $DEMO_DIR/adapter/loss_curve.png, merged model in $DEMO_DIR/merged"
