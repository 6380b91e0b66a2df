#!/usr/bin/env bash
# The demo: a random-initialised tiny Qwen3-MoE with the tokenizer the repo ships, fine-tuned on
# the conversations in demo/data/chat.jsonl (assistant tokens only), evaluated before and after
# on 40 held-out conversations with `moeforge eval`. CPU, under a minute.
set -euo pipefail
BUILD=${1:-build}
BIN="$BUILD/moeforge"
cd "$(dirname "$0")/.."
rm -rf runs/demo
mkdir -p runs/demo
"$BIN" init --arch qwen3_moe --preset tiny --seed 0 --tokenizer demo/tokenizer --out runs/demo/base
"$BIN" info runs/demo/base
# Held-out conversations: the same generator with another seed (scripts/make_demo_chat.py --seed 7).
echo "before: $("$BIN" eval --model runs/demo/base --data demo/data/chat_heldout.jsonl)"
"$BIN" finetune demo/tiny_chat.yaml device=cpu
echo "after:  $("$BIN" eval --model runs/demo/finetuned --data demo/data/chat_heldout.jsonl)"
"$BIN" plot runs/demo/finetuned   # runs/demo/finetuned/loss.svg: loss, validation loss, lr, grad norm
echo "sample: $("$BIN" generate --model runs/demo/finetuned --chat --prompt "What is 2 + 3?" --max-new-tokens 24 2>/dev/null | head -c 200)"
echo "The fine-tuned HF model directory (config, safetensors, tokenizer, metrics.jsonl) is runs/demo/finetuned."
