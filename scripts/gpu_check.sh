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
  # More steps under cosine would bend the schedule: refused, then accepted with --force-resume.
  build-gpu/moeforge finetune demo/tiny_chat.yaml model=/tmp/g/base out=/tmp/g/bf16 device=cuda checkpoint.every=50 train.steps=120 --resume 2>&1 | tail -1
  build-gpu/moeforge finetune demo/tiny_chat.yaml model=/tmp/g/base out=/tmp/g/bf16 device=cuda checkpoint.every=50 train.steps=120 --resume --force-resume | tail -2
  echo "eval of the GPU-trained model on the CPU: $(build-gpu/moeforge eval --model /tmp/g/bf16 --data demo/data/chat_heldout.jsonl --json)"
fi
if [ "${SKIP_LIFECYCLE:-0}" != 1 ]; then
  # A run's life on the GPU: evaluation during training and TensorBoard (read back by the
  # tensorboard package), a SIGTERM mid-run (exit 143, a checkpoint), the resume equal to an
  # uninterrupted run, and generation with a KV cache on the GPU.
  L=/tmp/life && rm -rf $L && build-gpu/moeforge init --preset tiny --seed 0 --tokenizer demo/tokenizer --out $L/base > /dev/null
  common="model=$L/base device=cuda eval.data=$PWD/demo/data/chat_heldout.jsonl eval.every=20 optim.warmup_steps=0 train.log_every=1000"
  build-gpu/moeforge finetune demo/tiny_chat.yaml $common out=$L/ref train.steps=300 log.tensorboard=true log.every=1 > $OUT/life_ref.log 2>&1
  tail -2 $OUT/life_ref.log
  python3 scripts/check_tensorboard_events.py $L/ref/tensorboard --metrics $L/ref/metrics.jsonl > $OUT/tensorboard_check.json 2>&1
  echo "tensorboard check: rc $? $(head -c 200 $OUT/tensorboard_check.json)"
  build-gpu/moeforge finetune demo/tiny_chat.yaml $common out=$L/sig train.steps=300 > $OUT/life_sig.log 2>&1 &
  pid=$!
  for i in $(seq 600); do [ "$(wc -l < $L/sig/metrics.jsonl 2>/dev/null || echo 0)" -ge 30 ] && break; sleep 0.1; done
  kill -TERM $pid; wait $pid; echo "SIGTERM'd run exited $? after $(wc -l < $L/sig/metrics.jsonl) steps: $(grep -E 'stopped by|checkpoint saved' $OUT/life_sig.log | tr '\n' ' ')"
  build-gpu/moeforge finetune demo/tiny_chat.yaml $common out=$L/sig train.steps=300 --resume > $OUT/life_resume.log 2>&1; echo "resume exited $?"
  python3 - "$L" <<'PY'
import json, sys
L = sys.argv[1]
strip = lambda l: {k: v for k, v in json.loads(l).items() if k not in ("tokens_per_s", "peak_mem_gib")}
a = [strip(l) for l in open(L + "/ref/metrics.jsonl")]
b = [strip(l) for l in open(L + "/sig/metrics.jsonl")]
same_w = open(L + "/ref/model.safetensors", "rb").read() == open(L + "/sig/model.safetensors", "rb").read()
print(f"interrupted+resumed vs uninterrupted on the GPU: {len(a)} / {len(b)} steps, metrics identical: {a == b}, weights identical: {same_w}")
PY
  build-gpu/moeforge generate --model $L/ref --device cuda --prompt "Hello" --max-new-tokens 16 --json 2>&1 | tail -c 400; echo
  build-gpu/moeforge generate --model $L/ref --device cpu --prompt "Hello" --max-new-tokens 16 --json 2>&1 | tail -c 400; echo
fi
if [ "${SKIP_RECOMPUTE:-0}" != 1 ]; then
  for r in moe full; do build-gpu/moeforge bench --config bench/configs/qwen3-30b-a3b.json --layers 4 --steps 3 --warmup 1 --recompute $r 2>/dev/null | tee -a "$OUT/recompute.jsonl"; done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then bench/p1.sh build-gpu "$OUT"; fi
