#!/usr/bin/env bash
# One call on the 2-GPU machine (device kind nvidia-h200-x2): build with CUDA + NCCL, run the gpu
# tests and the dist tests (the NCCL ones run there: communicator, EP dispatch/combine, EP/DP
# training against one GPU), then benchmark P2 (bench/p2.sh). Logs go to $OUT (or ./gpu_out).
#   SKIP_GPU_TESTS=1  leave out the single-GPU kernel tests     SKIP_P2=1  leave out the benchmark
#   SKIP_DIST_TESTS=1  leave out the NCCL tests
#   SWEEP=1  then the EP overlap's knobs: the EP block benchmark (MF_BENCH=1 test_nccl_ep: own-row
#            split x SMs left to the exchange) and P2 steps under the SM-kernel copies
#            (MOEFORGE_PEER_COPY=sm) with MOEFORGE_EP_COMM_SMS 0/16/24, MOEFORGE_EP_OWN_SPLIT 0.3 and
#            --ep-chunks 2/3, then a --phases breakdown
set -uo pipefail
OUT=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
exec > >(tee "$OUT/gpu_dist_check.log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_CUDA=ON -DMOEFORGE_GTEST_SRC="$PWD/.carry/googletest" > "$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
grep -i "nccl" "$OUT/cmake.log"
time cmake --build build-gpu -j32 > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  (cd build-gpu && ctest -L gpu --output-on-failure -j1 > "$OUT/ctest_gpu.log" 2>&1; tail -15 "$OUT/ctest_gpu.log")
fi
if [ "${SKIP_DIST_TESTS:-0}" != 1 ]; then
  (cd build-gpu && ctest -R "test_nccl|test_gpu_parallel" -V -j1 > "$OUT/ctest_dist_gpu.log" 2>&1; grep -E "rel L2|SKIPPED|Passed|Failed|FAILED|Failure|tests passed|MF_BENCH|ms" "$OUT/ctest_dist_gpu.log" | head -60)
fi
if [ "${SKIP_P2:-0}" != 1 ]; then
  STEPS=${STEPS:-5} bash bench/p2.sh build-gpu "$OUT"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  MF_BENCH=1 timeout 300 build-gpu/tests/test_nccl_ep --gtest_filter=*Benchmark* > "$OUT/ep_bench.log" 2>&1
  grep "BENCH" "$OUT/ep_bench.log" | grep "rank 0\|no EP"
  CFG=bench/configs/qwen3-30b-a3b.json
  p2_step() {
    build-gpu/moeforge launch --nproc-per-node 2 -- bench --config "$CFG" --layers 8 --micro-batch 2 --seq-len 4096 \
        --steps 6 --warmup 2 --precision bf16 --ep-size 2 "$@" 2>> "$OUT/sweep_stderr.log" | grep '^{' | head -1 |
      python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('step_ms %.2f tps/gpu %.0f peak %.2f loss %.6f' % (d['step_ms'], d['tokens_per_s_per_gpu'], d['peak_gib'], d['last_loss']))"
  }
  echo "P2 defaults: $(p2_step)"
  for n in 0 16 24; do echo "P2 MOEFORGE_PEER_COPY=sm MOEFORGE_EP_COMM_SMS=$n: $(MOEFORGE_PEER_COPY=sm MOEFORGE_EP_COMM_SMS=$n p2_step)"; done
  echo "P2 MOEFORGE_EP_OWN_SPLIT=0.3: $(MOEFORGE_EP_OWN_SPLIT=0.3 p2_step)"
  for c in 2 3; do echo "P2 --ep-chunks $c: $(p2_step --ep-chunks $c)"; done
  build-gpu/moeforge launch --nproc-per-node 2 -- bench --config "$CFG" --layers 8 --micro-batch 2 --seq-len 4096 \
      --steps 4 --warmup 2 --precision bf16 --ep-size 2 --phases > "$OUT/p2_phases.txt" 2>&1
  grep -E "^ep |fwd moe|bwd moe|fwd head|grad|adamw" "$OUT/p2_phases.txt" | head -40
fi
