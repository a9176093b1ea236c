"""engine/wrapper.py: what the model wrapper does to batches, and which steps a model overrides."""
from __future__ import annotations

from collections import namedtuple

import torch
from mmengine.structures import BaseDataElement
from torch import nn

from mmengine_deepspeed.engine.wrapper import cast_floating, overrides
from tests.helpers import ToyCustomStepModel, ToyModel


def test_cast_floating_walks_containers_and_spares_data_samples() -> None:
    Pair = namedtuple('Pair', 'a b')
    sample = BaseDataElement(score=torch.ones(2))
    data = {'inputs': torch.ones(2), 'idx': torch.arange(3),
            'nested': [torch.zeros(1), (torch.ones(1),)], 'pair': Pair(torch.ones(1), 3),
            'data_samples': [sample]}
    out = cast_floating(data, torch.bfloat16)
    assert out['inputs'].dtype == torch.bfloat16
    assert out['idx'].dtype == torch.int64
    assert out['nested'][0].dtype == torch.bfloat16
    assert out['nested'][1][0].dtype == torch.bfloat16
    assert isinstance(out['pair'], Pair) and out['pair'].a.dtype == torch.bfloat16
    assert out['data_samples'][0] is sample and sample.score.dtype == torch.float32


def test_overridden_steps_are_detected() -> None:
    assert not overrides(ToyModel(), 'train_step')
    assert overrides(ToyCustomStepModel(), 'train_step')
    assert not overrides(ToyCustomStepModel(), 'val_step')
    assert overrides(nn.Linear(1, 1), 'train_step')


class _Counted(nn.Module):
    """Counts its ``train()`` calls (MMDetection's backbones override it: norm_eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.generator, self.discriminator = nn.Linear(2, 2), nn.Linear(2, 1)

    def train(self, mode: bool = True) -> _Counted:
        self.calls += 1
        return super().train(mode)


class _Engine(nn.Module):
    """What the wrapper uses of a DeepSpeedEngine: ``module``, ``device``, and its
    ``train()``, which sets its module's mode."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.device = module, torch.device('cpu')

    def train(self, mode: bool = True) -> _Engine:
        self.training = mode
        self.module.train(mode)
        return self


def test_train_walks_the_model_once_per_call() -> None:
    """MMEngine's iteration loop calls it every iteration."""
    from mmengine_deepspeed.engine.wrapper import DeepSpeedEngineWrapper

    model = _Counted()
    wrapper = DeepSpeedEngineWrapper({'model': _Engine(model)})  # type: ignore[dict-item]
    wrapper.train()
    assert model.calls == 1
    wrapper.eval()
    assert not model.training and not model.generator.training
    model = _Counted()
    engines = {'generator': _Engine(model.generator),
               'discriminator': _Engine(model.discriminator)}
    wrapper = DeepSpeedEngineWrapper(engines, model=model)  # type: ignore[arg-type]
    wrapper.train()
    assert model.calls == 1 and all(engine.training for engine in engines.values())
    wrapper.train(False)
    assert not model.training and not model.discriminator.training
