#!/usr/bin/env bash
# One call on the GPU machine: build with CUDA, run the gpu-labelled tests, check that a model
# written by `moeforge finetune` loads in transformers with the same loss, and run benchmark P1.
# Logs go to $OUT (the device tool's output folder) or ./gpu_out.
set -uo pipefail
OUT=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
exec > >(tee "$OUT/gpu_check.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_CUDA=ON -DMOEFORGE_GTEST_SRC="$PWD/.carry/googletest" > "$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
time cmake --build build-gpu -j16 > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
(cd build-gpu && ctest -L gpu --output-on-failure -j1 > "$OUT/ctest_gpu.log" 2>&1; tail -25 "$OUT/ctest_gpu.log")
grep -E "^\[gpu step\]" "$OUT/ctest_gpu.log" || grep -rh "\[gpu step\]" build-gpu/Testing/Temporary/LastTest.log | head -30
if [ "${SKIP_HF_EVAL:-0}" != 1 ]; then
  rm -rf /tmp/e && build-gpu/moeforge init --preset tiny --seed 3 --out /tmp/e/base > /dev/null &&
  build-gpu/moeforge finetune demo/tiny_tokens.yaml model=/tmp/e/base out=/tmp/e/ft train.steps=20 device=cpu > /dev/null &&
  python3 -c "
import json
rows=[json.loads(l) for l in open('demo/data/tokens.jsonl')]
rows=[r for r in rows if len(r['input_ids'])>=40][:8]
with open('/tmp/e/eval.jsonl','w') as f:
    for r in rows:
        d={'input_ids':r['input_ids'][:40]}
        if 'labels' in r: d['labels']=r['labels'][:40]
        f.write(json.dumps(d)+'\n')
" && echo "moeforge eval: $(build-gpu/moeforge eval --model /tmp/e/ft --data /tmp/e/eval.jsonl --json)" &&
  echo "transformers: $(python3 scripts/hf_eval.py /tmp/e/ft /tmp/e/eval.jsonl 2>/dev/null)"
fi
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  # The trainer on the GPU: the chat demo under both policies, a checkpoint, a resume.
  rm -rf /tmp/g && build-gpu/moeforge init --preset tiny --seed 0 --tokenizer demo/tokenizer --out /tmp/g/base > /dev/null
  build-gpu/moeforge finetune demo/tiny_chat.yaml model=/tmp/g/base out=/tmp/g/bf16 device=cuda checkpoint.every=50 | tail -3
  build-gpu/moeforge finetune demo/tiny_chat.yaml model=/tmp/g/base out=/tmp/g/mixed device=cuda precision=mixed | tail -2
  build-gpu/moeforge finetune demo/tiny_chat.yaml model=/tmp/g/base out=/tmp/g/bf16 device=cuda checkpoint.every=50 train.steps=120 --resume | tail -2
  echo "eval of the GPU-trained model on the CPU: $(build-gpu/moeforge eval --model /tmp/g/bf16 --data demo/data/chat_heldout.jsonl --json)"
fi
if [ "${SKIP_RECOMPUTE:-0}" != 1 ]; then
  for r in moe full; do build-gpu/moeforge bench --config bench/configs/qwen3-30b-a3b.json --layers 4 --steps 3 --warmup 1 --recompute $r 2>/dev/null | tee -a "$OUT/recompute.jsonl"; done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then bench/p1.sh build-gpu "$OUT"; fi
