#!/usr/bin/env bash
# The socket path on decoder lanes (docs/benchmarks.md, "Decoder lanes"): steady-state
# tierbench cells, one session on one lane, then 8 sessions (one connection each) on 1, 2, 4
# and 8 lanes; then one client batching 8 sessions into one DECODE per layer
# (clients/python/bench/batched_decode.py) on 1 and 2 lanes. Two rounds.
# Prebuilt x86-64 tierd and tierbench in .device/ (bench/gpu/README.md); builds nothing.
# Usage (on the GPU host, repo root): bash bench/gpu/socket_lanes.sh
set -u
D=$PWD/.device
S=/tmp/socket_lanes.sock
up() {
  rm -f $S
  $D/tierd --socket $S --backend cuda --host-capacity 24GiB --set nvme.enabled=false \
    --set host.lock_memory=true --set backend.cuda.lanes=$1 --log-level warn > /dev/null 2>&1 &
  tp=$!
  for _ in $(seq 600); do [ -S $S ] && break; sleep 0.1; done
}
down() { kill $tp; wait $tp; }
cell() { # lanes sessions
  echo -n "lanes=$1 sessions=$2: "
  $D/tierbench --socket $S --sessions $2 --contexts 32768 --steps 400 --max-seconds 10 \
    --rtt-requests 10 2>&1 | grep -E "^ +$2 "
}
for r in 1 2; do
  echo "## round $r"
  up 1; cell 1 1; down
  for l in 1 2 4 8; do up $l; cell $l 8; down; done
  for l in 1 2; do
    up $l
    echo -n "batched lanes=$l: "
    python3 clients/python/bench/batched_decode.py --socket $S --sessions 8 --context 32768 --steps 40
    down
  done
done
