#!/usr/bin/env bash
# Create .venv-openmmlab: the pinned environment of scripts/setup.sh plus
# MMDetection, MMSegmentation and MMPretrain with full mmcv (its ops built for
# the CPU from mmcv's source distribution: ~25 minutes the first time on 2
# cores, about a minute from pip's wheel cache after that).
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=.venv-openmmlab
bash scripts/setup.sh
. "$VENV/bin/activate"
C=requirements/constraints.txt
O=requirements/openmmlab.txt
python -m pip install -q -c "$C" -c "$O" setuptools
MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} \
    python -m pip install -q -c "$C" -c "$O" --no-build-isolation mmcv
python -m pip install -q -c "$C" -c "$O" mmdet mmsegmentation mmpretrain
