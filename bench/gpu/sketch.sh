#!/usr/bin/env bash
# The sketch selector on the GPU host: its tests, then what it costs against the key bound.
# Prebuilt x86-64 binaries in .device/ (bench/gpu/README.md): the GPU test binaries, tierd,
# engine_bench and the Python extension as _native.abi3.so; builds nothing.
# Usage (on the device machine, repo root): bash bench/gpu/sketch.sh tests|bench|engine|whole
#   tests: gpu_selector (CUDA keep-sets against the CPU selector's), gpu_decode (tierd's CUDA
#          decoder against its CPU path), gpu_engine and gpu_in_place (the in-engine path
#          against tierd's), test_engine.py (the Python binding).
#   bench: engine_bench, Qwen2.5-7B geometry, 128K x batch 8, k=8: the key bound and the
#          sketch selector, each cold and warm (one engine each, alternating twice); then one
#          1M-token session and whole_model.py at batch 1, k=8: the key bound and the sketch
#          selector (one engine each, alternating) against the dense 8K step in the same
#          process. SELECTORS (default bound,sketch) lists the selectors, e.g.
#          bound,sketch:32,sketch:64 (bench/gpu's engine_bench and whole_model.py syntax).
#   engine, whole: the two halves of bench, for each entry of BLOCKS (default
#          "128:8:$SELECTORS"): block tokens, top-k and selectors, e.g.
#          BLOCKS="128:8:sketch:64 64:16:sketch:128" compares block sizes at one budget of
#          keys (the sink stays 128 tokens and the local window 512).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SELECTORS=${SELECTORS:-bound,sketch}
D=${D:-$PWD/.device}  # the binaries (another folder for an A/B run)
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
export KVTIER_TEST_TIERD=$D/tierd KVTIER_TIERD=$D/tierd
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/device.txt
case "${1:-tests}" in
tests)
  for t in gpu_selector gpu_decode gpu_engine gpu_in_place; do
    [ -x $D/$t ] || continue
    el "test $t"
    $D/$t --include-ignored --nocapture --test-threads=2 2>&1 | tee -a $OUT/tests.txt \
      | grep -E "^test |test result|panicked|bit for bit"
  done
  el "test_engine.py"
  cp $D/_native.abi3.so clients/python/kvtier/_native.abi3.so
  PYTHONPATH=clients/python python3 -m pytest -q -p no:cacheprovider clients/python/tests/test_engine.py 2>&1 \
    | tee -a $OUT/tests.txt | tail -n 5
  ;;
bench|engine|whole)
  cp $D/_native.abi3.so clients/python/kvtier/_native.abi3.so
  S=/tmp/sketch.sock
  . bench/gpu/tierd.sh
  start() { start_tierd $S $1 $OUT/tierd.log; }  # capacity
  for entry in ${BLOCKS:-128:8:$SELECTORS}; do
    BT=${entry%%:*}; rest=${entry#*:}; K=${rest%%:*}; SEL=${rest#*:}
    tag=b$BT-k$K
    if [ "$1" != whole ]; then
      start 62GiB
      el "engine_bench 128K x 8, $BT-token blocks, k=$K: $SEL"
      $D/engine_bench --socket $S --context 131072 --batches 8 --ks $K --steps 20 --warmup 3 \
        --block-tokens $BT --selectors $SEL,$SEL 2>&1 | tee $OUT/engine_bench-$tag.txt
      kill $TP; wait $TP
    fi
    if [ "$1" != engine ]; then
      start 62GiB
      el "fill 1M, $BT-token blocks"
      ID=$($D/engine_bench --socket $S --context 1048576 --batches 1 --fill-only --block-tokens $BT \
        | tee $OUT/fill-$tag.txt | awk '/^sessions/{print $2}')
      el "whole model 1M b1, $BT-token blocks, k=$K: $SEL"
      PYTHONPATH=clients/python python3 clients/python/bench/whole_model.py --socket $S \
        --context 1048576 --batches 1 --dense-contexts 8192 --steps ${WHOLE_STEPS:-120} \
        --rounds ${WHOLE_ROUNDS:-2} --sessions $ID --modes kvtier,dense-hbm --top-k $K \
        --block-tokens $BT --graphs whole --selectors $SEL \
        --json $OUT/whole_model-$tag.json 2>&1 | tee $OUT/whole_model-$tag.txt | grep -vE "^\s*$"
      kill $TP; wait $TP
    fi
  done
  el "done"
  ;;
esac
