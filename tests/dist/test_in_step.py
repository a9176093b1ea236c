"""Models that update weights in their own step, on 2 CPU ranks, against MMEngine's Runner.

``ToyTeacherModel`` (tests/toy_teacher.py) updates an EMA teacher of its encoder inside its
loss, as BYOL and MoCo v3 do; ``ToyMeanTeacherModel``'s teacher is updated by a hook, as
MMDetection's ``MeanTeacherHook`` does. Under ZeRO-3 both updates used to read and write
empty partitions. The reference is MMEngine's Runner with DDP on the same 2 ranks, batches
and seed. One torchrun launch runs every scenario (``worker.py``), a second the resumed
ones; code that computes on released parameters in a way the package does not know stops
the first iteration (``zero/released_guard.py``), each case its own launch.
"""
from __future__ import annotations

import json
import os.path as osp
import time
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios, run_torchrun

pytestmark = pytest.mark.dist

WORLD = 2
# no BatchNorm: DDP broadcasts rank 0's buffers every forward (docs/differences.md)
TEACHER = dict(model={'type': 'ToyTeacherModel', 'with_bn': False},
               optimizer={'type': 'AdamW', 'lr': 0.01},
               custom_hooks=[{'type': 'RecorderHook'}, {'type': 'GatherBetweenPhasesHook'}],
               checkpoint={'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False})
SCENARIOS = [
    {'name': 'plain', 'mode': 'plain', 'cfg': TEACHER},
    *({'name': f'z{stage}', 'cfg': dict(TEACHER, ds_config={'zero_optimization': {
        'stage': stage}})} for stage in (0, 2, 3)),
]
MEAN_TEACHER = dict(model={'type': 'ToyMeanTeacherModel'}, optimizer={'type': 'AdamW', 'lr': 0.01},
                    custom_hooks=[{'type': 'RecorderHook'}, {'type': 'MeanTeacherHook'}])
SCENARIOS += [
    {'name': 'mt_plain', 'mode': 'plain', 'cfg': MEAN_TEACHER},
    *({'name': f'mt_z{stage}', 'cfg': dict(MEAN_TEACHER, ds_config={'zero_optimization': {
        'stage': stage}})} for stage in (0, 2, 3)),
    # the same update under a name the package does not know, where parameters are whole
    {'name': 'mt_z2_unknown', 'cfg': dict(
        MEAN_TEACHER, custom_hooks=[{'type': 'RecorderHook'}, {'type': 'TeacherMomentumHook'}],
        ds_config={'zero_optimization': {'stage': 2}})},
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


def _assert_same_weights(ours: dict, plain: dict) -> None:
    assert ours['state'].keys() == plain['state'].keys()
    for key, value in plain['state'].items():
        assert torch.allclose(ours['state'][key], value, atol=1e-5, rtol=0), \
            (key, (ours['state'][key] - value).abs().max())


@pytest.mark.parametrize('name', ['mt_z0', 'mt_z2', 'mt_z3', 'mt_z2_unknown'])
def test_a_teacher_updated_by_a_mean_teacher_hook_trains_as_runner(out: str, name: str) -> None:
    """Issue 44: MMDetection's MeanTeacherHook pattern (the teacher copied from the student
    before training, then moved towards it every iteration, through ``.data``) gives
    Runner's teacher and student at every stage; at ZeRO-3 the hook's update runs on whole
    tensors (without that the copy did nothing: the teacher stayed at its 0.05 fill)."""
    for rank in range(WORLD):
        plain, ours = result(out, 'mt_plain', rank), result(out, name, rank)
        _assert_same_weights(ours, plain)
        assert ours['losses'] == pytest.approx(plain['losses'], abs=1e-5)
    teacher, student = plain['state']['teacher.fc1.weight'], plain['state']['student.fc1.weight']
    assert not torch.equal(teacher, student) and not torch.all(teacher == 0.05)


def _fails_in_first_iteration(tmp_path: Any, name: str, cfg: dict, where: str) -> str:
    """Run ``cfg`` at ZeRO-3 on 2 ranks with MMEngine's default 30-minute process-group
    timeout; it must stop within seconds with the guard's error naming ``where``."""
    cfg = dict(cfg, ds_config={'zero_optimization': {'stage': 3}},
               env_cfg={'dist_cfg': {'backend': 'gloo'}})
    start = time.monotonic()
    proc = run_torchrun(['tests/dist/worker.py', str(tmp_path), json.dumps(
        {'name': name, 'cfg': cfg})], timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - start < 90, proc.stdout[-4000:]
    assert where in proc.stdout and "where MMEngine's Runner updates the whole weight" in \
        proc.stdout and 'GatheredParameters' in proc.stdout, proc.stdout[-6000:]
    return proc.stdout


def test_an_unknown_hook_writing_released_weights_on_one_rank_stops_every_rank(
        tmp_path: Any) -> None:
    """A hook the package does not know writes the teacher through ``.data`` at ZeRO-3 on
    rank 1 only (a rank-dependent branch), while rank 0 goes on into the next iteration's
    collectives: rank 1 stops with the guard's error naming the hook's line and the
    parameter, and rank 0 ends with it, long before the 30-minute timeout. Without the
    guard the write did nothing, silently."""
    cfg = dict(MEAN_TEACHER, custom_hooks=[
        {'type': 'RecorderHook'}, {'type': 'TeacherMomentumHook', 'only_rank': 1}])
    stdout = _fails_in_first_iteration(tmp_path, 'unknown_hook', cfg, 'toy_teacher.py')
    assert "writes parameter 'teacher." in stdout and 'where ZeRO-3 has released it' in stdout
    assert '[rank 0] stopping: rank 1 failed' in stdout, stdout[-6000:]


def test_a_model_copying_a_released_weight_in_its_loss_stops_the_first_iteration(
        tmp_path: Any) -> None:
    """``self.shadow.weight.data.copy_(self.fc1.weight.data)`` in a loss at ZeRO-3: both
    are gathered on access inside the forward, and the write was silently dropped when
    ZeRO-3 released them (the shadow ended 1.0 away from fc1); it stops the first
    iteration, naming the model's line."""
    cfg = dict(TEACHER, model={'type': 'ToyInStepCopyModel', 'with_bn': False})
    stdout = _fails_in_first_iteration(tmp_path, 'in_step_copy', cfg,
                                       'self.shadow.weight.data.copy_(self.fc1.weight.data)')
    assert "writes parameter 'shadow.weight'" in stdout and 'holds it gathered' in stdout
