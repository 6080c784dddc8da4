#!/usr/bin/env bash
# One GPU-host run: device info, ptxas resource report, correctness tests, optional bench.
# Expects prebuilt x86-64 binaries in .device/ (see bench/gpu/README.md); builds nothing.
# Usage (on the device machine, repo root): bash .device/run.sh [bench args...]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
D=.device
log() { echo "== $*"; }
log "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/device.txt"
ulimit -l 2>&1 | sed 's/^/memlock: /'
if [ -f $D/kvtier.ptx ] && command -v ptxas >/dev/null; then
  log "ptxas -v (sm_90)"
  ptxas -arch=sm_90 -v $D/kvtier.ptx -o /tmp/k.cubin 2>&1 | grep -E "Compiling|registers|spill|stack" | tee "$OUT/ptxas.txt"
fi
if [ "${RUN_TESTS:-1}" = 1 ]; then
  for t in $D/gpu_compile $D/gpu_backend $D/kvtier_kernels; do
    [ -x "$t" ] || continue
    log "test $t"
    "$t" --nocapture --test-threads=4 2>&1 | tee -a "$OUT/tests.txt" | grep -vE "^$"
  done
fi
if [ -x $D/gpu_bench ] && [ "${RUN_BENCH:-0}" = 1 ]; then
  log "bench"
  $D/gpu_bench "$@" 2>&1 | tee "$OUT/bench.txt"
fi
grep -E "test result|FAILED|panicked" "$OUT/tests.txt" 2>/dev/null | tail -n 12
