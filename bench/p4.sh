#!/usr/bin/env bash
# Workload P4 of BENCHMARKS.md (Nemotron 3 Nano, its first 8 layers MEMEM*EM) on one GPU, side by side in one run: HF Transformers v5 (plain and
# under torch.compile) and moeforge, one after the other; one JSON line per system, then the
# ratios. Usage (on the GPU machine, from the repo root): bench/p4.sh [BUILD_DIR] [OUT_DIR]
#   MICRO_BATCH=1 (the speed target) or 2 (the memory target); STEPS, WARMUP; SKIP_COMPILE=1 (default)
#   leaves out the torch.compile run; SKIP_HF=1 leaves out HF (it runs out of memory at micro-batch 2).
#   HF runs its torch Mamba path (no mamba_ssm on that machine).
set -uo pipefail
BUILD=${1:-build}
OUT=${2:-bench/results}
LAYERS=${LAYERS:-8}
MICRO_BATCH=${MICRO_BATCH:-1}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
CFG=bench/configs/nemotron-3-nano-30b-a3b.json
mkdir -p "$OUT"
LOG="$OUT/p4_mb${MICRO_BATCH}.jsonl"
: > "$LOG"
common=(--config "$CFG" --layers "$LAYERS" --micro-batch "$MICRO_BATCH" --seq-len 4096 --steps "$STEPS" --warmup "$WARMUP")

"$BUILD/moeforge" bench "${common[@]}" --precision bf16 2> "$OUT/moeforge_stderr.log" | tee -a "$LOG"
FLOPS=$(python3 -c "import json,sys; print(json.loads(open('$LOG').readline())['flops_per_token'])")
"$BUILD/moeforge" bench "${common[@]}" --precision bf16 --steps 2 --warmup 1 --profile 2>/dev/null \
    | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({'system':'moeforge_profile','ms_per_step_by_op':d['ms_per_step_by_op']}))" | tee -a "$LOG"
[ "${SKIP_HF:-0}" = 1 ] || python3 bench/hf_baseline.py "${common[@]}" --flops-per-token "$FLOPS" 2> "$OUT/hf_stderr.log" | tee -a "$LOG"
if [ "${SKIP_COMPILE:-1}" != 1 ]; then
  python3 bench/hf_baseline.py "${common[@]}" --flops-per-token "$FLOPS" --compile 2> "$OUT/hf_compile_stderr.log" | tee -a "$LOG"
fi
python3 - "$LOG" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows[d["system"]] = d
mf = rows.get("moeforge")
for base in ("hf_v5", "hf_v5_compile"):
    if mf and base in rows:
        b = rows[base]
        print(json.dumps({"ratio": f"moeforge / {base}",
                          "tokens_per_s": mf["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"],
                          "peak_memory": mf["peak_gib"] / b["peak_gib"]}))
PY
