#!/usr/bin/env bash
# Bounded libFuzzer run over every target in fuzz/ (see fuzz/fuzz_util.h for the verdict rule).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      default 30
#   FUZZ_TARGETS="json config" scripts/fuzz.sh 60    only those targets
#   FUZZ_JOBS=N   parallel build jobs (default: nproc)
#
# Installs clang and its libFuzzer runtime when missing (idempotent apt-get), configures
# build-fuzz with clang, -DMOEFORGE_FUZZ=ON and ASan + UBSan, builds the fuzz_* targets and runs
# each for SECONDS_PER_TARGET seconds from its committed seed corpus fuzz/corpus/<target>/ (read
# only; new inputs go to build-fuzz/fuzz-work/<target>/corpus, kept between local runs). Prints
# the executions per target and fails when any target reports a finding: a crash, an exception
# other than mf::Error, a broken invariant, a sanitizer report, a timeout (> 10 s for one input)
# or a memory blow-up (> 2 GiB). The input that triggered it is left in
# build-fuzz/fuzz-work/<target>/ with the command that reproduces it.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -lt 1 ]; then
    echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET]" >&2
    exit 2
fi
build=build-fuzz
jobs="${FUZZ_JOBS:-$(nproc)}"

# --- clang and libFuzzer ---------------------------------------------------------------------
have_libfuzzer() {
    command -v clang++ >/dev/null 2>&1 || return 1
    local dir
    dir="$(clang++ -print-runtime-dir 2>/dev/null)" || return 1
    [ -f "$dir/libclang_rt.fuzzer-x86_64.a" ] || [ -f "$dir/libclang_rt.fuzzer.a" ]
}
if ! have_libfuzzer; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo=sudo; fi
    export DEBIAN_FRONTEND=noninteractive
    echo "fuzz: installing clang and the libFuzzer runtime"
    $sudo apt-get update -qq
    # Debian 12 ships the runtimes in libclang-rt-14-dev; older releases in libclang-common-14-dev.
    runtime=libclang-common-14-dev
    if apt-cache show libclang-rt-14-dev >/dev/null 2>&1; then runtime=libclang-rt-14-dev; fi
    $sudo apt-get install -y -qq --no-install-recommends clang "$runtime" cmake make >/dev/null
    have_libfuzzer || { echo "fuzz: clang++ has no libFuzzer runtime after installing $runtime" >&2; exit 1; }
fi

# --- build -----------------------------------------------------------------------------------
t0=$(date +%s)
# -O1 with line tables only (-g1): about half the compile time of -O2 -g; reports still name file:line.
CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
    -DMOEFORGE_CUDA=OFF -DMOEFORGE_TESTS=OFF -DMOEFORGE_FUZZ=ON -DMOEFORGE_WERROR=ON >"$build.cmake.log" 2>&1 ||
    { cat "$build.cmake.log"; exit 1; }
cmake --build "$build" --target fuzz_all -j "$jobs" >"$build.build.log" 2>&1 || { tail -50 "$build.build.log"; exit 1; }
echo "fuzz: built in $(($(date +%s) - t0)) s"

# --- run -------------------------------------------------------------------------------------
targets="${FUZZ_TARGETS:-}"
if [ -z "$targets" ]; then
    for src in fuzz/fuzz_*.cpp; do
        name="$(basename "$src" .cpp)"
        targets="$targets ${name#fuzz_}"
    done
fi
# File-based targets write each input to $TMPDIR: use memory when there is some.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

failed=()
summary=()
for t in $targets; do
    bin="$build/fuzz/fuzz_$t"
    work="$build/fuzz-work/$t"
    [ -x "$bin" ] || { echo "fuzz: no target fuzz_$t" >&2; exit 1; }
    mkdir -p "$work/corpus" "$work/artifacts"
    args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1
          -artifact_prefix="$work/artifacts/")
    if [ -f "fuzz/dict/$t.dict" ]; then args+=(-dict="fuzz/dict/$t.dict"); fi
    log="$work/log.txt"
    rc=0
    "$bin" "${args[@]}" "$work/corpus" "fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
    execs="${execs:-?}"
    if [ "$rc" -ne 0 ]; then
        failed+=("$t")
        summary+=("$(printf '%-12s %12s executions  FINDING (exit %s)' "$t" "$execs" "$rc")")
        echo "=== fuzz_$t: FINDING (exit $rc); log $log; last lines:"
        tail -40 "$log"
        for a in "$work"/artifacts/*; do
            [ -f "$a" ] && echo "reproduce: $bin $a"
        done
    else
        summary+=("$(printf '%-12s %12s executions  ok' "$t" "$execs")")
    fi
done

echo "fuzz: ${seconds} s per target"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: findings in: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz: no findings"
