# Sourced by the GPU scripts. start_tierd SOCKET CAPACITY LOG starts $D/tierd as an engine
# process needs it (a shared, locked host arena of CAPACITY, no NVMe tier), logging to LOG,
# waits up to two minutes for its socket and sets TP to its pid.
start_tierd() {
  rm -f "$1"
  "$D/tierd" --socket "$1" --backend cpu --host-capacity "$2" --set host.shared=true \
    --set host.lock_memory=true --set nvme.enabled=false --log-level warn > "$3" 2>&1 &
  TP=$!
  for _ in $(seq 1200); do [ -S "$1" ] && break; sleep 0.1; done
}
