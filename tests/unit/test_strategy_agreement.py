"""strategy/agreement.py: when the ranks agree, and on what (one process: its own values)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from mmengine.hooks import LoggerHook

from mmengine_deepspeed.strategy import agreement_of, strategy_of
from mmengine_deepspeed.strategy.agreement import Agreement
from tests.helpers import runner_stand_in


def _due(agreement: Agreement, iterations: int) -> list[int]:
    return [it for it in range(iterations) if agreement.due(it)]


def test_the_period_follows_the_time_per_iteration_and_keeps_the_logging_iterations() -> None:
    agreement = Agreement(interval=10, seconds=2.0)
    assert _due(agreement, 4) == [0, 1, 2, 3]  # every iteration until one agreement timed them
    for per_iteration, period in ((0.1, 10), (0.3, 5), (0.5, 2), (1.5, 1), (5.0, 1)):
        agreement._choose_period(per_iteration)
        assert agreement.period == period, per_iteration
    agreement._choose_period(0.3)
    assert _due(agreement, 30) == [0, 4, 9, 14, 19, 24, 29]
    agreement._choose_period(0.1)
    assert _due(agreement, 30) == [0, 9, 19, 29]


def test_one_collective_per_iteration_whoever_asks() -> None:
    """Hooks that ask at the same iteration share one agreement; every provider's numbers
    come back by name, the time per iteration picks the next period."""
    calls = []
    agreement = Agreement(interval=10, seconds=2.0)
    agreement.provide('peak', lambda: calls.append('peak') or [512.0])
    agreement.provide('signal', lambda: [0.0, 15.0])
    assert agreement.agreed(0) == {'peak': [512.0], 'signal': [0.0, 15.0]}
    assert agreement.agreed(0)['signal'] == [0.0, 15.0] and calls == ['peak']
    agreement.agreed(1)  # two fast iterations timed: the logging interval
    assert calls == ['peak', 'peak'] and agreement.period == 10


def test_the_run_has_one_agreement_at_loggerhooks_interval() -> None:
    runner = runner_stand_in(hooks=[LoggerHook(interval=7)])
    first = agreement_of(runner, 'a hook')
    assert agreement_of(runner, 'a hook') is first and first.interval == 7
    assert agreement_of(runner_stand_in(hooks=[]), 'a hook').interval == 10


def test_a_hook_given_a_plain_runner_says_what_it_needs() -> None:
    """Hooks reach DeepSpeed state through ``runner.strategy`` only: a Runner without
    one (or FlexibleRunner, whose strategy is MMEngine's) is told the fix."""
    for runner in (SimpleNamespace(hooks=[]), SimpleNamespace(strategy=object())):
        with pytest.raises(TypeError, match=r"PreemptionHook needs mmengine_deepspeed's "
                                            r"DeepSpeedRunner, not SimpleNamespace: set "
                                            r"runner_type='DeepSpeedRunner'"):
            strategy_of(runner, 'PreemptionHook')


def test_a_new_train_starts_afresh() -> None:
    agreement = Agreement(interval=10)
    agreement.provide('signal', lambda: [15.0])
    agreement.agreed(0)
    agreement.agreed(1)
    assert agreement.period == 10
    agreement.provide('signal', lambda: [0.0])  # the hooks' before_train of the next train()
    assert agreement.period == 1 and agreement.agreed(0) == {'signal': [0.0]}
