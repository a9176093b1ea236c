"""Whole parameters from ZeRO-3 partitions: gathering, gathering where torch touches
them, and plain copies of a module.

Checkpoint loading, the EMA hook and ``deepcopy(runner.model)`` need a
module's parameters whole; under ZeRO-0/1/2 these are no-ops on the already
whole parameters, under ZeRO-3 every rank takes part (collective). Model code
that runs on a partitioned model (its construction inside ``zero.Init``, its
``init_weights()``, ``load_from``) gets each parameter whole where it touches
it (:class:`GatherOnUse`).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Optional

import deepspeed
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from ..compat import full_numel, full_shape, is_released, is_zero3_param, module_hook_dicts
from ..config.model_settings import largest_layer
from .zero_dim import broadcastable


@contextmanager
def gathered(module: nn.Module, modify: bool = False) -> Iterator[None]:
    """Full parameters inside the block (a no-op unless ZeRO-3 partitions them).

    Args:
        module (nn.Module): The engine's module.
        modify (bool): Whether the block writes the parameters; rank 0's
            values are then re-partitioned to every rank. Defaults to False.
    """
    with gathered_params(list(module.parameters()), modify):
        yield


@contextmanager
def gathered_params(params: list[nn.Parameter], modify: bool = False) -> Iterator[None]:
    """:func:`gathered` for some parameters (one at a time keeps a large model partitioned).

    Args:
        params (list[nn.Parameter]): The parameters to gather.
        modify (bool): As in :func:`gathered`. Defaults to False.
    """
    # The ExitStack closes after GatheredParameters, which broadcasts a
    # modified ZeRO-3 parameter on leaving: 0-dim ones are 1-dim just for
    # that (see zero/zero_dim.py).
    with ExitStack() as after_exit, \
            deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        try:
            yield
        finally:
            if modify:
                after_exit.enter_context(broadcastable(params))


def release_all(engine: Any) -> None:
    """Partition every parameter a ZeRO-3 ``engine`` holds whole, prefetched or in flight.

    Between phases (after a training epoch, training, a validation or test
    epoch) the engine may still hold parameters its last forward or backward
    prefetched, some of them in flight, and small ones it never releases:
    ``GatheredParameters`` in a hook then fails on leaving ("Cannot partition a
    param in flight"). DeepSpeed's ``empty_partition_cache`` waits for them and
    releases all; a no-op below ZeRO-3.
    """
    if engine.zero_optimization_partition_weights():
        engine.empty_partition_cache()


def is_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters were built by ``zero.Init`` (ZeRO-3 parameters)."""
    return any(is_zero3_param(p) for p in model.parameters())


def _zero_params(value: Any, found: dict[int, nn.Parameter]) -> None:
    if isinstance(value, nn.Parameter):
        if is_zero3_param(value):
            found.setdefault(id(value), value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _zero_params(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _zero_params(item, found)


def _getters(*names: str) -> frozenset:
    return frozenset(getattr(torch.Tensor, name).__get__ for name in names)


# What a tensor's shape answers: for a partitioned parameter, answered from
# its full shape without gathering (MMEngine logs shapes on rank 0 only, and
# a gather there would wait for ranks that never come).
SHAPE_QUERIES = _getters('shape', 'ndim') | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement}
# What the partitioned parameter itself answers as well as the whole one.
PARAMETER_QUERIES = _getters('dtype', 'device', 'requires_grad', 'is_leaf', 'grad') | {
    torch.Tensor.requires_grad_}


class GatherOnUse(TorchFunctionMode):
    """Inside the block, ZeRO-3 parameters are whole wherever torch touches them.

    Every rank must run the same operations on the same parameters in the
    same order (gathering is collective), which construction, initialisation
    and loading do. Persistent (small, never partitioned) ZeRO-3 parameters are
    taken too, so every rank ends with rank 0's values for them as well.

    Args:
        budget (int): How many elements may be gathered at once (the largest
            submodule's own); the parameters gathered longest ago are given
            back first. One parameter is gathered whatever its size.
    """

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget
        self._held: OrderedDict[int, tuple[nn.Parameter, Any]] = OrderedDict()
        self._numel = 0
        self._paused = False
        self.peak_numel = 0

    @override
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self._paused or func in PARAMETER_QUERIES:
            return func(*args, **kwargs)
        if func in SHAPE_QUERIES and args and is_released(args[0]):
            whole = torch.empty(full_shape(args[0]), device='meta')
            return func(whole, *args[1:], **kwargs)
        found: dict[int, nn.Parameter] = {}
        _zero_params(args, found)
        _zero_params(kwargs, found)
        for param in found.values():
            self._take(param)
        return func(*args, **kwargs)

    def _take(self, param: nn.Parameter) -> None:
        key = id(param)
        if key in self._held:
            self._held.move_to_end(key)
            return
        numel = full_numel(param)
        while self._held and self._numel + numel > self.budget:
            self._give_back(next(iter(self._held)))
        gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0)
        gathered.__enter__()
        self._held[key] = (param, gathered)
        self._numel += numel
        self.peak_numel = max(self.peak_numel, self._numel)

    def _give_back(self, key: int) -> None:
        param, gathered = self._held.pop(key)
        self._numel -= full_numel(param)
        # Leaving GatheredParameters broadcasts rank 0's values as bytes:
        # a whole 0-dim parameter is 1-dim just for that (zero_dim.py).
        with broadcastable([param]):
            gathered.__exit__(None, None, None)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Torch operations inside the block go by untouched (DeepSpeed's own, on
        parameters it is partitioning or gathering itself)."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    @override
    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._held:
            self._give_back(next(iter(self._held)))


def gather_on_use(model: nn.Module) -> AbstractContextManager:
    """:class:`GatherOnUse` for a partitioned ``model``, else a block that does nothing."""
    return GatherOnUse(largest_layer(model)) if is_partitioned(model) else nullcontext()


def _from_deepspeed(hook: Any) -> bool:
    return (getattr(getattr(hook, 'func', hook), '__module__', None) or '').startswith('deepspeed')


def whole_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with whole, plain parameters and no DeepSpeed hooks.

    ZeRO-3 parameters are gathered for the copy (collective: every rank
    copies). The hooks an engine put on the module and its children would
    drive that engine from the copy; they are left out (by where their
    functions come from: torch keeps hooks in the private ``_forward_hooks``
    and siblings, whose removal tests/dist/test_runner_contract.py checks).
    """
    with gathered(module):
        copied = copy.deepcopy(module)
    for child in copied.modules():
        for hooks in module_hook_dicts(child):
            for key in [k for k, hook in hooks.items() if _from_deepspeed(hook)]:
                del hooks[key]
    return copied
