#!/usr/bin/env bash
# Issue 25 on the GPU machine: what bounds the sm90 grouped GEMMs at J1's sizes. Builds
# test_cuda_grouped_gemm (build-gpu, googletest from .carry/googletest), then runs its Benchmark with
# the wgmma kernels only (MF_BENCH_SM90_ONLY=1) for each M:E in CONFIGS (default 65536:128 and
# 16384:128: 8192 and 2048 tokens x top-8 over 128 experts) under ncu, collecting per launch: duration,
# L2 and DRAM throughput (% of peak and bytes/s), SM throughput and the tensor pipe's activity. Prints
# the median of each kernel's launches per (size, case, kernel) and the benchmark's own timing lines.
# Logs go to $OUT (ncu_<M>_<E>.csv, bench_<M>_<E>.log, ncu_grouped.txt).
# STALLS=1 instead: where the warps wait (ncu's warp-state, scheduler and memory sections, one launch
# each) for the gate_up forward and bf16 weight gradient at STALLS_CONFIG (default 16384:128, 2048
# tokens), in $OUT/stalls_<kernel>.txt.
set -uo pipefail
OUT=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$OUT"
exec > >(tee -a "$OUT/ncu_grouped.txt") 2>&1
CONFIGS=${CONFIGS:-"65536:128 16384:128"}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}

if [ ! -x build-gpu/tests/test_cuda_grouped_gemm ]; then
  cmake -S . -B build-gpu -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_CUDA=ON \
    -DMOEFORGE_GTEST_SRC="$PWD/.carry/googletest" > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build build-gpu -j16 --target test_cuda_grouped_gemm > "$OUT/build.log" 2>&1 ||
    { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; }
fi

if [ "${STALLS:-0}" = 1 ]; then
  # The benchmark launches each product 23 times (3 warm-ups + 20), gate_up's before down's: the rows
  # kernel's forward, then its input gradient; the weight gradient's fp32, then bf16. So launch 3 of
  # each name is the first timed gate_up forward, launch 26 the first timed gate_up bf16 weight gradient.
  for spec in grouped_rows_wgmma_kernel:3 grouped_weight_grad_wgmma_kernel:26; do
    kernel=${spec%%:*} skip=${spec##*:}
    MF_BENCH=1 MF_BENCH_SM90_ONLY=1 MF_BENCH_GROUPED=${STALLS_CONFIG:-16384:128} timeout 300 "$NCU" \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SpeedOfLight \
      -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
      build-gpu/tests/test_cuda_grouped_gemm --gtest_filter='*Benchmark' > "$OUT/stalls_$kernel.txt" 2>&1
    echo "ncu stalls $kernel rc $?"
    sed -n '/Section: Warp State Statistics/,/Section: /p' "$OUT/stalls_$kernel.txt" | head -40
  done
  exit 0
fi

# The metrics this ncu knows (names differ between versions: the missing ones are left out, and said).
want=(gpu__time_duration.sum lts__throughput.avg.pct_of_peak_sustained_elapsed lts__t_bytes.sum.per_second
      dram__throughput.avg.pct_of_peak_sustained_elapsed dram__bytes_read.sum.per_second
      sm__throughput.avg.pct_of_peak_sustained_elapsed
      sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
      sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
      sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_elapsed)
"$NCU" --query-metrics > "$OUT/ncu_query.txt" 2>&1
metrics=()
for m in "${want[@]}"; do
  base=${m%%.*}
  if grep -q "^$base " "$OUT/ncu_query.txt"; then metrics+=("$m"); else echo "ncu has no metric $base (left out)"; fi
done
list=$(IFS=,; echo "${metrics[*]}")

for cfg in $CONFIGS; do
  tag=${cfg/:/_}
  MF_BENCH=1 MF_BENCH_SM90_ONLY=1 MF_BENCH_GROUPED=$cfg timeout 400 "$NCU" --csv --page raw --metrics "$list" \
    -k regex:wgmma_kernel build-gpu/tests/test_cuda_grouped_gemm --gtest_filter='*Benchmark' \
    > "$OUT/ncu_$tag.csv" 2> "$OUT/ncu_$tag.err"
  echo "ncu $cfg rc $?"
  MF_BENCH=1 MF_BENCH_SM90_ONLY=1 MF_BENCH_GROUPED=$cfg timeout 120 build-gpu/tests/test_cuda_grouped_gemm \
    --gtest_filter='*Benchmark' > "$OUT/bench_$tag.log" 2>&1
  grep BENCH "$OUT/bench_$tag.log"
  python3 - "$OUT/ncu_$tag.csv" "$cfg" <<'PY'
import csv, statistics, sys
path, cfg = sys.argv[1], sys.argv[2]
lines = [l for l in open(path) if l.startswith('"')]  # (ncu prints the benchmark's own output too)
rows = list(csv.DictReader(lines))
if len(rows) < 2:
    sys.exit(f"{path}: no ncu rows")
units, rows = rows[0], rows[1:]
# (the raw page adds every launch__ and device__ attribute: only the metrics asked for are printed)
metrics = [k for k in rows[0] if "__" in k and not k.startswith(("launch__", "device__"))]
# The benchmark runs each (case, kernel) 23 times in a row (3 warm-ups + 20): consecutive launches of
# one kernel name form a run; runs alternate gate_up then down per kernel order.
runs = []
for r in rows:
    name = r["Kernel Name"].replace("void ", "").replace("mf::cuda::(anonymous namespace)::", "").split("(")[0]
    if runs and runs[-1][0] == name:
        runs[-1][1].append(r)
    else:
        runs.append((name, [r]))
print(f"ncu {cfg}: median over each run of launches")
print("  " + " | ".join(["kernel (launches)"] + [f"{m.split('.')[0]} [{units.get(m, '')}]" for m in metrics]))
for name, rs in runs:
    vals = []
    for m in metrics:
        try:
            vals.append(f"{statistics.median(float(x[m].replace(',', '')) for x in rs):.4g}")
        except ValueError:
            vals.append("?")
    print(f"  {name[:70]} ({len(rs)}) | " + " | ".join(vals))
PY
done
