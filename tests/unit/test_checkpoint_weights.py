"""Writing a weights-only checkpoint's state into a model (``checkpoint/weights.py``).

One process, no DeepSpeed engine: the model's own parameters are written (there are no
masters to set). tests/dist/test_runner_contract.py covers engines at ZeRO 2-3 and bf16.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mmengine_deepspeed.checkpoint.layout import CheckpointError
from mmengine_deepspeed.checkpoint.weights import load_full_state_dict


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 2, bias=False)
        self.out = nn.Linear(3, 2, bias=False)
        self.out.weight = self.embed.weight
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer('count', torch.tensor(0))


def test_writes_every_entry_tied_once() -> None:
    source = Tied()
    with torch.no_grad():
        source.embed.weight.normal_()
        source.scale.fill_(3.0)
        source.count.fill_(7)
    target = Tied()
    load_full_state_dict(target, [], source.state_dict(), 'ckpt')
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    assert target.out.weight is target.embed.weight


@pytest.mark.parametrize('change, named', [
    (lambda s: s.pop('scale'), "missing ['scale']"),
    (lambda s: s.update(extra=torch.zeros(1)), "unexpected ['extra']"),
    (lambda s: s.update(scale=torch.zeros(2)), 'scale (2,) (model: ())'),
])
def test_a_state_of_another_model_is_refused_by_name(change, named: str) -> None:
    state = Tied().state_dict()
    change(state)
    target = Tied()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match='resume needs the model') as info:
        load_full_state_dict(target, [], state, 'iter_4.pth')
    assert named in str(info.value) and 'iter_4.pth' in str(info.value)
    assert 'load_from' in str(info.value)
    for key, value in target.state_dict().items():  # refused before anything was written
        assert torch.equal(value, before[key]), key
