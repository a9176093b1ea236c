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
# One line per test file, so the progress shows which part runs (the multi-rank files
# under tests/dist take most of the time).
echo "Running the whole suite: about 20-30 minutes on 2 CPU cores (RESULTS.md says where measured)."
python -m pytest --durations=15 --ignore=tests/openmmlab "$@"
