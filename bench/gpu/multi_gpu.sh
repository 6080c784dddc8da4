#!/usr/bin/env bash
# The multi-GPU run on a host of several GPUs (measured on two H200s), then the one-GPU
# test suite. Prebuilt x86-64 binaries in .device/ (bench/gpu/README.md; also engine_bench,
# tierd and the Python extension as .device/_native.abi3.so); builds nothing.
# Usage (on the device machine, repo root): bash bench/gpu/multi_gpu.sh
#   1. gpu_engine's multi-GPU tests: two engine processes one per GPU, and head shards across
#      the GPUs, bit-identical to one engine on device 0.
#   2. pcie_pair.py: host-to-device copy rate of each GPU alone and of all together.
#   3. engine_bench, Qwen2.5-7B geometry, k=32, at 128K (batch 1 and 8) and 1M (batch 1): one
#      tierd, sessions filled once; one engine on device 0 alone, then one engine per GPU at
#      once on the same sessions, every cell started together (--barrier).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=$PWD/.device
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
# NVLink multicast stays off: shared multi-GPU hosts may not allow it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVTIER_TEST_TIERD=$D/tierd
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv | tee $OUT/device.txt
nvidia-smi topo -m 2>&1 | head -8 | tee -a $OUT/device.txt
nproc; free -g | head -2
el "multi-GPU tests"
$D/gpu_engine --include-ignored --nocapture --test-threads=1 engine_processes_one_per_gpu head_shards_in_separate 2>&1 \
  | tee $OUT/mgpu.txt | grep -E "bit for bit|test result|panicked|FAILED|^test "
el "pcie"
python3 bench/gpu/pcie_pair.py --gib 2 --reps 5 2>&1 | tee $OUT/pcie.txt
. bench/gpu/tierd.sh
bench() { # context batches capacity
  local ctx=$1 batches=$2 cap=$3 S=/tmp/multi_gpu.sock
  start_tierd $S $cap $OUT/tierd_$ctx.log
  local tp=$TP
  local ids
  ids=$($D/engine_bench --socket $S --context $ctx --batches $batches --fill-only \
    | tee -a $OUT/bench_$ctx.txt | awk '/^sessions/{print $2}')
  el "filled $ctx"
  local common="--socket $S --context $ctx --ks 32 --batches $batches --steps 20 --warmup 3 --sessions $ids"
  echo "## one GPU (device 0)" | tee -a $OUT/bench_$ctx.txt
  $D/engine_bench $common --device 0 2>&1 | tee -a $OUT/bench_$ctx.txt
  local B=/tmp/barrier_$ctx pids=()
  rm -rf $B; mkdir -p $B
  for d in $(seq 0 $((NGPU - 1))); do
    $D/engine_bench $common --device $d --barrier $B:$NGPU > $OUT/all${d}_$ctx.txt 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for d in $(seq 0 $((NGPU - 1))); do
    echo "## $NGPU GPUs at once, device $d" | tee -a $OUT/bench_$ctx.txt
    tee -a $OUT/bench_$ctx.txt < $OUT/all${d}_$ctx.txt
  done
  kill $tp; wait $tp
}
bench 131072 1,8 60GiB
bench 1048576 1 60GiB
el "one-GPU suite"
# The daemon's tests start the tierd their build named (CARGO_BIN_EXE_tierd).
mkdir -p /work/main/target/release && cp $D/tierd /work/main/target/release/tierd
for t in gpu_cache_and_launch gpu_in_place kvtier_kernels gpu_decode gpu_daemon gpu_engine gpu_compile \
  gpu_attention gpu_selector gpu_errors; do
  [ -x $D/$t ] || continue
  el "test $t"
  $D/$t --include-ignored --test-threads=4 2>&1 | tee -a $OUT/tests.txt | grep -E "test result|panicked|FAILED"
done
el "pytest test_engine"
cp $D/_native.abi3.so clients/python/kvtier/ && KVTIER_TIERD=$D/tierd PYTHONPATH=clients/python \
  python3 -m pytest -q -x clients/python/tests/test_engine.py 2>&1 | tail -5 | tee $OUT/pytest.txt
el "end"
