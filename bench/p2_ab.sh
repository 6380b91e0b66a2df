#!/usr/bin/env bash
# A/B of P2 settings on the 2-GPU machine: the moeforge EP=2 P2 step (bench/p2.sh's shape) under
# each given setting in turn, ROUNDS (3) rounds alternating, STEPS (10) timed steps after WARMUP (3);
# prints one line per run and each setting's mean over the runs that gave a result. A setting is a space-separated list of VAR=value
# environment assignments and --bench-options, or "default".
# Usage (repo root): bench/p2_ab.sh BUILD_DIR OUT_DIR SETTING...
#   e.g. bench/p2_ab.sh build-gpu out default "MOEFORGE_PEER_COPY=ce MOEFORGE_EP_COMM_SMS=0"
set -uo pipefail
BUILD=$1
OUT=$2
shift 2
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
ROUNDS=${ROUNDS:-3}
declare -A total count
for ((r = 1; r <= ROUNDS; r++)); do
  for setting in "$@"; do
    envs=() opts=()
    for w in $setting; do
      case $w in
        default) ;;
        --*) opts+=("$w") ;;
        *=*) envs+=("$w") ;;
        *) opts+=("$w") ;;
      esac
    done
    ms=$(env "${envs[@]}" "$BUILD/moeforge" launch --nproc-per-node 2 -- bench --config bench/configs/qwen3-30b-a3b.json \
           --layers 8 --micro-batch 2 --seq-len 4096 --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --precision bf16 \
           --ep-size 2 "${opts[@]}" 2>> "$OUT/p2_ab_stderr.log" | grep '^{' | head -1 |
         python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('%.2f %.2f %.6f' % (d['step_ms'], d['peak_gib'], d['last_loss']))" 2>/dev/null)
    echo "round $r [$setting]: step_ms peak_gib loss = ${ms:-FAILED (see $OUT/p2_ab_stderr.log)}"
    if [ -n "$ms" ]; then
      total[$setting]=$(python3 -c "print(${total[$setting]:-0} + ${ms%% *})")
      count[$setting]=$((${count[$setting]:-0} + 1))
    fi
  done
done
for setting in "$@"; do
  if [ "${count[$setting]:-0}" -gt 0 ]; then
    python3 -c "print('mean [%s]: %.2f ms (%d runs)' % ('$setting', ${total[$setting]} / ${count[$setting]}, ${count[$setting]}))"
  else
    echo "mean [$setting]: no run gave a result"
  fi
done
