#!/usr/bin/env bash
# The whole fine-tuning job on P1's step (BENCHMARKS.md), driven two ways one after the other in one
# run: `moeforge finetune` (the CLI) and moeforge.finetune (the same engine from Python, issue 23:
# within 2% of the CLI). Both train the same randomly initialised model (moeforge init, the
# Qwen3-30B-A3B geometry cut to LAYERS layers) on the same synthetic token rows; each side's figure
# is the mean tokens/s of its steps after WARMUP (metrics.jsonl), then the ratio.
# Usage (GPU machine, repo root, the Python package built): bench/p1_python.sh [BUILD_DIR] [OUT_DIR]
#   LAYERS (4), STEPS (8), WARMUP (3), SEQ_LEN (4096), MICRO_BATCH (2), DEVICE (cuda);
#   TINY=1: the tiny preset instead of the geometry (DEVICE=cpu SEQ_LEN=64 check the script anywhere).
set -euo pipefail
BUILD=$(realpath "${1:-build}")
OUT=$(realpath -m "${2:-bench/results}")
LAYERS=${LAYERS:-4} STEPS=${STEPS:-8} WARMUP=${WARMUP:-3} SEQ_LEN=${SEQ_LEN:-4096} MICRO_BATCH=${MICRO_BATCH:-2}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/p1_python.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ "${TINY:-0}" = 1 ]; then
  "$BUILD/moeforge" init --out "$WORK/model" --arch qwen3_moe --preset tiny > /dev/null
else
  "$PY" - "$WORK/config.json" "$LAYERS" <<'PY'
import json, sys
cfg = json.load(open("bench/configs/qwen3-30b-a3b.json"))
cfg["num_hidden_layers"] = int(sys.argv[2])
json.dump(cfg, open(sys.argv[1], "w"))
PY
  "$BUILD/moeforge" init --out "$WORK/model" --config "$WORK/config.json" > /dev/null
fi
"$PY" - "$WORK" "$STEPS" "$MICRO_BATCH" "$SEQ_LEN" <<'PY'
import json, random, sys
work, steps, batch, seq_len = sys.argv[1], *map(int, sys.argv[2:])
vocab = json.load(open(f"{work}/model/config.json"))["vocab_size"]
rng = random.Random(0)
with open(f"{work}/data.jsonl", "w") as f:  # one document per row: every step sees the same token count
    for _ in range(steps * batch):
        f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq_len)]}) + "\n")
PY
cat > "$WORK/recipe.yaml" <<YAML
model: model
data: {train: data.jsonl, format: tokens, shuffle: false}
train: {steps: $STEPS, micro_batch: $MICRO_BATCH, seq_len: $SEQ_LEN}
device: $DEVICE
precision: bf16
out: cli
YAML

"$BUILD/moeforge" finetune "$WORK/recipe.yaml" out="$WORK/cli" > "$OUT/p1_python_cli.log" 2>&1
"$PY" -c "import moeforge, sys; moeforge.finetune(sys.argv[1], out=sys.argv[2])" "$WORK/recipe.yaml" "$WORK/py" \
  > "$OUT/p1_python_py.log" 2>&1
"$PY" - "$WORK" "$WARMUP" "$OUT/p1_python.jsonl" <<'PY'
import json, sys
work, warmup, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for side in ("cli", "py"):
    steps = [json.loads(line) for line in open(f"{work}/{side}/metrics.jsonl")]
    timed = [s["tokens_per_s"] for s in steps if s.get("step", 0) > warmup and "tokens_per_s" in s]
    if not timed:
        sys.exit(f"p1_python: {side} recorded no step after the {warmup} warm-up steps")
    rows[side] = {"system": "moeforge_" + side, "steps_timed": len(timed), "tokens_per_s": sum(timed) / len(timed),
                  "peak_mem_gib": max(s.get("peak_mem_gib", 0.0) for s in steps)}
losses = {side: [json.loads(line).get("loss") for line in open(f"{work}/{side}/metrics.jsonl")] for side in rows}
rows["ratio"] = {"ratio": "python / cli", "tokens_per_s": rows["py"]["tokens_per_s"] / rows["cli"]["tokens_per_s"],
                 "same_losses": losses["py"] == losses["cli"]}  # (the same engine on the same rows: bitwise)
with open(log, "w") as f:
    for r in rows.values():
        print(json.dumps(r))
        f.write(json.dumps(r) + "\n")
PY
