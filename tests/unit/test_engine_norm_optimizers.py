"""engine/norm_optimizers.py: which optimizers ZeRO would change, and where each parameter
lies in a ZeRO-1/2 partition (the numbers themselves: tests/dist/test_norm_optimizers.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mmengine_deepspeed.engine.norm_optimizers import (
    NORM_MATH,
    check_for_zero,
    norm_math,
    zero12_slices,
)
from tests.norm_reference import RefLamb, RefLARS, UnknownLARS


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n)) for n in (5, 3, 7)]


@pytest.mark.skipif(not hasattr(torch.optim, 'Adafactor'), reason='torch without Adafactor')
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_a_shape_reading_optimizer_is_refused_at_zero_1_to_3(stage: int) -> None:
    optimizer = torch.optim.Adafactor(_params())
    with pytest.raises(ValueError, match=r'Adafactor factors its second moment.*'
                                         r'zero_allow_untested_optimizer does not change that'
                                         r'.*Use ZeRO-0'):
        check_for_zero(optimizer, stage, allow_untested=True)
    assert check_for_zero(optimizer, 0, allow_untested=False) is None


def test_an_unknown_optimizer_gets_a_note_when_allowed_and_known_ones_none() -> None:
    unknown = UnknownLARS(_params(), lr=0.1)
    note = check_for_zero(unknown, 2, allow_untested=True)
    assert note is not None and 'ZeRO steps UnknownLARS' in note
    assert check_for_zero(unknown, 2, allow_untested=False) is None  # DeepSpeed refuses it
    for known in (RefLARS(_params(), lr=0.1), RefLamb(_params())):
        assert check_for_zero(known, 2, allow_untested=True) is None
    assert norm_math(RefLARS(_params(), lr=0.1)) == 'lars'
    assert 'mmpretrain.engine.optimizers.lars.LARS' in NORM_MATH


@pytest.mark.parametrize('rank', [0, 1, 2])
def test_zero12_slices_cut_the_group_where_deepspeed_partitions_it(rank: int) -> None:
    """15 elements, 3 ranks, partitions of 5: [5 | 3 2 | 5 0-pad]."""
    params = _params()
    flat = torch.arange(100, dtype=torch.float32)[10 + 5 * rank:15 + 5 * rank]
    slices = zero12_slices(flat, params, 4, rank, 3)
    expected = {0: [(0, 5), (5, 0), (5, 0)], 1: [(0, 0), (0, 3), (3, 2)],
                2: [(0, 0), (0, 0), (0, 5)]}[rank]
    assert [(s.start - flat.storage_offset(), s.length) for s in slices] == expected
    assert [s.first for s in slices] == [True, False, False]
    assert {s.group for s in slices} == {4}


def _per_group_calls(optimizer: torch.optim.Optimizer) -> None:
    """Step as DeepSpeed's ZeRO-1/2 optimizer does: one call per group, that group alone."""
    groups = optimizer.param_groups
    for group in list(groups):
        optimizer.param_groups = [group]
        optimizer.step()
    optimizer.param_groups = groups


@pytest.mark.parametrize('kind', ['lars', 'lamb'])
def test_a_call_reduces_once_and_not_at_all_without_a_norm_scaled_parameter(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world of one with each group's parameters as DeepSpeed's flat partition (ZeRO-2's
    layout): the weights' call all-reduces once, the biases' (``lars_exclude``; LAMB without
    weight decay) not at all, and the numbers are the optimizer's own on whole tensors."""
    from mmengine_deepspeed.dist import init_distributed
    from mmengine_deepspeed.engine.norm_optimizers import PartitionedNormStep
    init_distributed('none')
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    biases = [nn.Parameter(torch.randn(3))]
    grads = [torch.randn_like(p) for p in weights + biases]

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        groups = [{'params': params[:2]}, {'params': params[2:], 'weight_decay': 0.0,
                                           'lars_exclude': True}]
        if kind == 'lars':
            return RefLARS(groups, lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.02)
        return RefLamb(groups, lr=0.01, weight_decay=0.02, max_grad_norm=100.0)

    reference = [nn.Parameter(p.detach().clone()) for p in weights + biases]
    for param, grad in zip(reference, grads):
        param.grad = grad.clone()
    build(reference).step()

    partitioned = build(weights + biases)
    flats = []
    for group in partitioned.param_groups:  # what deepspeed.initialize leaves there
        flat = nn.Parameter(torch.cat([p.detach().flatten() for p in group['params']]))
        flat.grad = torch.cat([grads[i].flatten() for i, p in enumerate(weights + biases)
                               if any(p is q for q in group['params'])])
        flats.append(flat)
    norm_step = PartitionedNormStep(partitioned, kind, 2, lambda: torch.sqrt(
        sum(g.pow(2).sum() for g in grads)))
    norm_step.install()
    for group, flat in zip(partitioned.param_groups, flats):
        group['params'] = [flat]
    reductions = []
    monkeypatch.setattr(torch.distributed, 'all_reduce',
                        lambda tensor, *args, **kwargs: reductions.append(tensor.shape))
    _per_group_calls(partitioned)
    assert reductions == [torch.Size([2, 2])]  # two norms of two parameters, one call
    expected = torch.cat([p.detach().flatten() for p in reference])
    torch.testing.assert_close(torch.cat([f.detach() for f in flats]), expected,
                               rtol=1e-6, atol=1e-7)
