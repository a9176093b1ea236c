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
