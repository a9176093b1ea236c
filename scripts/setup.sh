#!/usr/bin/env bash
# Create the virtual environment (.venv, or $VENV) with the pinned environment.
# torch goes in first, so that nothing that depends on it pulls a multi-GB CUDA
# build; DeepSpeed is built from source without build isolation so its setup
# sees that torch (its ops stay unbuilt and JIT-compile on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
C=requirements/constraints.txt
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q -c "$C" torch
python -m pip install -q -c "$C" --no-build-isolation deepspeed mmengine numpy ninja safetensors
python -m pip install -q -c "$C" pytest pytest-timeout ruff mypy huggingface_hub py-spy
python -m pip install -q -c "$C" --no-build-isolation --no-deps -e .
