"""A run cannot go bad silently: non-finite steps on one rank, at every ZeRO stage, 2 ranks.

One torchrun runs every scenario (``nonfinite_worker.py``); a toy model's loss is not
finite on rank 1 at its 5th iteration (NaN in its batch, or NaN or Inf added to its
loss alone), or a dataset holds a corrupt sample. Each policy of ``nonfinite`` is checked:
``skip`` (the update is skipped on every rank, counted, logged with iteration, rank,
loss key and dataset indices; the run stops after ``max_consecutive`` skips), ``stop``
(exit status 3 after a checkpoint of the last good state) and ``rollback`` (bit for bit
the run told from its start to leave the samples out; checkpoints remember them).
"""
from __future__ import annotations

import json
import math
import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

BAD_RANK1 = {'rank': 1, 'iters': [4]}
CHECKPOINT = {'type': 'CheckpointHook', 'interval': 2, 'by_epoch': False}
CORRUPT = {'samples': [9]}  # drawn by rank 0 at iteration 3 (seed 42), again every epoch
EXCLUDED = [1, 9, 17, 19]  # rank 0's batch at iteration 3


def zero(stage: int, bf16: bool = False) -> dict:
    return {'zero_optimization': {'stage': stage}, **({'bf16': {'enabled': True}} if bf16 else {})}


SKIPPED = [
    *({'name': f'fp32_z{s}', 'cfg': {'ds_config': zero(s)}, 'bad': BAD_RANK1} for s in range(4)),
    *({'name': f'bf16_z{s}', 'cfg': {'ds_config': zero(s, bf16=True)},
       'bad': dict(BAD_RANK1, value='inf', how='loss')} for s in (0, 3)),
    *({'name': f'loss_z{s}', 'cfg': {'ds_config': zero(s)}, 'bad': dict(BAD_RANK1, how='loss')}
      for s in (0, 2)),
    {'name': 'fused_z0', 'cfg': {'ds_config': zero(0), 'optimizer': {
        'type': 'SGD', 'lr': 0.1, 'momentum': 0.9, 'fused': True}}, 'bad': BAD_RANK1},
]
SCENARIOS: list[dict[str, Any]] = [
    *SKIPPED,
    {'name': 'clean_z0', 'cfg': {'ds_config': zero(0)}},
    *({'name': f'gan_z{s}', 'model': 'gan', 'cfg': {'ds_config': zero(s)}, 'bad': {
        'samples': [5]}} for s in (0, 3)),
    {'name': 'stop_z0', 'cfg': {'ds_config': zero(0), 'checkpoint': CHECKPOINT,
                                'nonfinite': {'policy': 'stop'}}, 'bad': BAD_RANK1},
    # LoggerHook's interval 10, steps of 0.5 s: the agreements come every 2 iterations
    {'name': 'stop_soon_z2', 'cfg': {
        'ds_config': zero(2), 'nonfinite': {'policy': 'stop'},
        'default_hooks': {'logger': {'type': 'LoggerHook', 'interval': 10}}},
     'bad': dict(BAD_RANK1, sleep=0.5)},
    {'name': 'every_z3', 'cfg': {'ds_config': zero(3), 'nonfinite': {'max_consecutive': 3}},
     'bad': {'rank': 0, 'iters': list(range(100))}},
    {'name': 'rollback_z2', 'bad': CORRUPT, 'cfg': {
        'ds_config': zero(2), 'dataset_type': 'CorruptToyDataset', 'checkpoint': CHECKPOINT,
        'nonfinite': {'policy': 'rollback', 'max_consecutive': 1}}},
    {'name': 'excluded_z2', 'bad': CORRUPT, 'cfg': {
        'ds_config': zero(2), 'dataset_type': 'CorruptToyDataset', 'exclude_samples': EXCLUDED}},
    # the epoch loop, ZeRO-3: the rollback restarts the restored epoch inside run_epoch
    {'name': 'rollback_epochs_z3', 'bad': CORRUPT, 'cfg': {
        'ds_config': zero(3), 'dataset_type': 'CorruptToyDataset', 'checkpoint': CHECKPOINT,
        'by_epoch': True, 'max_epochs': 4, 'nonfinite': {'policy': 'rollback',
                                                         'max_consecutive': 1}}},
    {'name': 'excluded_epochs_z3', 'bad': CORRUPT, 'cfg': {
        'ds_config': zero(3), 'dataset_type': 'CorruptToyDataset', 'by_epoch': True,
        'max_epochs': 4, 'exclude_samples': EXCLUDED}},
    # resumed from the rollback's checkpoint after it: keeps leaving the samples out
    {'name': 'resumed_z2', 'bad': CORRUPT, 'cfg': {
        'ds_config': zero(2), 'dataset_type': 'CorruptToyDataset', 'resume': True,
        'load_from': '{out}/rollback_z2/iter_8.pth'}},
]


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict]]]:
    out = str(tmp_path_factory.mktemp('nonfinite'))
    launch_scenarios('tests/dist/nonfinite_worker.py', out, SCENARIOS, 2)
    return out, {s['name']: [torch.load(osp.join(out, f'{s["name"]}.rank{r}.pt'),
                                        weights_only=False) for r in range(2)]
                 for s in SCENARIOS}


def _finite(result: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in result['state'].values())


@pytest.mark.parametrize('name', [s['name'] for s in SKIPPED])
def test_a_step_not_finite_on_one_rank_is_skipped_everywhere_and_said(runs: Any,
                                                                      name: str) -> None:
    out, results = runs
    for rank in range(2):
        assert _finite(results[name][rank]) and results[name][rank].get('exit') is None
        assert results[name][rank]['skipped'][-1] == 1.0  # counted, at every precision
        if name != 'fused_z0':  # skipped on the host: its norm stays out of the log's means
            assert all(math.isfinite(v) for v in results[name][rank]['grad_norms'])
    assert all(torch.equal(results[name][0]['state'][k], results[name][1]['state'][k])
               for k in results[name][0]['state'])
    log = results[name][0]['log']
    value = 'inf' if name.startswith('bf16') else 'nan'
    assert f'iteration 5 (update skipped): rank 1: loss={value}. Dataset indices' in log, log
    with open(osp.join(out, name, 'nonfinite_steps.jsonl')) as f:
        (step,) = [json.loads(line) for line in f]
    assert step['iteration'] == 5 and step['losses'] == {'1': {'train/loss': value}}
    assert [len(step['batches'][r]) for r in '01'] == [4, 4]  # each rank's batch of 4


def test_the_skip_leaves_what_a_clean_run_would_have_after_that_step_skipped(runs: Any) -> None:
    """ZeRO 0-3 (the checks of this package and DeepSpeed's) skip the same step: the same
    parameters at every stage; and different from a run without the bad step."""
    _, results = runs
    reference = results['fp32_z0'][0]['state']
    for name in ('fp32_z1', 'fp32_z2', 'fp32_z3', 'loss_z0', 'loss_z2'):
        state = results[name][0]['state']
        assert max(float((state[k] - reference[k]).abs().max()) for k in state) < 1e-5, name
    clean = results['clean_z0'][0]['state']
    assert any(not torch.equal(clean[k], reference[k]) for k in clean)


def test_stop_ends_every_rank_with_a_checkpoint_of_the_last_good_state(runs: Any) -> None:
    out, results = runs
    assert [results['stop_z0'][r]['exit'] for r in range(2)] == [3, 3]
    assert len(results['stop_z0'][0]['losses']) == 5  # stopped after the failed iteration
    saved = osp.join(out, 'stop_z0', 'iter_5.pth')
    assert osp.isfile(osp.join(saved, 'COMPLETE'))
    with open(osp.join(out, 'stop_z0', 'last_checkpoint')) as f:
        assert f.read().strip() == saved
    assert _finite(results['stop_z0'][0])
    assert 'Stopping every rank after iteration 5: nonfinite.policy="stop"' in \
        results['stop_z0'][0]['log']


def test_a_stop_comes_at_the_next_agreement_not_the_next_logging_iteration(runs: Any) -> None:
    """DeepSpeed's skip is known on the host at once; the agreements about every 2 s of
    training (every 2nd iteration here) act on it: stopped after iteration 6, not 10, and
    the log still names the rank and its loss (the hub was read for it)."""
    out, results = runs
    assert [results['stop_soon_z2'][r]['exit'] for r in range(2)] == [3, 3]
    assert len(results['stop_soon_z2'][0]['losses']) == 6
    assert 'iteration 5 (update skipped): rank 1: loss=nan' in results['stop_soon_z2'][0]['log']
    assert osp.isfile(osp.join(out, 'stop_soon_z2', 'iter_6.pth', 'COMPLETE'))


def test_a_run_whose_every_step_fails_stops_under_skip(runs: Any) -> None:
    _, results = runs
    assert [results['every_z3'][r]['exit'] for r in range(2)] == [3, 3]
    assert len(results['every_z3'][0]['losses']) == 3
    assert '3 consecutive updates skipped (max_consecutive=3)' in results['every_z3'][0]['log']


@pytest.mark.parametrize('loop', ['z2', 'epochs_z3'])
def test_rollback_equals_the_run_told_to_leave_the_samples_out(runs: Any, loop: str) -> None:
    out, results = runs
    rolled, excluded = results[f'rollback_{loop}'], results[f'excluded_{loop}']
    log = rolled[0]['log']
    assert 'rank 0: loss=nan' in log and 'rolling back to' in log and 'iter_2.pth' in log
    for rank in range(2):
        assert rolled[rank].get('exit') is None and rolled[rank]['excluded'] == EXCLUDED
        for key, value in rolled[rank]['state'].items():
            assert torch.equal(value, excluded[rank]['state'][key]), key
    # rank 0's losses (a checkpoint holds rank 0's message hub, as MMEngine's does)
    assert rolled[0]['losses'] == excluded[0]['losses']
    with open(osp.join(out, f'rollback_{loop}', 'excluded_samples.json')) as f:
        assert json.load(f) == EXCLUDED


def test_a_resumed_run_keeps_leaving_the_samples_out(runs: Any) -> None:
    """The checkpoint after the rollback remembers the samples: resumed from it, the run
    ends where the rollback run ended (the corrupt sample comes back every epoch)."""
    _, results = runs
    for rank in range(2):
        resumed = results['resumed_z2'][rank]
        assert resumed['excluded'] == EXCLUDED and resumed['skipped'][-1] == 0.0
        for key, value in resumed['state'].items():
            assert torch.equal(value, results['rollback_z2'][rank]['state'][key]), key


@pytest.mark.parametrize('name', ['gan_z0', 'gan_z3'])
def test_several_optimizers_skip_only_the_one_whose_step_failed(runs: Any, name: str) -> None:
    """A corrupt real image makes the discriminator's loss NaN: its update is skipped (once
    per epoch the image comes back), the generator's are not; the log names loss_d."""
    out, results = runs
    for rank in range(2):
        result = results[name][rank]
        assert _finite(result) and result.get('exit') is None
        skipped_d = result['skipped_by']['discriminator'][-1]
        assert skipped_d >= 1 and result['skipped_by']['generator'][-1] == 0.0
    with open(osp.join(out, name, 'nonfinite_steps.jsonl')) as f:
        steps = [json.loads(line) for line in f]
    assert len(steps) == skipped_d
    assert all('train/loss_d' in next(iter(step['losses'].values())) for step in steps)
    assert all(any(5 in batch for batch in step['batches'].values()) for step in steps)
