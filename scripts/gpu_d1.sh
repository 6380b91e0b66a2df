#!/usr/bin/env bash
# Issue 23 on the GPU machine, in phases (one device call each; the build stays on the warm machine):
#   PHASE=build  builds the binary, the Python package and the gpu tests named in TESTS (build-gpu);
#                runs those tests and the Python test files named in PYTESTS.
#   PHASE=d1     benchmark D1 (bench/d1.sh; PROFILE=1 adds the eager systems' kernel tables and GPU idle
#                tables), then bench/hf_op_overhead.py and the loss kernel's benchmark lines.
#   PHASE=all    build, the Python tests in PYTESTS_FIRST, D1, then the rest (the order that keeps D1
#                inside one call's limit when the machine is fresh).
# googletest comes from .carry/googletest (no package registry there). Logs go to $OUT.
set -uo pipefail
OUT=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_d1.log") 2>&1
TESTS=${TESTS-"test_cuda_loss_optim test_cuda_ops"}  # (set but empty: none)
PYTESTS=${PYTESTS-"test_hf test_ops test_gpu"}

build() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  cmake -S . -B build-gpu -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_CUDA=ON \
    -DMOEFORGE_GTEST_SRC="$PWD/.carry/googletest" \
    -DMOEFORGE_PYTHON_EXECUTABLE="$(command -v python3)" \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir 2>/dev/null)" \
    > "$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
  # shellcheck disable=SC2086
  time cmake --build build-gpu -j16 --target moeforge moeforge_python_package $TESTS -- -k > "$OUT/build.log" 2>&1 ||
    { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; }
}
run_tests() {
  for t in $TESTS; do
    timeout 300 "build-gpu/tests/$t" > "$OUT/$t.log" 2>&1
    echo "$t rc $? ($(grep -E "PASSED|FAILED" "$OUT/$t.log" | tail -3 | tr '\n' ' '))"
  done
  for name in $PYTESTS; do
    PYTHONPATH="$PWD/build-gpu/python" MOEFORGE_REPO="$PWD" timeout 300 bash scripts/run_pytest.sh python3 \
      "python/tests/$name.py" > "$OUT/py_$name.log" 2>&1
    echo "python $name rc $? ($(grep -E "passed|failed|error" "$OUT/py_$name.log" | tail -1))"
  done
}
d1() {
  PYTHONPATH="$PWD/build-gpu/python" BUILD=build-gpu PROFILE=${PROFILE:-0} bash bench/d1.sh "$OUT"
  # the host time per eager op call (the step's start waits for it)
  PYTHONPATH="$PWD/build-gpu/python" timeout 120 python3 bench/hf_op_overhead.py 2>> "$OUT/d1_stderr.log" |
    tee "$OUT/op_overhead.jsonl"
  # the loss kernel alone, each way (where test_cuda_loss_optim is built)
  if [ -x build-gpu/tests/test_cuda_loss_optim ]; then
    MF_BENCH=1 timeout 120 build-gpu/tests/test_cuda_loss_optim --gtest_filter='CudaLossOptimBench*' 2>&1 |
      grep -E "BENCH ce loss|FAILED" | tee "$OUT/bench_ce.log"
  fi
}

case "${PHASE:-build}" in
  build) build && run_tests ;;
  d1) d1 ;;
  all) build && TESTS="" PYTESTS=${PYTESTS_FIRST:-test_hf} run_tests && d1 && PYTESTS=${PYTESTS_REST-"test_ops test_gpu"} run_tests ;;
esac
# The device tool brings back at most 8 files: the logs but this one, D1's lines and its kernel tables
# go back in one archive.
(cd "$OUT" && find . -maxdepth 1 -type f ! -name gpu_d1.log ! -name d1.jsonl ! -name 'profile_*.txt' ! -name logs.tgz \
   -printf '%P\n' | tar czf logs.tgz -T - --remove-files)
