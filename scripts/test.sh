#!/usr/bin/env bash
# Every test: the Rust workspace (unit, property and real-process integration tests, and the
# end-to-end tests in tests/) and the Python client and its transformers adapter against a real
# tierd, including Gemma 3 270M (clients/python/tests/test_real_model.py). The Python side runs
# in .venv, made and filled from PyPI by scripts/pyenv.sh on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/checkout.sh
before="$(checkout_state)"
source scripts/pyenv.sh
# The binaries the end-to-end tests (tests/tests) run; they would build them themselves.
cargo build --quiet -p tierd -p tierctl -p kvtier-bench --bin tierd --bin tierctl --bin tierbench
cargo test --workspace
# kvtier.engine's extension module (the in-engine path's Python binding), next to the package.
cargo build --quiet -p kvtier-native
cp target/debug/libkvtier_native.so clients/python/kvtier/_native.abi3.so
kvtier_pyenv
KVTIER_TIERD="$PWD/target/debug/tierd" "$PY" -m pytest -q -rs clients/python
checkout_unchanged test.sh "$before"
