#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), lint, type-check and run the whole suite.
# This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
mypy
python -m pytest -q --durations=15 "$@"
