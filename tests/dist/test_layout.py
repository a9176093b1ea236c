"""``layout=dict(world_size=N)``: a run on fewer ranks gives the N-rank run's parameters.

The same configs on 2 real ranks and, with ``layout=dict(world_size=2)``, on 1; on 4 real
ranks and, with ``layout=dict(world_size=4)``, on 2 (a tiny model: 4 CPU processes). A
deterministic model, a model drawing dropout and noise in its step (each virtual rank its
own streams), a BatchNorm model (each virtual rank its own batch statistics and running
buffers), random transforms in DataLoader workers (each sample seeded as its virtual
rank's), the epoch-based loop validating after each epoch, ``exclude_samples`` (left out of
each virtual rank's own pass), ZeRO-0 and ZeRO-2; each virtual rank's batch split in two
micro-batches (fixed, and ``'auto'`` agreed across ranks); a layout
run resumed on as many ranks (bit for bit), on fewer and on more. Every parameter and
buffer of rank 0 within 1e-5, and rank 0's logged losses, of the real and the virtual
layout.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

MODELS = {
    'plain': dict(model={'type': 'ToyModel', 'with_bn': False}),
    'dropout': dict(model={'type': 'ToyRandomModel', 'with_bn': False},
                    ds_config={'zero_optimization': {'stage': 2}}),
    # SGD: the bias before BatchNorm has a zero gradient up to rounding, which Adam's
    # normalised step would blow up to the learning rate (any change of summation order)
    'batchnorm': dict(model={'type': 'ToyModel', 'with_bn': True}, accumulative_counts=2,
                      optimizer={'type': 'SGD', 'lr': 0.1, 'momentum': 0.9}),
    'workers': dict(model={'type': 'ToyRandomModel', 'with_bn': False},
                    dataset_type='ToyRandomDataset', num_workers=2),
    # validated after each epoch: every rank of the N-rank run creates its validation
    # loader's iterator (a draw of each virtual rank's streams)
    'epochs': dict(model={'type': 'ToyDropoutModel', 'with_bn': True}, by_epoch=True,
                   max_epochs=2, optimizer={'type': 'SGD', 'lr': 0.1, 'momentum': 0.9}),
    # each virtual rank leaves them out of its own pass (an excluded index replaced by the
    # one before it in that rank's pass), as each rank of the N-rank run does
    'excluded': dict(model={'type': 'ToyModel', 'with_bn': False},
                     exclude_samples=[0, 1, 2, 3, 5, 8, 13, 21]),
}
# A layout run resumed on as many ranks: from inside the first and the second epoch (3
# iterations an epoch at N=4), bit for bit.
EVERY_2 = {'type': 'CheckpointHook', 'interval': 2, 'by_epoch': False}
RESUMED = dict(MODELS['workers'], checkpoint=EVERY_2, optimizer={'type': 'AdamW', 'lr': 0.01})
POINTS = (2, 4)
BASE = dict(max_iters=6, batch_size=2, dataset_size=24)
ADAMW = {'type': 'AdamW', 'lr': 0.01}
OUT_OF_MEMORY = ('oom_forward', 'oom_backward')


def _zero(stage: int) -> dict:
    return {'zero_optimization': {'stage': stage}}


def _scenarios(layout: int | None) -> list[dict]:
    extra = {} if layout is None else {'layout': {'world_size': layout}}
    runs = [{'name': name, 'cfg': dict(BASE, **{'optimizer': ADAMW, **cfg}, **extra)}
            for name, cfg in MODELS.items()]
    if layout is not None:  # each virtual rank's batch of 2 in micro-batches of 1
        split = dict(BASE, optimizer=ADAMW, **MODELS['plain'])
        runs.append({'name': 'split', 'cfg': dict(split, layout={
            'world_size': layout, 'micro_batches': 2})})
    if layout == 4:
        # 'auto' where rank 1's prediction needs micro-batches of 1 (a test double), rank
        # 0's the whole batch: the ranks agree on 2
        runs.append({'name': 'agreed', 'prediction_on_rank1': 'oversized', 'cfg': dict(
            split, layout={'world_size': layout, 'micro_batches': 'auto'})})
        # 'auto' predicts that the whole batch of 2 fits; rank 1 runs out of memory (a test
        # double): in its first forward, and at ZeRO-1 in the second iteration's last
        # backward (the first virtual rank's gradients accumulated). ZeRO-2 cannot retry.
        auto = {'world_size': layout, 'micro_batches': 'auto'}
        runs += [
            {'name': 'oom_forward', 'cfg': dict(split, layout=auto),
             'out_of_memory_on_rank1': {'at': [1], 'in': 'forward'}},
            {'name': 'oom_backward', 'cfg': dict(split, layout=auto, ds_config=_zero(1)),
             'out_of_memory_on_rank1': {'at': [4], 'in': 'backward'}},
            {'name': 'auto_zero2', 'cfg': dict(split, layout=auto, ds_config=_zero(2))}]
        runs.append({'name': 'straight', 'cfg': dict(BASE, **RESUMED, **extra)})
        runs += [{'name': f'from{point}', 'cfg': dict(
            BASE, **RESUMED, **extra, resume=True,
            load_from=f'{{out}}/straight/iter_{point}.pth')} for point in POINTS]
    return runs


@pytest.fixture(scope='module')
def runs(tmp_path_factory: Any) -> dict[tuple[int, str], dict[str, Any]]:
    """(layout world size, 'real' | 'virtual') -> rank 0's results by model."""
    results = {}
    for world_size, nproc, layout, kind in ((2, 2, None, 'real'), (2, 1, 2, 'virtual'),
                                            (4, 4, None, 'real'), (4, 2, 4, 'virtual')):
        out = str(tmp_path_factory.mktemp(f'layout_{world_size}_{kind}'))
        scenarios = _scenarios(layout)
        launch_scenarios('tests/dist/worker.py', out, scenarios, nproc=nproc)
        results[(world_size, kind)] = {
            s['name']: torch.load(osp.join(out, f'{s["name"]}.rank0.pt')) for s in scenarios}
        if layout == 4:
            for name in ('agreed', *OUT_OF_MEMORY):
                results[(world_size, kind)][f'{name}_rank1'] = torch.load(
                    osp.join(out, f'{name}.rank1.pt'))
        if layout == 4:  # the same run resumed on 1 and on 4 ranks
            checkpoint = osp.join(out, 'straight', f'iter_{POINTS[-1]}.pth')
            for other in (1, 4):
                again = str(tmp_path_factory.mktemp(f'layout_4_on_{other}'))
                launch_scenarios('tests/dist/worker.py', again, [{
                    'name': 'resumed', 'cfg': dict(BASE, **RESUMED, layout={'world_size': 4},
                                                   resume=True, load_from=checkpoint)}],
                    nproc=other)
                results[(world_size, kind)][f'on{other}'] = torch.load(
                    osp.join(again, 'resumed.rank0.pt'))
    return results


@pytest.mark.parametrize('world_size', [2, 4])
@pytest.mark.parametrize('model', sorted(MODELS))
def test_a_layout_on_fewer_ranks_gives_the_n_rank_runs_numbers(runs: Any, world_size: int,
                                                                model: str) -> None:
    real, virtual = runs[(world_size, 'real')][model], runs[(world_size, 'virtual')][model]
    diffs = {k: (virtual['state'][k] - v).abs().max().item() for k, v in real['state'].items()}
    assert max(diffs.values()) <= 1e-5, diffs
    assert virtual['losses'] == pytest.approx(real['losses'], abs=1e-5)
    assert virtual['lrs'] == pytest.approx(real['lrs'])
    assert virtual['world_size'] == world_size // 2 \
        and real['world_size'] == world_size


def test_a_layout_run_resumes_bit_for_bit(runs: Any) -> None:
    """Each virtual rank's streams and buffers, and the data position of its pass, come
    back: the resumed runs end with the uninterrupted run's weights and losses."""
    results = runs[(4, 'virtual')]
    straight = results['straight']
    for point in POINTS:
        resumed = results[f'from{point}']
        for key, value in straight['state'].items():
            assert torch.equal(resumed['state'][key], value), (point, key)
        assert resumed['losses'] == straight['losses'][point:], point


@pytest.mark.parametrize('ranks', [1, 4])
def test_a_layout_run_resumed_on_another_number_of_ranks_continues_the_same_run(
        runs: Any, ranks: int) -> None:
    """Saved on 2 ranks (2 virtual ranks each), resumed on 1 (4 each) and on 4 (1 each):
    every virtual rank's streams, buffers and data position come from the file that held
    it; the end is the uninterrupted run's within fp32 summation order."""
    results = runs[(4, 'virtual')]
    straight, resumed = results['straight'], results[f'on{ranks}']
    diffs = {k: (resumed['state'][k] - v).abs().max().item()
             for k, v in straight['state'].items()}
    assert max(diffs.values()) <= 1e-5, diffs
    assert resumed['losses'] == pytest.approx(straight['losses'][POINTS[-1]:], abs=1e-5)


@pytest.mark.parametrize('world_size', [2, 4])
def test_a_split_batch_gives_the_n_rank_runs_numbers(runs: Any, world_size: int) -> None:
    """``layout.micro_batches=2``: each virtual rank's batch of 2 in two micro-steps of 1,
    every rank accumulating 2 x its virtual ranks' micro-batches into one step; the N-rank
    run's parameters (fp32 summation order) and its logged losses (each the mean over
    the batch's micro-batches)."""
    real = runs[(world_size, 'real')]['plain']
    split = runs[(world_size, 'virtual')]['split']
    diffs = {k: (split['state'][k] - v).abs().max().item() for k, v in real['state'].items()}
    assert max(diffs.values()) <= 1e-5, diffs
    assert split['losses'] == pytest.approx(real['losses'], abs=1e-5)
    assert split['split'] == 2 and split['accumulation'] == 4  # 2 virtual ranks x 2


def test_auto_micro_batches_are_agreed_across_ranks(runs: Any) -> None:
    """``micro_batches='auto'`` on 2 ranks where only rank 1's prediction (a test double)
    says the batch of 2 does not fit: both ranks split it in 2 (the largest need), rank 0
    included, and the run still gives the 4-rank run's parameters."""
    real, agreed = runs[(4, 'real')]['plain'], runs[(4, 'virtual')]['agreed']
    assert agreed['split'] == 2 and agreed['accumulation'] == 4
    assert runs[(4, 'virtual')]['agreed_rank1']['split'] == 2
    diffs = {k: (agreed['state'][k] - v).abs().max().item() for k, v in real['state'].items()}
    assert max(diffs.values()) <= 1e-5, diffs


def test_an_out_of_memory_error_on_one_rank_is_retried_by_every_rank(runs: Any) -> None:
    """``micro_batches='auto'`` predicts that the batch of 2 fits; rank 1 alone runs out of
    memory (a test double of CUDA's ``torch.OutOfMemoryError``: the CPU raises none, the
    OS ends the process). Every rank drops the iteration, splits each batch in 2 and runs
    it again, with no hang. Out of memory in the first forward: the numbers of
    ``micro_batches=2`` from the start, bit for bit. At ZeRO-1, in the second iteration's
    last backward (the first virtual rank's gradients already accumulated, the reduction
    held): the 4-rank run's numbers, and the ZeRO optimizer's interrupted backward left
    (``_backward_active_depth``, compat.end_interrupted_backward)."""
    virtual = runs[(4, 'virtual')]
    for name in OUT_OF_MEMORY:
        for result in (virtual[name], virtual[f'{name}_rank1']):
            assert (result['split'], result['micro_batch'], result['accumulation']) == \
                (2, 1, 4) and result['retries'], name
        assert virtual[f'{name}_rank1']['out_of_memory_raised'] == 1, name
    fixed, retried = virtual['split'], virtual['oom_forward']
    assert all(torch.equal(retried['state'][k], v) for k, v in fixed['state'].items())
    assert retried['losses'] == fixed['losses']
    real, late = runs[(4, 'real')]['plain'], virtual['oom_backward']
    diffs = {k: (late['state'][k] - v).abs().max().item() for k, v in real['state'].items()}
    assert max(diffs.values()) <= 1e-5, diffs
    assert late['losses'] == pytest.approx(real['losses'], abs=1e-5)
    assert late['stage'] == 1 and virtual['oom_backward_rank1']['backward_depth'] == 0
    # ZeRO-2 reduces inside each backward: no retry, the predicted split kept
    assert not virtual['auto_zero2']['retries'] and virtual['auto_zero2']['split'] == 1
