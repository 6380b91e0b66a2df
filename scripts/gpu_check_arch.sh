#!/usr/bin/env bash
# The generic model layer on the GPU machine (issue 21), in two phases (one device call each):
#   PHASE=build  builds this tree (build-gpu, tests included) and, when .carry/base holds the source of
#                the commit before the change, that one (build-base, the binary only); runs ctest -L gpu.
#   PHASE=check  every family's tiny model fine-tuned on the GPU, evaluated by moeforge and by
#                transformers on the exported directory; then P1 (bench/p1.sh's workload) A/B: the
#                binary before and after the change, alternated in one run, and HF v5 once.
# googletest comes from .carry/googletest (no package registry there). Logs go to $OUT.
set -uo pipefail
OUT=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
exec > >(tee -a "$OUT/gpu_check_arch.log") 2>&1

if [ "${PHASE:-build}" = build ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  cmake -S . -B build-gpu -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_CUDA=ON \
    -DMOEFORGE_GTEST_SRC="$PWD/.carry/googletest" \
    -DMOEFORGE_PYTHON_EXECUTABLE="$(command -v python3)" \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir 2>/dev/null)" \
    > "$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
  if [ -d .carry/base ]; then
    cmake -S .carry/base -B build-base -DCMAKE_BUILD_TYPE=Release -DMOEFORGE_CUDA=ON -DMOEFORGE_TESTS=OFF \
      -DMOEFORGE_BENCH=OFF > "$OUT/cmake_base.log" 2>&1 &&
      (cmake --build build-base -j5 --target moeforge > "$OUT/build_base.log" 2>&1; echo "base build rc $?") &
    base_build=$!
  fi
  # -k: a test that does not compile is reported and the others still build.
  time cmake --build build-gpu -j11 -- -k > "$OUT/build.log" 2>&1 || grep -E "error" -A5 "$OUT/build.log" | head -40
  # NOTE: a bare `wait` would also wait for the `tee` of the exec above, which never ends.
  [ -n "${base_build:-}" ] && wait "$base_build"
  # CTEST_LIMIT_S bounds the whole GPU suite (the device call's limit); -j4: the tests share the GPU.
  (cd build-gpu && timeout "${CTEST_LIMIT_S:-480}" ctest -L gpu --output-on-failure -j4 --timeout 300 \
     > "$OUT/ctest_gpu.log" 2>&1; echo "ctest rc $?"; tail -40 "$OUT/ctest_gpu.log")
  grep -rh "^\[gpu step\]" build-gpu/Testing/Temporary/LastTest.log | head -80
  # The Python tests with this machine's python3 (torch present: test_gpu.py and test_hf.py run, not
  # skip), one pytest process per file, so that a crash in one file does not hide the others.
  for f in python/tests/test_*.py; do
    name=$(basename "$f" .py)
    PYTHONPATH="$PWD/build-gpu/python" MOEFORGE_REPO="$PWD" timeout 300 bash scripts/run_pytest.sh python3 "$f" \
      > "$OUT/py_$name.log" 2>&1
    echo "python $name rc $? ($(grep -E "passed|failed|error" "$OUT/py_$name.log" | tail -1))"
  done
  [ "${THEN_BENCH:-0}" = 1 ] || exit 0
  FAMILIES=none HF=0
fi

# --- PHASE=check ------------------------------------------------------------------------------------
# FAMILIES=none skips the per-family fine-tunes (ARCHS="a b" picks some); HF=0 skips the HF v5 baseline of P1.
python3 -c "
import json
rows=[json.loads(l) for l in open('demo/data/tokens.jsonl')]
rows=[r for r in rows if len(r['input_ids'])>=40][:8]
with open('/tmp/arch_eval.jsonl','w') as f:
    for r in rows:
        d={'input_ids':r['input_ids'][:40]}
        if 'labels' in r: d['labels']=r['labels'][:40]
        f.write(json.dumps(d)+'\n')
"
[ "${FAMILIES:-all}" = none ] && ARCHS="" || ARCHS=${ARCHS:-"qwen3_moe mixtral olmoe qwen2_moe nemotron_h"}
for arch in $ARCHS; do
  D=/tmp/arch/$arch && rm -rf $D
  build-gpu/moeforge init --arch $arch --preset tiny --seed 3 --out $D/base > /dev/null &&
    build-gpu/moeforge finetune demo/tiny_tokens.yaml model=$D/base out=$D/ft train.steps=30 device=cuda > $OUT/ft_$arch.log 2>&1
  echo "$arch: finetune on cuda rc $? ($(grep -o 'loss [0-9.]* -> [0-9.]*' $OUT/ft_$arch.log | tail -1))"
  echo "  moeforge eval cuda: $(build-gpu/moeforge eval --model $D/ft --data /tmp/arch_eval.jsonl --device cuda --json)"
  echo "  moeforge eval cpu:  $(build-gpu/moeforge eval --model $D/ft --data /tmp/arch_eval.jsonl --device cpu --json)"
  echo "  transformers:       $(python3 scripts/hf_eval.py $D/ft /tmp/arch_eval.jsonl 2>$OUT/hf_eval_$arch.err || tail -3 $OUT/hf_eval_$arch.err)"
done

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  CFG=bench/configs/qwen3-30b-a3b.json
  common=(--config "$CFG" --layers 4 --micro-batch 2 --seq-len 4096 --steps 5 --warmup 2 --precision bf16)
  for round in 1 2; do
    for side in base gpu; do
      [ -x build-$side/moeforge ] || continue
      build-$side/moeforge bench "${common[@]}" 2> $OUT/bench_${side}_$round.err |
        python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['binary']='$side'; d['round']=$round; print(json.dumps(d))" |
        tee -a $OUT/p1_ab.jsonl
    done
  done
  [ "${PHASES:-1}" = 1 ] && for side in base gpu; do  # where the step's time goes, per phase (each step synchronised on its own)
    [ -x build-$side/moeforge ] || continue
    build-$side/moeforge bench "${common[@]}" --phases > $OUT/phases_$side.json 2> $OUT/phases_$side.err
  done
  FLOPS=$(python3 -c "import json; print(json.loads(open('$OUT/p1_ab.jsonl').readline())['flops_per_token'])")
  [ "${HF:-1}" = 1 ] && python3 bench/hf_baseline.py "${common[@]:0:10}" --flops-per-token "$FLOPS" 2> $OUT/hf_stderr.log | tee -a $OUT/p1_ab.jsonl
  python3 - "$OUT/p1_ab.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
hf = [r for r in rows if r.get("system") == "hf_v5"]
for side in ("base", "gpu"):
    mine = [r for r in rows if r.get("binary") == side]
    if not mine:
        continue
    tps = [r["tokens_per_s_per_gpu"] for r in mine]
    line = {"binary": "before (4f0e8cd)" if side == "base" else "after", "tokens_per_s": tps,
            "peak_gib": [r["peak_gib"] for r in mine]}
    if hf:
        line["vs_hf_v5"] = [t / hf[0]["tokens_per_s_per_gpu"] for t in tps]
        line["memory_vs_hf_v5"] = [r["peak_gib"] / hf[0]["peak_gib"] for r in mine]
    print(json.dumps(line))
PY
fi
