"""LARS and LAMB on 2 CPU ranks at every ZeRO stage against ZeRO-0.

ZeRO-1/2/3 hand an optimizer flat partitions mixing slices of several parameters, where
LARS's and LAMB's per-parameter norms are something else; DeepSpeedRunner steps them per
parameter (engine/norm_optimizers.py). ``RefLARS`` / ``RefLamb`` (tests/norm_reference.py)
compute MMPretrain's math; at ZeRO-0 in fp32 their own step runs on whole parameters, the
reference (what DDP computes). One torchrun launch runs every scenario, a second the resumed.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

WORLD = 2
# One param group per parameter (paramwise_cfg), as MMPretrain's LARS configs make: biases
# without decay or LARS scaling. Width 33 splits layers across the two ranks' partitions.
PARAMWISE = {'custom_keys': {'bias': {'decay_mult': 0, 'lars_exclude': True}}}
COMMON = dict(model={'type': 'ToyModel', 'with_bn': False, 'hidden': 33}, val=False,
              paramwise_cfg=PARAMWISE,
              checkpoint={'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False})
LARS = dict(COMMON, optimizer={'type': 'RefLARS', 'lr': 0.5, 'momentum': 0.9,
                               'weight_decay': 1e-4, 'eta': 0.02})
# clipping: DeepSpeed clips before LAMB's own clip by the global norm reads the gradients
LAMB = dict(COMMON, optimizer={'type': 'RefLamb', 'lr': 0.01, 'weight_decay': 0.02},
            clip_grad={'max_norm': 0.05})


def zero(stage: int, **extra: Any) -> dict:
    return {'zero_optimization': {'stage': stage}, **extra}


SCENARIOS = [
    *({'name': f'lars_z{s}', 'cfg': dict(LARS, ds_config=zero(s))} for s in range(4)),
    *({'name': f'lamb_z{s}', 'cfg': dict(LAMB, ds_config=zero(s))} for s in range(4)),
    {'name': 'unknown_z2', 'cfg': dict(LARS, optimizer=dict(LARS['optimizer'], type='UnknownLARS'),
                                       ds_config=zero(2, zero_allow_untested_optimizer=True))},
]
RESUMED = [{'name': f'{kind}_z{s}_resumed', 'cfg': dict(
    cfg, ds_config=zero(s), resume=True, load_from=f'{{out}}/{kind}_z{s}/iter_4.pth')}
    for kind, cfg in (('lars', LARS), ('lamb', LAMB)) for s in (2, 3)]


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp('norm_optimizers'))
    with open(osp.join(path, 'first.log'), 'w') as f:
        f.write(launch_scenarios('tests/dist/worker.py', path, SCENARIOS, WORLD))
    launch_scenarios('tests/dist/worker.py', path, RESUMED, WORLD)
    return path


def result(out: str, name: str, rank: int = 0) -> Any:
    return torch.load(osp.join(out, f'{name}.rank{rank}.pt'))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize('kind', ['lars', 'lamb'])
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_norm_optimizers_give_zero0s_numbers(out: str, kind: str, stage: int) -> None:
    reference = result(out, f'{kind}_z0')
    for rank in range(WORLD):
        ours = result(out, f'{kind}_z{stage}', rank)
        assert max_diff(ours['state'], reference['state']) < 1e-5
        assert ours['losses'] == pytest.approx(result(out, f'{kind}_z0', rank)['losses'],
                                               abs=1e-5)
    assert max_diff(reference['state'], result(out, 'lars_z0' if kind == 'lamb' else 'lamb_z0')
                    ['state']) > 1e-3  # the two optimizers really differ


def test_on_flat_partitions_lars_is_something_else(out: str) -> None:
    """What DeepSpeed alone computes (an optimizer it is told to step): norms of slices
    of several parameters; the log says what ZeRO does to such optimizers."""
    assert max_diff(result(out, 'unknown_z2')['state'], result(out, 'lars_z0')['state']) > 1e-4
    with open(osp.join(out, 'first.log')) as f:
        log = f.read()
    assert log.count('ZeRO steps UnknownLARS on this rank\'s flat partition') == 1, log[-3000:]


@pytest.mark.parametrize('kind', ['lars', 'lamb'])
@pytest.mark.parametrize('stage', [2, 3])
def test_norm_optimizers_resume_exactly(out: str, kind: str, stage: int) -> None:
    """Momentum, moments and LAMB's step count are in the checkpoint."""
    for rank in range(WORLD):
        straight = result(out, f'{kind}_z{stage}', rank)
        resumed = result(out, f'{kind}_z{stage}_resumed', rank)
        assert resumed['losses'] == straight['losses'][4:]
        for key, value in straight['state'].items():
            assert torch.equal(resumed['state'][key], value), key
