#!/usr/bin/env bash
# Benchmark J1 (BENCHMARKS.md): the P1 layer's expert MLP forward + backward under jax.jit, moeforge.jax
# against jax.lax.ragged_dot and JAX's Pallas Mosaic-GPU grouped matmul, plus the whole moe_ffn layer,
# at 512 / 2048 / 8192 tokens, one JSON line per (system, tokens) and a line of ratios (bench/j1.py).
# Usage (GPU machine, repo root, the package built with its JAX extension):
#   bench/j1.sh [BUILD_DIR] [OUT_FILE]     TOKENS (512,2048,8192), SYSTEMS (all), PYTHON (python3)
# The lines are printed and appended to OUT_FILE (default bench/results/j1_<date>.jsonl).
set -euo pipefail
BUILD=$(realpath "${1:-build}")
OUT=${2:-bench/results/j1_$(date +%Y-%m-%d).jsonl}
PY=${PYTHON:-python3}
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import moeforge.jax" || { echo "j1.sh: moeforge.jax does not import from $BUILD/python" >&2; exit 1; }
mkdir -p "$(dirname "$OUT")"
"$PY" bench/j1.py --tokens "${TOKENS:-512,2048,8192}" --systems "${SYSTEMS:-moeforge,ragged_dot,pallas,moe_ffn}" \
    | tee -a "$OUT"
