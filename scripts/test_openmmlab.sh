#!/usr/bin/env bash
# The real-client tier: MMDetection, MMSegmentation and MMPretrain configs through
# their own tools/train.py with the three lines (tests/openmmlab), in .venv-openmmlab
# (scripts/setup_openmmlab.sh: ~25 minutes the first time, for mmcv's ops).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_openmmlab.sh
. .venv-openmmlab/bin/activate
python -m pytest -q --durations=10 -p no:cacheprovider tests/openmmlab "$@"
