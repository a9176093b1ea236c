"""DeepSpeed's JIT-compiled ops: built once per install, and none that training never calls.

DeepSpeed installed from source compiles its C++ ops on first use, through torch's
extension cache (``~/.cache/torch_extensions/<python>_<device>/<op>``). Two things
made that cost paid again and again:

- The cache is keyed by the op's name, while the build command holds the absolute paths
  of the DeepSpeed install it came from: two checkouts or virtual environments rebuild
  each other's op on every run (``cpu_adam`` takes about 80 s). Each install gets its own
  cache directory here, unless ``TORCH_EXTENSIONS_DIR`` is set.
- On a CPU machine every process group DeepSpeed creates builds its shared-memory
  all-reduce op (``deepspeed_shm_comm``, about 30 s, and it needs a compiler and ninja),
  which only DeepSpeed's inference all-reduce calls; training never does, so it is not
  built.
"""
from __future__ import annotations

import hashlib
import os
import os.path as osp
import sys

EXTENSIONS_DIR_VARIABLE = 'TORCH_EXTENSIONS_DIR'


def extensions_dir(deepspeed_dir: str, torch_version: str) -> str:
    """The cache directory for one DeepSpeed install's ops under one torch and Python."""
    cache = os.environ.get('XDG_CACHE_HOME') or osp.join(osp.expanduser('~'), '.cache')
    key = hashlib.sha1(osp.realpath(deepspeed_dir).encode()).hexdigest()[:10]
    python = f'py{sys.version_info.major}{sys.version_info.minor}'
    return osp.join(cache, 'torch_extensions', 'mmengine_deepspeed',
                    f'{python}_torch{torch_version}_{key}')


def keep_builds_per_install() -> None:
    """Point torch's extension cache at this DeepSpeed install's own directory.

    A user's ``TORCH_EXTENSIONS_DIR`` is kept. Reads where DeepSpeed is without
    importing it (``importlib.util.find_spec``), so it can run at package import.
    """
    if os.environ.get(EXTENSIONS_DIR_VARIABLE):
        return
    import importlib.util

    import torch

    spec = importlib.util.find_spec('deepspeed')
    if spec is None or spec.origin is None:
        return
    os.environ[EXTENSIONS_DIR_VARIABLE] = extensions_dir(osp.dirname(spec.origin),
                                                         torch.__version__)


def skip_inference_ops() -> None:
    """Before DeepSpeed creates its communication backend on CPU (DeepSpeed builds the
    op for its CPU accelerator only): do not build ``deepspeed_shm_comm``."""
    from .compat import mark_op_unavailable

    mark_op_unavailable('deepspeed_shm_comm')
