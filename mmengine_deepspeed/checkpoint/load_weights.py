"""Weights from a file into a live model: ``load_from`` and ``runner.load_checkpoint``.

Reads our checkpoint directories (consolidated through ``zero_to_fp32``),
MMEngine's ``.pth`` files and ``.safetensors``; refuses weights that match
nothing in the model instead of training from random weights.
"""
from __future__ import annotations

import os.path as osp
import re
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..zero.gather import gather_on_use
from .export import consolidated_state_dict
from .layout import META_KEY, STATE_DICT_KEY, CheckpointError, check_checkpoint
from .safe_load import safe_load


def read_weights(source: str, allow_unsafe: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights and meta from our checkpoint directory, a ``.pth`` or a ``.safetensors``."""
    if osp.isdir(source):
        return consolidated_state_dict(source, allow_unsafe), dict(check_checkpoint(source))
    if not osp.isfile(source):
        raise CheckpointError(f'load_from={source!r} does not exist.')
    if source.endswith('.safetensors'):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(source), {}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f'{source} cannot be read as safetensors ({e}): it is truncated '
                                  'or not a safetensors file. Copy it again.') from e
    loaded = safe_load(source, allow_unsafe)
    if not isinstance(loaded, dict):
        raise CheckpointError(f'{source} holds a {type(loaded).__name__}, not a state dict.')
    meta = loaded.get(META_KEY, {}) if isinstance(loaded.get(META_KEY), dict) else {}
    state = loaded.get(STATE_DICT_KEY, loaded)
    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f'{source} is not a state dict (tensor values under "state_dict" or at the top).')
    return state, meta


def revise(state: dict[str, torch.Tensor],
           revise_keys: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Apply MMEngine-style ``(pattern, replacement)`` key rewrites."""
    for pattern, replacement in revise_keys:
        state = {re.sub(pattern, replacement, k): v for k, v in state.items()}
    return state


def refuse_unrelated(state: dict[str, torch.Tensor], model: nn.Module, source: str) -> None:
    """Refuse weights none of whose keys the model has (another model, or unrevised keys).

    MMEngine's non-strict loading would warn twice and train from random
    weights; a partial match (a backbone into a detector) still loads.
    """
    own = list(model.state_dict())
    if not state or not own or not set(state).isdisjoint(own):
        return
    raise CheckpointError(
        f'{source} matches none of this model\'s parameters: it holds {len(state)} keys '
        f'({", ".join(sorted(state)[:3])}, ...), the model has {", ".join(own[:3])}, ... '
        'Check that load_from names weights of this model; to map other key names, call '
        "runner.load_checkpoint(path, revise_keys=[(r'^backbone\\.', '')]) (pattern, "
        "replacement), or load a part with init_cfg=dict(type='Pretrained', prefix=...).")


def load_weights_into(model: nn.Module, source: str, *, strict: bool,
                      revise_keys: Sequence[tuple[str, str]], allow_unsafe: bool,
                      logger: Any, bare: bool = True) -> dict[str, Any]:
    """Load ``source``'s weights into ``model``.

    Args:
        bare (bool): No engine exists yet: a model built partitioned
            (``zero.Init``) is written one parameter group at a time
            (``gather.gather_on_use``). Otherwise the caller gathered it.
            Defaults to True.

    Returns:
        dict: ``{'meta': ..., 'state_dict': ...}`` for ``after_load_checkpoint``.
    """
    state, meta = read_weights(source, allow_unsafe)
    state = revise(state, revise_keys)
    refuse_unrelated(state, model, source)
    try:
        with gather_on_use(model) if bare else nullcontext():
            result = model.load_state_dict(state, strict=strict)
    except RuntimeError as e:
        raise CheckpointError(
            f'{source} does not fit this model: {e}\nCheck that load_from names a checkpoint '
            'of this model, or adapt the keys with revise_keys.') from e
    if result.missing_keys:
        logger.warning(f'load_from {source}: missing keys {result.missing_keys}')
    if result.unexpected_keys:
        logger.warning(f'load_from {source}: unexpected keys {result.unexpected_keys}')
    logger.info(f'Loaded weights from {source}')
    return {META_KEY: meta, STATE_DICT_KEY: state}
