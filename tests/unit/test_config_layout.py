"""config/layout.py: the layout key, checked before anything runs."""
from __future__ import annotations

from typing import Any

import pytest

from mmengine_deepspeed.config.layout import Layout, Split, finer
from tests.helpers import model_state, recorder, toy_config


def test_a_layout_names_its_world_size_and_its_split() -> None:
    assert Layout.of(None) is None
    assert Layout.of({'world_size': 8}) == Layout(8)
    assert Layout.of({'world_size': 8, 'micro_batches': 'auto', 'memory_gib': 7.5}) == \
        Layout(8, 'auto', 7.5)
    assert Layout.of({'world_size': 2, 'micro_batches': 2, 'split_batchnorm': True}) == \
        Layout(2, 2, None, True)
    for bad in ({'world_size': 0}, {'world_size': True}, {'world_size': '8'}, {'ranks': 8}, 8,
                {'micro_batches': 2}, {'world_size': 8, 'micro_batches': 0},
                {'world_size': 8, 'micro_batches': 'half'},
                {'world_size': 8, 'micro_batches': 'auto', 'memory_gib': -1},
                {'world_size': 8, 'memory_gib': 16},
                {'world_size': 8, 'split_batchnorm': 'yes'}):
        with pytest.raises(ValueError, match='layout'):
            Layout.of(bad)


def test_a_split_divides_the_batch_and_auto_takes_the_smallest_that_fits() -> None:
    assert Layout(8).split(6) == Split(1, '')
    assert Layout(8, 3).split(6) == Split(3, 'layout.micro_batches=3')
    with pytest.raises(ValueError, match=r'micro_batches=4 does not divide.*=6.*1, 2, 3, 6'):
        Layout(8, 4).split(6)
    asked: list[int] = []

    def peak(micro_batch: int) -> float:  # 100 MiB of states, 10 MiB a sample
        asked.append(micro_batch)
        return 100.0 + 10 * micro_batch

    split = Layout(8, 'auto').split(12, peak, 135.0)  # 12, 6 and 4 do not fit, 3 does
    assert split.count == 4 and asked == [12, 6, 4, 3]
    assert '12 is predicted at 220 MiB per rank, over 135 MiB (the device' in split.why
    assert '3 samples at 130 MiB fit' in split.why
    assert Layout(8, 'auto').split(12, peak, 1e6).count == 1
    assert Layout(8, 'auto', memory_gib=0.125).split(12, peak, 1e6) == Split(6, (
        "micro_batches='auto': the whole batch of 12 is predicted at 220 MiB per rank, over "
        '128 MiB (layout.memory_gib); 2 samples at 120 MiB fit'))
    assert Layout(8, 'auto').split(12, peak, 111.0).why.endswith('; 1 sample at 110 MiB fits')
    with pytest.raises(ValueError, match=r'even one sample is predicted at 110 MiB.*plan'):
        Layout(8, 'auto').split(12, peak, 50.0)


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
    with pytest.raises(ValueError, match=r"layout does not roll back yet.*'skip' or 'stop'"):
        DeepSpeedRunner(**toy_config(str(tmp_path / 'a'), layout=layout,
                                     nonfinite={'policy': 'rollback'}))
    seeded = toy_config(str(tmp_path / 'b'), layout=layout)
    seeded['randomness'] = dict(seed=1, diff_rank_seed=True)
    with pytest.raises(ValueError, match='diff_rank_seed'):
        DeepSpeedRunner(**seeded).train()
    gan = toy_config(str(tmp_path / 'c'), layout=layout, model={'type': 'ToyCustomStepModel'})
    with pytest.raises(ValueError, match='steps its optimizers in its own train_step'):
        DeepSpeedRunner(**gan).train()


def test_a_split_batch_trains_as_the_whole_batch(tmp_path: Any) -> None:
    """``layout.micro_batches=2`` on the run's own ranks (N = W = 1): each batch of 4 in two
    micro-steps of 2, one optimizer step; the parameters of the unsplit run (fp32
    summation order) and its logged loss (the mean of the micro-batches')."""
    from mmengine_deepspeed import DeepSpeedRunner

    results = []
    for name, layout in (('whole', None), ('split', {'world_size': 1, 'micro_batches': 2})):
        runner = DeepSpeedRunner(**toy_config(str(tmp_path / name), with_bn=False,
                                              max_iters=4, val=False, layout=layout))
        runner.train()
        results.append((model_state(runner.strategy.bare_model), recorder(runner).losses))
    (whole, whole_losses), (split, split_losses) = results
    assert max((split[k] - v).abs().max().item() for k, v in whole.items()) <= 1e-5
    assert split_losses == pytest.approx(whole_losses, abs=1e-5)
    assert runner.strategy.virtual_ranks.split == 2  # type: ignore[union-attr]
    assert runner.strategy.engines()['model'].gradient_accumulation_steps() == 2


def test_splitting_a_batchnorm_model_needs_its_opt_in(tmp_path: Any) -> None:
    """BatchNorm's statistics would come from each micro-batch: refused, naming the layer
    and the opt-in; with ``split_batchnorm=True`` it trains split."""
    from mmengine_deepspeed import DeepSpeedRunner

    layout = {'world_size': 1, 'micro_batches': 2}
    with pytest.raises(ValueError, match=r'BatchNorm \(norm\).*split_batchnorm=True'):
        DeepSpeedRunner(**toy_config(str(tmp_path / 'a'), layout=layout, max_iters=1,
                                     val=False)).train()
    runner = DeepSpeedRunner(**toy_config(str(tmp_path / 'b'), max_iters=1, val=False,
                                          layout=dict(layout, split_batchnorm=True)))
    runner.train()
    assert runner.strategy.virtual_ranks.split == 2  # type: ignore[union-attr]


def test_a_split_made_finer_splits_each_micro_batch_in_the_fewest_parts() -> None:
    """After an out-of-memory error each micro-batch already collated splits again: into
    its size's smallest factor, so 8 goes 1 -> 2 -> 4 -> 8, 6 goes 1 -> 2 -> 6 (3 does not
    split the micro-batches of 3 that 2 made), and one sample goes nowhere."""
    assert [finer(8, k) for k in (1, 2, 4, 8)] == [2, 4, 8, None]
    assert [finer(6, k) for k in (1, 2, 3)] == [2, 6, 6]
    assert finer(9, 1) == 3 and finer(1, 1) is None
