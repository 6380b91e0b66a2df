#!/usr/bin/env bash
# One call on the 2-GPU machine (device kind nvidia-h200-x2): build with CUDA + NCCL, run the gpu
# tests and the dist tests (the NCCL ones run there: communicator, EP dispatch/combine, EP/DP
# training against one GPU), then benchmark P2 (bench/p2.sh). Logs go to $OUT (or ./gpu_out).
#   SKIP_GPU_TESTS=1  leave out the single-GPU kernel tests     SKIP_P2=1  leave out the benchmark
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
(cd build-gpu && ctest -R "test_nccl|test_gpu_parallel" -V -j1 > "$OUT/ctest_dist_gpu.log" 2>&1; grep -E "rel L2|SKIPPED|Passed|Failed|FAILED|Failure|tests passed|MF_BENCH|ms" "$OUT/ctest_dist_gpu.log" | head -60)
if [ "${SKIP_P2:-0}" != 1 ]; then
  STEPS=${STEPS:-5} bash bench/p2.sh build-gpu "$OUT"
fi
