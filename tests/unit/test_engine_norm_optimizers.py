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
