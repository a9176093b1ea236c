"""This process's random streams (python, numpy, torch, CUDA) as one state, read and set.

What a checkpoint saves per rank, what a resumed data iterator is created from, and what
each virtual rank of a ``layout`` keeps (``engine/virtual_ranks.py``). The numpy keys are
held as a torch tensor, so that the state loads with ``weights_only=True``.
"""
from __future__ import annotations

import random
from typing import Any, Optional, cast

import numpy as np
import torch

# The streams as the libraries give them (python's tuple, numpy's tuple with its key array,
# torch's and CUDA's state tensors on the host): what switching inside one process uses, with
# no conversion of the numpy keys (a tensor read, for the checkpoint's form).
RawStreams = tuple[Any, Any, torch.Tensor, Optional[list[torch.Tensor]]]


def raw_streams() -> RawStreams:
    """This process's python, numpy, torch and CUDA RNG states, as they are."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_raw_streams(streams: RawStreams) -> None:
    """Inverse of :func:`raw_streams`."""
    python, numpy, torch_state, cuda = streams
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(torch_state)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def saved_form(streams: RawStreams) -> dict[str, Any]:
    """``streams`` in plain types and tensors (``weights_only`` loads them)."""
    python, numpy, torch_state, cuda = streams
    version, mt_state, gauss = python
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = cast(tuple, numpy)
    state: dict[str, Any] = {
        'python': (version, list(mt_state), gauss),
        'numpy': (np_kind, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos),
                  int(np_has_gauss), float(np_gauss)),
        'torch': torch_state,
    }
    if cuda is not None:
        state['cuda'] = cuda
    return state


def raw_form(state: dict[str, Any]) -> RawStreams:
    """Inverse of :func:`saved_form`."""
    version, mt_state, gauss = state['python']
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state['numpy']
    return ((version, tuple(mt_state), gauss),
            (np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss),
            state['torch'], state.get('cuda'))


def rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch and CUDA RNG states (the saved form)."""
    return saved_form(raw_streams())


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state` (CUDA states only where CUDA is present)."""
    set_raw_streams(raw_form(state))
