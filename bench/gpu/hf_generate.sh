#!/usr/bin/env bash
# whole_model.py's kvtier step (one CUDA graph), then transformers' generate() with kvtier's
# caches against dense on the GPU host, at the same contexts, batches and top-k.
# Prebuilt binaries in $D (bench/gpu/README.md): tierd and the Python extension as
# _native.abi3.so. A transformers wheel in .whl/ (optional) is installed for this run only, so
# that the GPU host runs the version the CPU tests ran.
# Usage (on the device machine, repo root):
#   CONTEXTS=32768 BATCHES=1,4 bash bench/gpu/hf_generate.sh
#   MODES (default dense,dense-compiled,kvtier,kvtier-compiled; kvtier-at-once and
#   kvtier-compiled-at-once hand the prefill over after the forward), NEW (64), REPS (2), TOPK (8),
#   CAPACITY (tierd's host capacity: room for the largest batch x context, 48GiB), DEADLINE
#   (seconds of generate() after which no further mode starts; 0: none), WHOLE (0: skip the
#   whole_model.py step), DTYPE (bfloat16; float32 the same random weights, for token
#   identity), BLOCK (kvtier's block tokens for generate(), 128), PROFILE (modes to run once
#   more under torch's profiler).
# The GPU's clocks, power and temperature every 100 ms go to $OUT/gpu-clocks.csv (the rows of
# hf_generate.json say when each mode's timed calls began: "began", seconds since the epoch).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=${D:-$PWD/.device}
CONTEXTS=${CONTEXTS:-32768}; BATCHES=${BATCHES:-1,4}; TOPK=${TOPK:-8}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/clients/python PYTHONUNBUFFERED=1
# Inductor splits a compiled step around kvtier::attend and captures the rest in CUDA graphs.
export TORCHINDUCTOR_GRAPH_PARTITION=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$OUT/device.txt"
cp "$D/_native.abi3.so" clients/python/kvtier/_native.abi3.so
S=/tmp/hf.sock
pkill -f "tierd --socket $S" && sleep 1  # one left by an earlier run cut short
. bench/gpu/tierd.sh
start_tierd $S "${CAPACITY:-48GiB}" "$OUT/tierd.log"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv,nounits -lms 100 > "$OUT/gpu-clocks.csv" 2>&1 &
CP=$!
trap 'kill $TP $CP 2> /dev/null' EXIT
for ctx in ${CONTEXTS//,/ }; do
  [ "${WHOLE:-1}" = 0 ] && break
  el "whole_model.py kvtier step, $ctx tokens, batches $BATCHES, k=$TOPK"
  python3 clients/python/bench/whole_model.py --socket $S --context "$ctx" --batches "$BATCHES" \
    --modes kvtier --top-k "$TOPK" --selectors sketch --graphs whole --rounds 1 --steps 60 \
    --json "$OUT/whole_model-$ctx.json" 2>&1 | tee "$OUT/whole_model-$ctx.txt" | grep -vE "^\s*$"
done
el "generate(): contexts $CONTEXTS, batches $BATCHES, k=$TOPK"
python3 clients/python/bench/hf_generate.py --socket $S --contexts "$CONTEXTS" --batches "$BATCHES" \
  --modes "${MODES:-dense,dense-compiled,kvtier,kvtier-compiled}" --new-tokens "${NEW:-64}" --reps "${REPS:-2}" \
  --top-k "$TOPK" --dtype "${DTYPE:-bfloat16}" --block-tokens "${BLOCK:-128}" \
  ${PROFILE:+--profile "$PROFILE"} --deadline "${DEADLINE:-0}" --json "$OUT/hf_generate.json" 2>&1 | tee "$OUT/hf_generate.txt" \
  | grep -vE "^\s*$|Warning|warn\("
kill $TP $CP; wait $TP
trap - EXIT
el "done"
