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

Hooks that do the same from outside the step (:data:`HOOK_UPDATES`:
MMDetection's ``MeanTeacherHook`` moves a semi-supervised detector's teacher
towards its student) run their update method the same way, with the whole
model they are given gathered. Any other code that computes on released
parameters is stopped in the first iteration (``released_guard.py``).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import partial
from types import MethodType
from typing import Any

from mmengine.model import BaseAveragedModel
from torch import nn

from ..compat import gather_whole, is_zero3_param, keep_local_slices, release_module_params
from .gather import gathered_params
from .released_guard import kept_updates

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
    _on_whole_tensors([engine], [model], averaged, lambda: update(averaged, model))


def _on_whole_tensors(engines: list[Any], read: list[nn.Module], written: nn.Module,
                      run: Callable[[], None]) -> None:
    """``run()`` with ``read``'s and ``written``'s parameters whole, ``written``'s
    re-partitioned afterwards from the values every rank computed alike."""
    for engine in engines:
        for module in (*read, written):
            release_module_params(engine, module)
    params = [p for p in written.parameters() if is_zero3_param(p)]
    ids = {id(p) for p in params}
    with gathered_params([p for m in read for p in m.parameters() if id(p) not in ids]):
        gather_whole(params)
        try:
            with kept_updates():
                run()
        finally:  # every rank updated alike from the same whole values: no broadcast
            keep_local_slices(params)


# Hooks that update the model's weights themselves, outside any forward (class name: the
# method, which takes the model it updates first); with ZeRO-3 engines it runs with that whole
# model gathered, and each rank keeps its slice of what every rank computed alike
HOOK_UPDATES = {
    'MeanTeacherHook': 'momentum_update',  # MMDetection: teacher <- EMA of the student
}


def hooks_update_on_whole_tensors(hooks: Iterable[Any], engines: list[Any]) -> list[Any]:
    """Make each hook of :data:`HOOK_UPDATES` update on whole tensors under ZeRO-3.

    Args:
        hooks (Iterable[Hook]): The runner's hooks.
        engines (list[DeepSpeedEngine]): The ZeRO-3 training engines, just built.

    Returns:
        list[Hook]: The hooks changed.
    """
    changed = []
    for hook in hooks if engines else ():
        method = HOOK_UPDATES.get(type(hook).__name__)
        if method is not None:
            update = partial(_hook_update_whole, engines, getattr(type(hook), method))
            vars(hook)[method] = MethodType(update, hook)  # the class keeps its own
            changed.append(hook)
    return changed


def _hook_update_whole(engines: list[Any], update: Callable[..., None], hook: Any,
                       model: nn.Module, *args: Any, **kwargs: Any) -> None:
    _on_whole_tensors(engines, [], model, lambda: update(hook, model, *args, **kwargs))
