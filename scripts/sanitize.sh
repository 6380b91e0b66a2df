#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of the CPU and distributed (TCP, multi-process)
# tests (CI).
#
#   scripts/sanitize.sh            SANITIZE_JOBS=N for parallel build and test jobs (default: nproc)
#
# Configures build-asan with -DMOEFORGE_SANITIZE=ON -DMOEFORGE_CUDA=OFF (warnings as errors), builds
# the CLI (the end-to-end tests run it) and the tests/cpu and tests/dist executables, and runs
# `ctest -L 'cpu|dist'` (the NCCL tests skip: this build has no CUDA).
# Any sanitizer report fails the test that triggered it: UBSan is built with -fno-sanitize-recover
# and ASan halts on the first error, so a report is a non-zero exit. Optimisation is -O1 with
# line tables only (-g1): half the compile time of -O2 -g, and stack traces still name file:line.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build-asan
jobs="${SANITIZE_JOBS:-$(nproc)}"
bash scripts/install-deps.sh

t0=$(date +%s)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
    -DMOEFORGE_SANITIZE=ON -DMOEFORGE_CUDA=OFF -DMOEFORGE_WERROR=ON >"$build.cmake.log" 2>&1 ||
    { cat "$build.cmake.log"; exit 1; }
targets=(moeforge)
for test_source in tests/cpu/*.cpp tests/dist/*.cpp; do targets+=("$(basename "$test_source" .cpp)"); done
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$build.build.log" 2>&1 ||
    { tail -60 "$build.build.log"; exit 1; }
t1=$(date +%s)
echo "sanitize: built in $((t1 - t0)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
rc=0
(cd "$build" && ctest -L 'cpu|dist' --output-on-failure -j "$jobs") || rc=$?
echo "sanitize: tests ran in $(($(date +%s) - t1)) s"
exit "$rc"
