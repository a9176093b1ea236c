"""hooks/preemption.py with failure.py's exit codes, and the runner's own hooks beside the
registered ones (hooks/registration.py), in one process."""
from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.runner.priority import get_priority

from mmengine_deepspeed.failure import AgreedExit, is_failure
from mmengine_deepspeed.hooks.monitor import ThroughputHook
from mmengine_deepspeed.hooks.preemption import PreemptionHook, at_update_boundary
from mmengine_deepspeed.hooks.registration import (
    added_hooks,
    deepspeed_default_hooks,
    in_priority_order,
)
from tests.helpers import runner_stand_in


def test_an_agreed_exit_is_no_failure_but_an_error_is() -> None:
    assert not is_failure(AgreedExit(143))
    assert not is_failure(SystemExit(0)) and not is_failure(SystemExit(None))
    assert is_failure(SystemExit(2)) and is_failure(RuntimeError('x'))
    assert is_failure(KeyboardInterrupt())
    assert AgreedExit(143).code == 143


def test_preemption_hook_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'SIGTERMM'"):
        PreemptionHook(signals=['SIGTERMM'])
    with pytest.raises(ValueError, match='interval=0'):
        PreemptionHook(interval=0)


def test_signals_are_caught_only_inside_the_block() -> None:
    hook = PreemptionHook(signals=['SIGUSR1'])
    before = signal.getsignal(signal.SIGUSR1)
    with hook.catching_signals():
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
        assert hook.received == signal.SIGUSR1
        runner = runner_stand_in(rank=0, world_size=1, hooks=[])
        hook.before_train(runner)  # no process group: this rank's own
        assert runner.strategy.agreement.agreed(0)['signal'] == [int(signal.SIGUSR1)]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_preemption_waits_for_an_accumulation_boundary() -> None:
    model = torch.nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    wrapper.initialize_count_status(model, 0, 10)
    wrapper._inner_count = 1  # after the first iteration: gradients pending
    assert not at_update_boundary(wrapper)
    wrapper._inner_count = 2
    assert at_update_boundary(wrapper)
    other = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    other.initialize_count_status(model, 0, 10)
    other._inner_count = 1
    wrapper._inner_count = 1
    assert not at_update_boundary(OptimWrapperDict(a=other, b=wrapper))  # every one counts


def test_default_hooks_preemption_configures_the_runners_own_hook() -> None:
    """MMEngine's six default hooks stay six (``preemption`` is not registered); the key
    configures the PreemptionHook the runner runs beside them, None leaves it out."""
    assert 'preemption' not in deepspeed_default_hooks(None)
    assert 'preemption' not in deepspeed_default_hooks(dict(preemption=dict(interval=5)))

    def preemption(default_hooks: Any) -> list:
        return [h for h in added_hooks(default_hooks, None) if isinstance(h, PreemptionHook)]

    assert len(preemption(None)) == 1
    assert preemption(dict(preemption=None)) == []
    custom, = preemption(dict(preemption=dict(type='PreemptionHook', interval=5)))
    assert custom.interval == 5


def test_the_runners_own_hooks_run_in_priority_order_with_the_registered() -> None:
    registered = [Hook(), Hook()]
    registered[0].priority, registered[1].priority = 'VERY_HIGH', 'LOW'
    own = added_hooks(None, None)
    merged = in_priority_order(registered, own)
    assert merged[0] is registered[0] and set(map(id, merged)) == set(map(id, registered + own))
    priorities = [get_priority(h.priority) for h in merged]
    assert priorities == sorted(priorities)
    assert in_priority_order(merged, own) == merged  # a nested call adds nothing twice
    assert not any(isinstance(h, ThroughputHook)
                   for h in added_hooks(None, [dict(type='ThroughputHook', interval=3)]))
