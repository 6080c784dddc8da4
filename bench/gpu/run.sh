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
  for t in $D/gpu_compile $D/gpu_attention $D/gpu_selector $D/gpu_cache_and_launch $D/gpu_errors \
    $D/kvtier_kernels $D/gpu_decode $D/gpu_daemon $D/gpu_engine $D/gpu_in_place; do
    [ -x "$t" ] || continue
    log "test $t"
    # GPU tests are #[ignore]d (with the reason) so machines without a device report them
    # as ignored, not passed; here they run. gpu_engine starts the prebuilt tierd.
    KVTIER_TEST_TIERD="$PWD/$D/tierd" "$t" --include-ignored --nocapture --test-threads=4 2>&1 \
      | tee -a "$OUT/tests.txt" | grep -vE "^$"
  done
fi
if [ -x $D/gpu_bench ] && [ "${RUN_BENCH:-0}" = 1 ]; then
  log "bench"
  $D/gpu_bench "$@" 2>&1 | tee "$OUT/bench.txt"
  if [ "${RUN_BENCH_BF16:-0}" = 1 ]; then
    log "bench, bf16 outward-rounded summaries (1M tokens)"
    $D/gpu_bench --summaries-bf16 --contexts 1048576 --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench_bf16.txt"
  fi
fi
grep -E "test result|FAILED|panicked" "$OUT/tests.txt" 2>/dev/null | tail -n 16
if [ -x $D/gpu_bench ] && [ "${RUN_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  log "ncu kernel durations (1M tokens, k=32, batch 1 and 8; 8 GB host buffer, frames wrap)"
  for b in ${NCU_BATCHES:-1 8}; do
    ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip 336 --launch-count 84 \
      --print-summary per-kernel $D/gpu_bench --host-gb 8 --contexts 1048576 --ks 32 --batches $b \
      --steps 3 --warmup 2 > "$OUT/ncu_b$b.txt" 2>&1
    grep -E "^  [a-z_]+|gpu__time_duration" "$OUT/ncu_b$b.txt" | head -n 20
  done
fi
