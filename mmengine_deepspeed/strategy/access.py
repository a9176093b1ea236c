"""How hooks and loops reach the run's DeepSpeed state: ``runner.strategy``, typed.

A hook of this package given a plain ``Runner`` (or MMEngine's ``FlexibleRunner``,
whose ``strategy`` is MMEngine's own) stops at its first use with an error naming
the fix, instead of failing on a missing attribute or turning itself off.
"""
from __future__ import annotations

from typing import Any

from .agreement import Agreement
from .run import RunStrategy


def strategy_of(runner: Any, needed_by: str) -> RunStrategy:
    """``runner.strategy``, or an error saying that ``needed_by`` needs DeepSpeedRunner."""
    strategy = getattr(runner, 'strategy', None)
    if not isinstance(strategy, RunStrategy):
        raise TypeError(
            f'{needed_by} needs mmengine_deepspeed\'s DeepSpeedRunner, not '
            f'{type(runner).__name__}: set runner_type=\'DeepSpeedRunner\' in the config '
            '(with custom_imports=dict(imports=[\'mmengine_deepspeed\'])), or remove '
            f'{needed_by}.')
    return strategy


def agreement_of(runner: Any, needed_by: str) -> Agreement:
    """The run's :class:`~.agreement.Agreement` (the strategy's), for ``needed_by``."""
    return strategy_of(runner, needed_by).agreement
