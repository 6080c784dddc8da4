#!/usr/bin/env bash
# Every test: the Rust workspace (unit, property and real-process integration tests) and the
# Python client and its transformers adapter against a real tierd, including Gemma 3 270M
# (tests/test_real_model.py). The Python side runs in .venv, made and filled from PyPI by
# scripts/pyenv.sh on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pyenv.sh
cargo build --quiet -p tierd
cargo test --workspace
kvtier_pyenv
KVTIER_TIERD="$PWD/target/debug/tierd" "$PY" -m pytest -q clients/python
