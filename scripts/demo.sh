#!/usr/bin/env bash
# The demo: a random-initialised tiny Qwen3-MoE, fine-tuned on the token data the repo ships,
# then evaluated before and after with `moeforge eval`. CPU only, well under a minute.
set -euo pipefail
BUILD=${1:-build}
BIN="$BUILD/moeforge"
cd "$(dirname "$0")/.."
rm -rf runs/demo
"$BIN" init --arch qwen3_moe --preset tiny --seed 0 --out runs/demo/base
"$BIN" info runs/demo/base
head -n 64 demo/data/tokens.jsonl > runs/demo/heldout.jsonl
echo "before: $("$BIN" eval --model runs/demo/base --data runs/demo/heldout.jsonl)"
"$BIN" finetune demo/tiny_tokens.yaml
echo "after:  $("$BIN" eval --model runs/demo/finetuned --data runs/demo/heldout.jsonl)"
echo "The fine-tuned HF model directory is runs/demo/finetuned (config.json, model.safetensors, metrics.jsonl)."
