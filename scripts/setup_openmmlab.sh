#!/usr/bin/env bash
# Create .venv-openmmlab: the pinned environment of scripts/setup.sh plus
# MMDetection, MMSegmentation, MMPretrain and MMagic with full mmcv. Three steps differ:
# * torch 2.13.0 is PyPI's own (CUDA) build, which runs on the CPU too: MMPretrain
#   imports torchvision, whose PyPI build needs it. Local wheelhouses of the CPU
#   build are bypassed for that one package.
# * mmcv's ops are built for the CPU from mmcv's source distribution: ~20 minutes
#   the first time on 2 cores, about a minute from pip's wheel cache after that.
# * MMagic 1.2.0 goes in with --no-deps and its own pins (requirements/mmagic.txt,
#   which says why), then scripts/patch_mmagic.py fixes two upstream bugs that stop it
#   before any runner is built (NumPy 2's np.bool8, DCGAN's init_weights).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export VENV=.venv-openmmlab
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
C=requirements/constraints.txt
O=requirements/openmmlab.txt
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is None)' \
        2>/dev/null; then
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/python" -m pip install -q --no-deps \
        --force-reinstall -c "$C" torch
fi
bash scripts/setup.sh
. "$VENV/bin/activate"
python -m pip install -q -c "$C" -c "$O" torchvision setuptools
MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} \
    python -m pip install -q -c "$C" -c "$O" --no-build-isolation mmcv
python -m pip install -q -c "$C" -c "$O" mmdet mmsegmentation mmpretrain ftfy regex
M=requirements/mmagic.txt
python -m pip install -q -c "$M" --no-deps mmagic lpips resize-right
python -m pip install -q -c "$M" diffusers transformers huggingface_hub imageio pandas \
    albumentations
python scripts/patch_mmagic.py
