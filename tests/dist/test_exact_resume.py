"""Resume is bit-exact for models and pipelines that draw random numbers.

The model draws dropout masks and ``torch.randn`` noise in training and noise in
``predict`` (validated during training, right after checkpoints); the dataset adds
torch, numpy and python noise to every sample, in DataLoader workers when there are any.
An uninterrupted run saves every 2 iterations; runs resumed from a checkpoint inside an
epoch and from one at an epoch boundary must end with the same weights, bit for bit, and
log the same losses. Three launches: the iteration-based loop at ZeRO-2 with 2 workers per
rank, the epoch-based loop at ZeRO-3 without workers (4 iterations an epoch), and the
epoch-based loop at ZeRO-2 with 2 persistent workers per rank.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

EVERY_2 = {'type': 'CheckpointHook', 'interval': 2, 'by_epoch': False}


def scenarios(base: dict, resume_points: tuple[int, ...]) -> list[dict]:
    runs = [{'name': 'straight', 'cfg': base}]
    for point in resume_points:
        runs.append({'name': f'from{point}', 'cfg': dict(
            base, resume=True, load_from=f'{{out}}/straight/iter_{point}.pth')})
    return runs


ITER_BASED = dict(ds_config={'zero_optimization': {'stage': 2}}, max_iters=12,
                  model={'type': 'ToyRandomModel'}, dataset_type='ToyRandomDataset',
                  num_workers=2, checkpoint=EVERY_2, val_interval=4, log_level='INFO')
EPOCH_BASED = dict(ds_config={'zero_optimization': {'stage': 3}}, by_epoch=True, max_epochs=3,
                   model={'type': 'ToyRandomModel'}, dataset_type='ToyRandomDataset',
                   checkpoint=EVERY_2, log_level='INFO')
# Workers that live across epochs, whose RNG would carry over from epoch to epoch.
PERSISTENT = dict(EPOCH_BASED, ds_config={'zero_optimization': {'stage': 2}}, num_workers=2,
                  persistent_workers=True)
# (loop, resume points): 6 is inside the second epoch, 8 ends it.
CASES = {'iter': (ITER_BASED, (6, 8)), 'epoch': (EPOCH_BASED, (6, 8)),
         'epoch_persistent_workers': (PERSISTENT, (6,))}


@pytest.fixture(scope='module', params=sorted(CASES))
def runs(request: Any, tmp_path_factory: Any) -> tuple[str, dict[str, list[dict]]]:
    base, points = CASES[request.param]
    out = str(tmp_path_factory.mktemp(f'exact_{request.param}'))
    stdout = launch_scenarios('tests/dist/worker.py', out, scenarios(base, points), nproc=2)
    results = {name: [torch.load(osp.join(out, f'{name}.rank{r}.pt')) for r in range(2)]
               for name in ['straight', *(f'from{p}' for p in points)]}
    return stdout, results


def test_resumed_runs_equal_the_straight_run_bit_for_bit(runs: Any) -> None:
    _, results = runs
    straight = results['straight']
    for name, resumed in results.items():
        if name == 'straight':
            continue
        point = int(name[len('from'):])
        for rank in range(2):
            assert resumed[rank]['losses'] == straight[rank]['losses'][point:], (name, rank)
            for key, value in straight[rank]['state'].items():
                assert torch.equal(value, resumed[rank]['state'][key]), (name, rank, key)
            assert resumed[rank]['metrics'] == straight[rank]['metrics'][-len(
                resumed[rank]['metrics']):], (name, rank)


def test_randomness_is_really_drawn(runs: Any) -> None:
    """The ranks see different noise, and dropout is on: the equality above is not trivial."""
    _, results = runs
    straight = results['straight']
    assert straight[0]['losses'] != straight[1]['losses']
    assert len(set(straight[0]['losses'])) == len(straight[0]['losses'])


def test_resume_skips_at_the_sampler(runs: Any) -> None:
    stdout, _ = runs
    assert 'already trained on, at the sampler: nothing is loaded for them.' in stdout
