#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), lint, type-check and run the whole suite.
# This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
mypy
# tests/openmmlab is its own tier (scripts/test_openmmlab.sh, in .venv-openmmlab).
python -m pytest -q --durations=15 --ignore=tests/openmmlab "$@"
