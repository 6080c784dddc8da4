#!/usr/bin/env bash
# A real model end to end: Gemma 3 270M (GGUF from PyPI, loaded by transformers) answers a
# needle question over a long prompt twice — dense attention in the engine, and sparse
# attention through tierd (its global-attention layers' KV held in tierd) — side by side.
# Builds tierd (release), starts it on its embedded defaults but a 512 MiB page file (socket
# and NVMe dir in a temp dir), makes .venv on first use (scripts/pyenv.sh). Arguments go to
# `python -m kvtier.examples.real_model` (e.g. --context 8192 --top-k 8 --haystack repeated).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pyenv.sh
echo "real_model: building tierd (release; the first build takes several minutes)" >&2
cargo build --release -q -p tierd
kvtier_pyenv
dir="$(mktemp -d)"
# A 512 MiB page file (the embedded default preallocates 4 GiB) in the temp dir.
target/release/tierd --socket "$dir/tierd.sock" --set "nvme.dir=\"$dir/state\"" \
    --set 'nvme.capacity="512MiB"' --log-level warn &
tierd_pid=$!
trap 'kill $tierd_pid 2>/dev/null; wait $tierd_pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$dir/tierd.sock" ] && break; sleep 0.1; done
"$PY" -m kvtier.examples.real_model --socket "$dir/tierd.sock" "$@"
