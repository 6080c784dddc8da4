#!/usr/bin/env bash
# Every test: the Rust workspace (unit, property and real-process integration tests) and the
# Python client (against a real tierd). Installs the Python test dependencies if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import numpy, pytest" 2>/dev/null; then
    python3 -m pip install --quiet numpy pytest
fi
cargo build --quiet -p tierd
cargo test --workspace
python3 -m pytest -q clients/python
