#!/usr/bin/env bash
# The main job end to end on embedded defaults: builds tierd and the demo client (release),
# starts tierd on the CPU backend, loads a synthetic long-context session with a planted needle,
# decodes, and prints per step the keep-set, bytes touched, needle found, and speed vs dense.
# Arguments go to the demo (e.g. --context 131072 --steps 4).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/checkout.sh
before="$(checkout_state)"
echo "demo: building tierd and the demo client (release; the first build takes several minutes)" >&2
cargo build --release -q -p tierd -p kvtier-bench --bin tierd --bin kvtier_demo
target/release/kvtier_demo "$@"
checkout_unchanged demo.sh "$before"
