"""Whole weights taken from, and written back into, a live model: weights-only checkpoints.

``CheckpointHook(save_optimizer=False)``, and ``runner.save_checkpoint()``
before ``train()`` has built an optimizer, write no DeepSpeed shards (ZeRO-3
keeps the fp32 weights inside its optimizer partitions, so those cannot just
be left out): one file with the consolidated state dict instead.

Where DeepSpeed keeps fp32 master weights apart from the module's (bf16 and
fp16 training, ZeRO-1/2/3's partitions), the file holds the masters,
through DeepSpeed's ``safe_get_full_fp32_param``; resuming writes the module
weights, refreshes the masters from them (for optimizers DeepSpeed gives no
per-parameter access to) and then sets the exact fp32 values with
``safe_set_full_fp32_param`` (ZeRO-3: ``safe_set_local_fp32_param``). A
weights-only checkpoint thus keeps what a full one keeps except the
optimizer's moments. Parameters are gathered one at a time, so a model too
large for one rank stays partitioned.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_set_full_fp32_param,
    safe_set_local_fp32_param,
)
from torch import nn

from ..compat import (
    full_shape,
    has_separate_master,
    is_zero3_param,
    local_partition,
    partition_group,
)
from ..zero.gather import gathered_params
from .layout import CheckpointError


def _holds_master(param: torch.Tensor) -> bool:
    """Whether DeepSpeed keeps a separate fp32 master of ``param``.

    These are the attributes ``safe_get/set_full_fp32_param`` dispatch on
    (private: set by DeepSpeed's ZeRO-3 optimizer on its module's parameters,
    by the ZeRO-1/2 and bf16 ones on those they step). A ZeRO-3 parameter no
    optimizer holds (an evaluation engine's, or a model built partitioned
    before its engine) has ``ds_id`` but no ``_z3_optimizer``, and
    ``safe_get_full_fp32_param`` would raise on it; for a frozen one it
    returns None. tests/dist/test_runner_contract.py pins the round trip.
    """
    return has_separate_master(param)


def _unique_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(key, tensor, first)`` for each state-dict entry; tied ones come once with
    ``first`` True, then again with it False."""
    seen: set[int] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        first = id(value) not in seen
        seen.add(id(value))
        yield key, value, first


def _whole(value: torch.Tensor) -> torch.Tensor:
    """One entry, whole and on CPU (collective for partitioned parameters)."""
    if isinstance(value, nn.Parameter) and _holds_master(value):
        master = safe_get_full_fp32_param(value)
        if master is not None:
            return master.detach().cpu()
    if is_zero3_param(value):
        with gathered_params([value]):  # type: ignore[list-item]
            return value.detach().cpu().clone()
    return value.detach().cpu().clone()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` as one file holds it (collective; every rank calls).

    Floating tensors are fp32 (the masters where DeepSpeed keeps them); tied
    parameters appear under each of their keys, sharing memory.

    Args:
        model (nn.Module): The user's whole model, inside engines or not.

    Returns:
        dict[str, torch.Tensor]: On rank 0 the whole state; on other ranks
        an empty dict (they only take part in the gathers).
    """
    keep = dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    first_key: dict[int, str] = {}
    for key, value, first in _unique_entries(model):
        if first:
            first_key[id(value)] = key
            whole = _whole(value)
            if keep:
                state[key] = whole.float() if whole.is_floating_point() else whole
        elif keep:
            state[key] = state[first_key[id(value)]]
    return state


def _check_fits(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [f'{key} {tuple(state[key].shape)} (model: {tuple(shape)})'
             for key, value in own.items() if key in state
             for shape in [full_shape(value)]
             if tuple(state[key].shape) != tuple(shape)]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f'{source} does not fit this model (missing {missing[:5]}, unexpected '
            f'{unexpected[:5]}, shapes {wrong[:5]}): resume needs the model it was saved from. '
            'To start from partly matching weights, use load_from with resume=False.')


def load_full_state_dict(model: nn.Module, optimizers: Iterable[Any],
                         state: dict[str, torch.Tensor], source: str) -> None:
    """Write a :func:`full_state_dict` into a live model, masters included (collective).

    Args:
        model (nn.Module): The user's whole model (inside its engines).
        optimizers (Iterable[Any]): The engines' optimizers (DeepSpeed's
            wrappers, or the torch optimizer itself at ZeRO-0 in fp32).
        state (dict[str, torch.Tensor]): Every key of the model's state dict.
        source (str): Where ``state`` came from, for messages.
    """
    _check_fits(model, state, source)
    masters = []
    with torch.no_grad():
        for key, value, first in _unique_entries(model):
            if not first:
                continue
            if is_zero3_param(value):
                with gathered_params([value], modify=True):  # type: ignore[list-item]
                    value.data.copy_(state[key])
            else:
                value.data.copy_(state[key])
            if isinstance(value, nn.Parameter) and _holds_master(value):
                masters.append((value, state[key]))
    for optimizer in optimizers:
        refresh = getattr(optimizer, 'refresh_fp32_params', None)
        if callable(refresh):  # masters from the weights just written
            refresh()
    for param, master in masters:  # then exact, where DeepSpeed lets us
        _set_master(param, master)


def _set_master(param: Any, value: torch.Tensor) -> None:
    """Set DeepSpeed's fp32 master of ``param`` (a parameter) to the whole ``value``."""
    if not is_zero3_param(param):
        safe_set_full_fp32_param(param, value.to(param.device))
        return
    # DeepSpeed 0.19's ZeRO-3 set_full_hp_param cuts the unpadded value into
    # padded partitions: on the last rank it fails for a parameter whose size
    # is not a multiple of the world size (a 0-dim one on 2 ranks). This
    # rank's partition is set instead, through the public local setter.
    partition = local_partition(param)
    assert partition is not None  # a ZeRO-3 parameter
    size = partition.numel()
    start = size * dist.get_rank(group=partition_group(param))
    piece = value.flatten()[start:start + size]
    local = torch.zeros(size, dtype=torch.float32)
    local[:piece.numel()] = piece
    safe_set_local_fp32_param(param, local.to(partition.device))
