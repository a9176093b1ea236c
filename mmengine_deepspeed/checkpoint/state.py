"""Client state in plain types: message hub, RNG states, per-rank buffers.

Everything we write must load with ``torch.load(weights_only=True)``, so
MMEngine's ``HistoryBuffer`` and numpy arrays are turned into lists and tensors
on the way out and rebuilt on the way in.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mmengine.logging import HistoryBuffer, MessageHub

from ..random_streams import rng_state, set_rng_state


def plain(value: Any) -> Any:
    """``value`` with numpy scalars/arrays and str subclasses turned into plain types."""
    if isinstance(value, str):
        return str(value)  # str subclasses (torch's TorchVersion) pickle as their class
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def hub_state(hub: MessageHub) -> dict[str, Any]:
    """``hub.state_dict()`` with every HistoryBuffer as plain lists."""
    state = hub.state_dict()
    scalars = {
        key: {'log_history': [float(v) for v in buf.data[0]],
              'count_history': [float(v) for v in buf.data[1]],
              'max_length': int(buf.max_length)}
        for key, buf in state['log_scalars'].items()
    }
    return {'log_scalars': scalars, 'runtime_info': plain(dict(state['runtime_info'])),
            'resumed_keys': dict(state['resumed_keys'])}


def load_hub_state(hub: MessageHub, state: dict[str, Any]) -> None:
    """Inverse of :func:`hub_state`."""
    scalars = {key: HistoryBuffer(v['log_history'], v['count_history'], v['max_length'])
               for key, v in state['log_scalars'].items()}
    hub.load_state_dict({'log_scalars': scalars, 'runtime_info': state['runtime_info'],
                         'resumed_keys': state['resumed_keys']})


def rank_state(module: torch.nn.Module) -> dict[str, Any]:
    """What differs between ranks: RNG states and module buffers.

    DeepSpeed saves buffers from rank 0 only; BatchNorm running statistics
    differ per rank (as with MMEngine's DDP), so each rank keeps its own.
    """
    buffers = {name: buf.detach().cpu().clone() for name, buf in module.named_buffers()}
    return {'rng': rng_state(), 'buffers': buffers}


def load_rank_state(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Inverse of :func:`rank_state`."""
    saved = state['buffers']
    for name, buf in module.named_buffers():
        if name in saved:
            with torch.no_grad():
                buf.copy_(saved[name].to(buf.device, buf.dtype))
    set_rng_state(state['rng'])


def outside_engines(model: torch.nn.Module, modules: dict[str, str]) -> dict[str, torch.Tensor]:
    """The state-dict entries of ``model`` that no engine's submodule holds.

    Args:
        model (nn.Module): The user's whole model.
        modules (dict[str, str]): ``{engine name: submodule path}``.

    Returns:
        dict[str, torch.Tensor]: Keys as in ``model.state_dict()``, on CPU.
    """
    prefixes = tuple(f'{path}.' for path in modules.values() if path)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
            if not k.startswith(prefixes)}
