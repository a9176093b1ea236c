"""config/layout.py: the layout key, checked before anything runs."""
from __future__ import annotations

from typing import Any

import pytest

from mmengine_deepspeed.config.layout import Layout
from tests.helpers import toy_config


def test_a_layout_names_its_world_size_only() -> None:
    assert Layout.of(None) is None
    assert Layout.of({'world_size': 8}) == Layout(8)
    for bad in ({'world_size': 0}, {'world_size': True}, {'world_size': '8'}, {'ranks': 8}, 8):
        with pytest.raises(ValueError, match='layout'):
            Layout.of(bad)


def test_the_ranks_must_divide_the_layout() -> None:
    assert Layout(8).per_rank(2) == 4 and Layout(8).per_rank(8) == 1
    with pytest.raises(ValueError, match=r'layout.world_size=8 cannot run on 3 ranks.*'
                                         r'divides 8 \(1, 2, 4, 8\)'):
        Layout(8).per_rank(3)
    with pytest.raises(ValueError, match='cannot run on 16 ranks'):
        Layout(8).per_rank(16)


def test_what_a_layout_cannot_emulate_is_refused_before_the_first_step(tmp_path: Any) -> None:
    from mmengine_deepspeed import DeepSpeedRunner

    layout = {'world_size': 2}
    with pytest.raises(ValueError, match=r"layout does not leave samples out yet.*rollback"):
        DeepSpeedRunner(**toy_config(str(tmp_path / 'a'), layout=layout,
                                     nonfinite={'policy': 'rollback'}))
    seeded = toy_config(str(tmp_path / 'b'), layout=layout)
    seeded['randomness'] = dict(seed=1, diff_rank_seed=True)
    with pytest.raises(ValueError, match='diff_rank_seed'):
        DeepSpeedRunner(**seeded).train()
    gan = toy_config(str(tmp_path / 'c'), layout=layout, model={'type': 'ToyCustomStepModel'})
    with pytest.raises(ValueError, match='steps its optimizers in its own train_step'):
        DeepSpeedRunner(**gan).train()
