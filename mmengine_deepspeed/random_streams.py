"""This process's random streams (python, numpy, torch, CUDA) as one state, read and set.

What a checkpoint saves per rank, what a resumed data iterator is created from, and what
each virtual rank of a ``layout`` keeps (``engine/virtual_ranks.py``). The numpy keys are
held as a torch tensor, so that the state loads with ``weights_only=True``.
"""
from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch and CUDA RNG states."""
    version, mt_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = cast(tuple, np.random.get_state())
    state: dict[str, Any] = {
        'python': (version, list(mt_state), gauss),
        'numpy': (np_kind, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos),
                  int(np_has_gauss), float(np_gauss)),
        'torch': torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state` (CUDA states only where CUDA is present)."""
    version, mt_state, gauss = state['python']
    random.setstate((version, tuple(mt_state), gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state['numpy']
    np.random.set_state((np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])
