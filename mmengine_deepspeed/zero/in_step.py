"""Averaged models that a model updates in its own step, under ZeRO-3.

BYOL, MoCo v3 and mean-teacher models keep an averaged copy of an encoder
(MMEngine's ``BaseAveragedModel``: ``ExponentialMovingAverage``, MMPretrain's
``CosineEMA``) and call its ``update_parameters(encoder)`` inside their own
loss, outside any module's forward. Under ZeRO-3 both encoders are released
partitions there: the update reads and writes empty tensors, which silently
does nothing (the first call's copy) or fails on shapes later.

Inside a ZeRO-3 training engine, each averaged model's ``update_parameters``
runs on whole tensors instead: the source's and the average's parameters are
released (waiting for any prefetch in flight), gathered, updated by the
model's own ``update_parameters``, and the average re-partitioned, each rank
keeping its own slice of the values every rank computed alike (no broadcast).
Per update that is one gather of the source and one of the average, and both
copies whole for its duration (``plan`` counts them); models without an
averaged model gather nothing.
"""
from __future__ import annotations

import weakref
from types import MethodType
from typing import Any

from mmengine.model import BaseAveragedModel
from torch import nn

from ..compat import gather_whole, is_zero3_param, keep_local_slices, release_module_params
from .gather import gathered_params

# The engine each wrapped averaged model belongs to; a deep copy of the model
# (the EMA hook's template, ``whole_copy``) keeps the wrapped method but is not
# in here, and updates as MMEngine's averaged model does.
_ENGINES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def averaged_models(module: nn.Module) -> list[nn.Module]:
    """The averaged models (``BaseAveragedModel``) inside ``module``."""
    return [m for m in module.modules() if isinstance(m, BaseAveragedModel)]


def update_on_whole_tensors(engine: Any) -> list[nn.Module]:
    """Make each averaged model inside a ZeRO-3 training engine update on whole tensors.

    Args:
        engine (DeepSpeedEngine): The engine, just built with an optimizer at ZeRO-3.

    Returns:
        list[nn.Module]: The averaged models now updated whole.
    """
    found = averaged_models(engine.module)
    for averaged in found:
        _ENGINES[averaged] = engine
        # an instance attribute: the class (and so other instances and plain
        # MMEngine runs) keeps MMEngine's method
        vars(averaged)['update_parameters'] = MethodType(_update_whole, averaged)
    return found


def _update_whole(averaged: BaseAveragedModel, model: nn.Module) -> None:
    update = type(averaged).update_parameters
    engine = _ENGINES.get(averaged)
    if engine is None:
        update(averaged, model)
        return
    for module in (model, averaged):
        release_module_params(engine, module)
    params = [p for p in averaged.parameters() if is_zero3_param(p)]
    with gathered_params(list(model.parameters())):
        gather_whole(params)
        try:
            update(averaged, model)
        finally:  # every rank updated alike from the same whole values: no broadcast
            keep_local_slices(params)
