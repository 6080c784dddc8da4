#!/usr/bin/env bash
# Every test: the Rust workspace (unit, property and real-process integration tests, and the
# end-to-end tests in tests/) and the Python client and its transformers adapter against a real
# tierd, including Gemma 3 270M (clients/python/tests/test_real_model.py). The Python side runs
# in .venv, made and filled from PyPI by scripts/pyenv.sh on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests must leave the checkout as they found it (generated files are git-ignored).
before="$(git status --porcelain 2>/dev/null || true)"
source scripts/pyenv.sh
# The binaries the end-to-end tests (tests/tests) run; they would build them themselves.
cargo build --quiet -p tierd -p tierctl -p kvtier-bench --bin tierd --bin tierctl --bin tierbench
cargo test --workspace
# kvtier.engine's extension module (the in-engine path's Python binding), next to the package.
cargo build --quiet -p kvtier-native
cp target/debug/libkvtier_native.so clients/python/kvtier/_native.abi3.so
kvtier_pyenv
KVTIER_TIERD="$PWD/target/debug/tierd" "$PY" -m pytest -q -rs clients/python
after="$(git status --porcelain 2>/dev/null || true)"
if [ "$before" != "$after" ]; then
    echo "test.sh: the tests changed the checkout (git status before and after differ):" >&2
    diff <(echo "$before") <(echo "$after") >&2 || true
    exit 1
fi
