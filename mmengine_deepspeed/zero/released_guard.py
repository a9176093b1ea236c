"""Stop, at the first iteration, code that updates ZeRO-3 parameters where ZeRO-3 drops it.

Under ZeRO-3 a parameter outside its module's forward holds only its
partition: its ``.data`` is an empty tensor on every rank, and model or hook
code that updates weights itself there (``p.data.mul_(m).add_(q.data)``, a
``copy_``) computes on nothing. Inside a forward, a parameter read through its
module is gathered whole, but a write into it is dropped when ZeRO-3 releases
it (the partition is kept as it was). Either way the run goes on silently with
other weights than Runner's. The patterns this package knows run on whole
tensors and keep what they wrote (averaged models and ``MeanTeacherHook``:
``in_step.py``); any other is stopped by :class:`ReleasedGuard` in the first
iteration, with an error naming the parameter, the line and the fixes.

The guard is a dispatch mode active for ``before_train`` and the first
training iteration only (every op of that iteration passes through it once;
nothing afterwards). It stops an op, unless the innermost Python frame outside
torch is DeepSpeed's or this package's, that
- computes on a released parameter's empty ``.data`` (views such as ``.data``
  and ``detach`` pass), or
- writes into a gathered parameter (the same storage; only operands of a
  parameter's whole shape are looked up), persistent ones included: ZeRO-3
  re-partitions those too between phases, from the partition it kept.
"""
from __future__ import annotations

import os.path as osp
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from typing_extensions import override

from ..compat import (
    TorchDispatchMode,
    full_shape,
    is_released,
    is_zero3_param,
    storage_key,
    writes_first_operand,
)
from .partitioned import NOT_MODEL_CODE, TORCH_CODE

_THIS_FILE = osp.abspath(__file__)
_KEPT = [False]  # inside an update this package keeps (in_step.py): nothing is stopped


@contextmanager
def kept_updates() -> Iterator[None]:
    """A block whose writes into whole ZeRO-3 parameters this package keeps (it
    re-partitions them from the values written): the guard lets them pass."""
    _KEPT[0], before = True, _KEPT[0]
    try:
        yield
    finally:
        _KEPT[0] = before


def _caller() -> Optional[traceback.FrameSummary]:
    """The innermost frame outside torch and this guard: None where that is DeepSpeed's or
    this package's (their own handling of partitioned parameters)."""
    frames = [f for f in traceback.extract_stack()
              if not f.filename.startswith(TORCH_CODE) and osp.abspath(f.filename) != _THIS_FILE]
    return None if not frames or frames[-1].filename.startswith(NOT_MODEL_CODE) else frames[-1]


_FIXES = ('Fixes: make the averaged copy an MMEngine BaseAveragedModel '
          '(ExponentialMovingAverage; this package updates those on whole tensors and keeps '
          'the result), or run the update outside the forward inside `with '
          'deepspeed.zero.GatheredParameters(params, modifier_rank=0):` (rank 0\'s values are '
          'kept), or train at ZeRO-2 (ds_config.zero_optimization.stage=2).')


class ReleasedGuard(TorchDispatchMode):
    """Raise where code outside DeepSpeed updates ``model``'s ZeRO-3 parameters in a way
    ZeRO-3 drops (module docstring).

    Args:
        model (nn.Module): The user's model, its parameters partitioned by ZeRO-3.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.params = [(name, p) for name, p in model.named_parameters() if is_zero3_param(p)]
        self.shapes = {tuple(full_shape(p)) for _, p in self.params}

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not func.is_view and not _KEPT[0]:
            written = writes_first_operand(func)
            for position, operand in enumerate(tree_flatten((args, kwargs))[0]):
                if isinstance(operand, torch.Tensor) and operand.is_floating_point():
                    self._check(func, operand, written and position == 0)
        return func(*args, **kwargs)

    def _check(self, func: Any, operand: torch.Tensor, written: bool) -> None:
        if operand.dim() == 1 and operand.numel() == 0:
            name = self._owner(operand, released=True)
            problem = ('outside any forward, where ZeRO-3 has released it: its .data is empty '
                       'on every rank, so this ' + ('does nothing' if written else
                                                   'sees no values'))
        elif written and tuple(operand.shape) in self.shapes:
            name = self._owner(operand, released=False)
            problem = ('while ZeRO-3 holds it gathered: the write is dropped when ZeRO-3 '
                       'releases it, which keeps the partition as it was')
        else:
            return
        caller = _caller() if name is not None else None
        if caller is None:
            return
        raise RuntimeError(
            f'{caller.filename}:{caller.lineno} `{caller.line}` '
            f'{"writes" if written else "reads"} parameter {name!r} ({func}) {problem}, '
            f'where MMEngine\'s Runner updates the whole weight. {_FIXES}')

    def _owner(self, tensor: torch.Tensor, released: bool) -> Optional[str]:
        """The name of the parameter whose ``.data`` shares ``tensor``'s storage, among the
        released ones (or the gathered ones)."""
        key = storage_key(tensor)
        for name, param in self.params:
            if is_released(param) == released and storage_key(param.data) == key:
                return name
        return None
