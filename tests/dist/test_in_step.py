"""Models that update weights in their own step, on 2 CPU ranks, against MMEngine's Runner.

``ToyTeacherModel`` (tests/toy_teacher.py) updates an EMA teacher of its encoder inside its
loss, as BYOL and MoCo v3 do; under ZeRO-3 the update used to read and write empty
partitions. The reference is MMEngine's Runner with DDP on the same 2 ranks, batches and
seed. One torchrun launch runs every scenario (``worker.py``), a second the resumed ones.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

WORLD = 2
# no BatchNorm: DDP broadcasts rank 0's buffers every forward (README, Differences)
TEACHER = dict(model={'type': 'ToyTeacherModel', 'with_bn': False},
               optimizer={'type': 'AdamW', 'lr': 0.01},
               custom_hooks=[{'type': 'RecorderHook'}, {'type': 'GatherBetweenPhasesHook'}],
               checkpoint={'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False})
SCENARIOS = [
    {'name': 'plain', 'mode': 'plain', 'cfg': TEACHER},
    *({'name': f'z{stage}', 'cfg': dict(TEACHER, ds_config={'zero_optimization': {
        'stage': stage}})} for stage in (0, 2, 3)),
]
RESUMED = [{'name': 'z3_resumed', 'cfg': dict(
    TEACHER, ds_config={'zero_optimization': {'stage': 3}}, resume=True,
    load_from='{out}/z3/iter_4.pth')}]


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp('in_step'))
    launch_scenarios('tests/dist/worker.py', path, SCENARIOS, WORLD)
    launch_scenarios('tests/dist/worker.py', path, RESUMED, WORLD)
    return path


def result(out: str, name: str, rank: int = 0) -> Any:
    return torch.load(osp.join(out, f'{name}.rank{rank}.pt'))


@pytest.mark.parametrize('stage', [0, 2, 3])
def test_a_teacher_updated_in_the_loss_trains_as_runner(out: str, stage: int) -> None:
    plain = result(out, 'plain')
    assert any(key.startswith('teacher.module.') for key in plain['state'])
    for rank in range(WORLD):
        ours = result(out, f'z{stage}', rank)
        assert ours['state'].keys() == plain['state'].keys()
        for key, value in plain['state'].items():
            assert torch.allclose(ours['state'][key], value, atol=1e-5, rtol=0), \
                (key, (ours['state'][key] - value).abs().max())
        assert ours['losses'] == pytest.approx(result(out, 'plain', rank)['losses'], abs=1e-5)
    # the teacher moved away from its starting copy and from the online encoder
    teacher, online = plain['state']['teacher.module.0.weight'], plain['state']['fc1.weight']
    assert not torch.equal(teacher, online)


def test_a_teacher_resumes_exactly_at_zero3(out: str) -> None:
    """The teacher is in the checkpoint: a resumed run ends where the straight one did."""
    for rank in range(WORLD):
        straight, resumed = result(out, 'z3', rank), result(out, 'z3_resumed', rank)
        assert resumed['losses'] == straight['losses'][4:]
        for key, value in straight['state'].items():
            assert torch.equal(resumed['state'][key], value), key


def test_hooks_after_a_phase_find_nothing_held_whole(out: str) -> None:
    """After validation and training, ZeRO-3 holds no parameter gathered, prefetched or in
    flight: a hook's GatheredParameters (an export) works and sees the trained weights."""
    for rank in range(WORLD):
        phases = result(out, 'z3', rank)['phases']
        assert [event for event, _, _ in phases] == ['after_val_epoch', 'after_train']
        assert all(held == 0 for _, held, _ in phases), phases
        # the gathered weights are the trained ones: their sum is ZeRO-0's
        assert phases[-1][2] == pytest.approx(result(out, 'z0', rank)['phases'][-1][2], abs=1e-4)
