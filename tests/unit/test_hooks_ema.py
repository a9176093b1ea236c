"""hooks/ema.py: the averaging is MMEngine's, its step count kept as a number."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mmengine.registry import MODELS
from torch import nn

from mmengine_deepspeed.hooks.ema import DeepSpeedEMAHook


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)


@pytest.mark.parametrize('ema_cfg', [
    dict(type='ExponentialMovingAverage', momentum=0.3, interval=2),
    dict(type='ExponentialMovingAverage', momentum=0.1, update_buffers=True),
    dict(type='StochasticWeightAverage', interval=3),
])
def test_averages_as_mmengines_update_parameters(ema_cfg: dict) -> None:
    torch.manual_seed(0)
    model = _Net()
    hook = DeepSpeedEMAHook(ema_type=ema_cfg.pop('type'), **ema_cfg)
    runner: Any = SimpleNamespace(model=model, iter=0, epoch=0, max_iters=10, max_epochs=1)
    hook.before_run(runner)
    theirs = MODELS.build(hook.ema_cfg, default_args=dict(model=_Net()))
    theirs.load_state_dict(hook.ema_model.state_dict())
    for step in range(7):
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                if tensor.is_floating_point():
                    tensor.add_(torch.randn_like(tensor))
        runner.iter = step
        hook.after_train_iter(runner, step)
        theirs.update_parameters(model)
        for (key, mine), other in zip(hook.ema_model.state_dict().items(),
                                      theirs.state_dict().values()):
            assert torch.equal(mine, other), (step, key)
    assert hook._steps == int(hook.ema_model.steps) == 7
