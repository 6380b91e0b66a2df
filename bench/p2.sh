#!/usr/bin/env bash
# Workload P2 of BENCHMARKS.md on 2 GPUs (8 layers, micro-batch 2 x 4096 per GPU), side by side in
# one run: moeforge with expert parallelism over both GPUs (--ep-size 2), moeforge pure data
# parallel (--ep-size 1, labelled "moeforge_ep1", for the memory-per-GPU comparison), then HF
# Transformers v5 + FSDP2 under torchrun (bench/hf_fsdp2.py); one JSON line per system in
# OUT/p2_layers8.jsonl, each system's stderr in its own log in OUT, then the ratios.
# Usage (on the GPU machine, from the repo root): bench/p2.sh [BUILD_DIR] [OUT_DIR]
#   STEPS (5), WARMUP (2); SKIP_MOEFORGE=1 runs only the HF side (FLOPs/token then come from the
#   BENCHMARKS.md formula in hf_fsdp2.py instead of moeforge's line).
set -uo pipefail
BUILD=${1:-build}
OUT=${2:-bench/results}
LAYERS=8
NPROC=2
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
CFG=bench/configs/qwen3-30b-a3b.json
# NVLink SHARP multicast stays off (moeforge launch sets the same for its children).
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
LOG="$OUT/p2_layers${LAYERS}.jsonl"
: > "$LOG"
common=(--config "$CFG" --layers "$LAYERS" --micro-batch 2 --seq-len 4096 --steps "$STEPS" --warmup "$WARMUP")

# pick_json LABEL STDERR_LOG (opened for append by both sides): keep the first JSON line of stdin that has a "system" field (relabelled
# to LABEL when LABEL is not empty), print it and append it to $LOG; other stdout lines go to
# STDERR_LOG so nothing a rank prints is lost.
pick_json() {
  python3 -c '
import json, sys
label, log, side = sys.argv[1], sys.argv[2], open(sys.argv[3], "a")
found = False
for line in sys.stdin:
    d = None
    if not found and line.lstrip().startswith("{"):
        try:
            d = json.loads(line)
        except ValueError:
            d = None
    if isinstance(d, dict) and "system" in d:
        found = True
        if label:
            d["system"] = label
        s = json.dumps(d)
        print(s, flush=True)
        with open(log, "a") as f:
            f.write(s + "\n")
    else:
        side.write("[stdout] " + line)
if not found:
    print("p2.sh: no JSON result line (see " + sys.argv[3] + ")", file=sys.stderr)
' "$1" "$LOG" "$2"
}

FLOPS_ARGS=()
if [ "${SKIP_MOEFORGE:-0}" != 1 ]; then
  : > "$OUT/moeforge_ep2_stderr.log"
  "$BUILD/moeforge" launch --nproc-per-node "$NPROC" -- bench "${common[@]}" --precision bf16 --ep-size 2 \
      2>> "$OUT/moeforge_ep2_stderr.log" | pick_json "" "$OUT/moeforge_ep2_stderr.log"
  echo "moeforge --ep-size 2: exit ${PIPESTATUS[0]}" >&2
  : > "$OUT/moeforge_ep1_stderr.log"
  "$BUILD/moeforge" launch --nproc-per-node "$NPROC" -- bench "${common[@]}" --precision bf16 --ep-size 1 \
      2>> "$OUT/moeforge_ep1_stderr.log" | pick_json moeforge_ep1 "$OUT/moeforge_ep1_stderr.log"
  echo "moeforge --ep-size 1: exit ${PIPESTATUS[0]}" >&2
  FLOPS=$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("flops_per_token"):
        print(d["flops_per_token"]); break
' "$LOG")
  if [ -n "$FLOPS" ]; then FLOPS_ARGS=(--flops-per-token "$FLOPS"); fi
fi
: > "$OUT/hf_fsdp2_stderr.log"
torchrun --standalone --nproc-per-node "$NPROC" bench/hf_fsdp2.py "${common[@]}" ${FLOPS_ARGS[@]+"${FLOPS_ARGS[@]}"} \
    2>> "$OUT/hf_fsdp2_stderr.log" | pick_json "" "$OUT/hf_fsdp2_stderr.log"
echo "hf_fsdp2: exit ${PIPESTATUS[0]}" >&2

python3 - "$LOG" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows[d["system"]] = d
mf, ep1, hf = rows.get("moeforge"), rows.get("moeforge_ep1"), rows.get("hf_v5_fsdp2")
if mf and hf:
    print(json.dumps({"ratio": "moeforge (EP=2) / hf_v5_fsdp2",
                      "tokens_per_s_per_gpu": mf["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"],
                      "peak_memory": mf["peak_gib"] / hf["peak_gib"]}))
if ep1 and hf:
    print(json.dumps({"ratio": "moeforge_ep1 / hf_v5_fsdp2",
                      "tokens_per_s_per_gpu": ep1["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"],
                      "peak_memory": ep1["peak_gib"] / hf["peak_gib"]}))
if mf and ep1:
    print(json.dumps({"ratio": "moeforge EP=2 / EP=1",
                      "tokens_per_s_per_gpu": mf["tokens_per_s_per_gpu"] / ep1["tokens_per_s_per_gpu"],
                      "peak_memory": mf["peak_gib"] / ep1["peak_gib"]}))
PY
