#!/usr/bin/env bash
# Benchmark D1 of BENCHMARKS.md: P1's workload (Qwen3-30B-A3B geometry, --layers 4, micro-batch 2,
# seq 4096, bf16, one GPU) as a plain HF Transformers v5 training loop (bench/hf_baseline.py), in one
# run: stock, stock under torch.compile, and the same loop after `import moeforge.hf` with the fused
# loss on (eager and compiled); one JSON line per system, then the ratios against stock and compiled stock.
# Usage (GPU machine, repo root, the Python package built): BUILD=build PYTHONPATH=build/python bench/d1.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-bench/results}
mkdir -p "$OUT"
LOG="$OUT/d1.jsonl"
: > "$LOG"
CFG=bench/configs/qwen3-30b-a3b.json
common=(--config "$CFG" --layers "${LAYERS:-4}" --micro-batch "${MICRO_BATCH:-2}" --seq-len 4096 --steps "${STEPS:-5}"
        --warmup "${WARMUP:-2}")
# The model FLOPs per token: moeforge's own formula (BENCHMARKS.md), from a one-step moeforge bench.
FLOPS=${FLOPS:-$("${BUILD:-build}/moeforge" bench "${common[@]:0:8}" --steps 1 --warmup 1 --precision bf16 2>/dev/null |
                 python3 -c "import json,sys; print(json.load(sys.stdin)['flops_per_token'])" 2>/dev/null)}
[ -n "$FLOPS" ] || FLOPS=0
# PROFILE=1: each eager system's kernel table of one more step, in $OUT/profile_<n>.txt.
n=0
# MF_COMPILE=0 leaves out moeforge.hf under torch.compile (no ratio needs it); STOCK=0 leaves out eager
# stock (for a short run against compiled stock only).
variants=("--compile" "--moeforge-hf --fused-loss")
[ "${STOCK:-1}" = 1 ] && variants=("" "${variants[@]}")
[ "${MF_COMPILE:-1}" = 1 ] && variants+=("--moeforge-hf --fused-loss --compile")
# TWINS=1 / DISPATCHER=1 add moeforge.hf with every eager op call through the ops' twins / through torch's
# dispatcher (whatever moeforge.hf's default, EAGER_FAST_PATH, is).
[ "${TWINS:-0}" = 1 ] && variants+=("--moeforge-hf --fused-loss --eager-twins")
[ "${DISPATCHER:-0}" = 1 ] && variants+=("--moeforge-hf --fused-loss --eager-dispatcher")
for variant in "${variants[@]}"; do
  n=$((n + 1))
  prof=()
  [ "${PROFILE:-0}" = 1 ] && [[ "$variant" != *--compile* ]] && prof=(--profile "$OUT/profile_$n.txt")
  # shellcheck disable=SC2086
  python3 bench/hf_baseline.py "${common[@]}" --flops-per-token "$FLOPS" $variant "${prof[@]}" 2>> "$OUT/d1_stderr.log" |
    tee -a "$LOG"
done
python3 - "$LOG" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows[d["system"]] = d
for mine in [s for s in rows if s.startswith("hf_v5_moeforge")]:
    for base in ("hf_v5", "hf_v5_compile"):
        if mine in rows and base in rows:
            m, b = rows[mine], rows[base]
            print(json.dumps({"ratio": f"{mine} / {base}", "tokens_per_s": m["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"],
                              "peak_memory": m["peak_gib"] / b["peak_gib"]}))
PY
