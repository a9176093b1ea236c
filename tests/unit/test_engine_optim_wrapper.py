"""optim_wrapper.py: DeepSpeedOptimWrapper over a test double of a CUDA fp16 engine."""
from __future__ import annotations

import pytest
import torch
from mmengine.logging import MessageHub
from torch import nn

from mmengine_deepspeed import DeepSpeedOptimWrapper


class _Fp16EngineDouble:
    """Stands in for a CUDA fp16 DeepSpeed engine, which this machine cannot build."""

    def __init__(self) -> None:
        self.optimizer = type('Opt', (), {'loss_scale': 1024.0})()
        self.skipped_steps = 2
        self.boundaries: list[bool] = []
        self.steps = 0

    def set_gradient_accumulation_boundary(self, value: bool) -> None:
        self.boundaries.append(value)

    def backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> None:
        assert scale_wrt_gas is False
        loss.backward(retain_graph=retain_graph)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundaries[-1]

    def step(self) -> None:
        self.steps += 1

    def get_global_grad_norm(self) -> float:
        return 0.75

    def fp16_enabled(self) -> bool:
        return True

    def zero_optimization(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return False


def test_fp16_loss_scale_and_skipped_steps_reach_the_message_hub() -> None:
    """A test double replaces the engine: fp16 needs CUDA, which this machine lacks."""
    MessageHub.get_instance('fp16_test')
    param = nn.Parameter(torch.ones(2))
    engine = _Fp16EngineDouble()
    wrapper = DeepSpeedOptimWrapper(engine, torch.optim.SGD([param], lr=0.1),  # type: ignore
                                    accumulative_counts=2)
    wrapper.message_hub = MessageHub.get_instance('fp16_test')
    for _ in range(2):
        wrapper.update_params((param * 2).sum())
    assert engine.boundaries == [False, True]  # MMEngine's accumulation windows
    assert engine.steps == 2  # the engine is stepped after every backward
    assert torch.equal(param.grad, torch.full((2,), 2.0))  # each loss divided by 2
    hub = wrapper.message_hub
    assert hub.get_scalar('train/loss_scale').current() == 1024.0
    assert hub.get_scalar('train/skipped_steps').current() == 2.0
    assert hub.get_scalar('train/grad_norm').current() == 0.75


def test_partial_optimizer_state_is_not_handed_out() -> None:
    wrapper = DeepSpeedOptimWrapper(_Fp16EngineDouble(),  # type: ignore
                                    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(RuntimeError, match=r"one rank's partition"):
        wrapper.state_dict()
    with pytest.raises(RuntimeError, match='resume the runner'):
        wrapper.load_state_dict({})


def test_zero_kwargs_are_refused() -> None:
    wrapper = DeepSpeedOptimWrapper(_Fp16EngineDouble(),  # type: ignore
                                    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(ValueError, match='zero_kwargs'):
        wrapper.update_params(torch.ones(1, requires_grad=True).sum(), zero_kwargs={'x': 1})
