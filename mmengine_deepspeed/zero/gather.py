"""Whole parameters from ZeRO-3 partitions: gathering, and plain copies of a module.

Checkpoint loading, the EMA hook and ``deepcopy(runner.model)`` need a
module's parameters whole; under ZeRO-0/1/2 these are no-ops on the already
whole parameters, under ZeRO-3 every rank takes part (collective).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import deepspeed
from torch import nn

from ..compat import module_hook_dicts
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
