"""Real OpenMMLab model shapes on 2 CPU ranks: 0-dim parameters, parameters some ranks skip.

One torchrun launch runs every scenario (see ``worker.py``); the reference for
parity is MMEngine's own Runner with DDP (``find_unused_parameters=True``) on
the same 2 ranks, batches and seed.
"""
from __future__ import annotations

import glob
import json
import os.path as osp
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from mmengine.runner import load_checkpoint

from mmengine_deepspeed.checkpoint.export import consolidated_state_dict
from tests.helpers import ToyScalarModel, free_port, launch_scenarios, run_command, run_torchrun

pytestmark = pytest.mark.dist

WORLD = 2
FIND_UNUSED = {'type': 'MMDistributedDataParallel', 'find_unused_parameters': True}
EVERY_4 = {'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False}
EMA = {'type': 'EMAHook', 'momentum': 0.2}
ADAMW = {'type': 'AdamW', 'lr': 0.01}
SGD = {'type': 'SGD', 'lr': 0.1}  # no momentum: a globally unused head stays put, as in DDP


def zero(stage: int, **extra: Any) -> dict:
    return {'zero_optimization': {'stage': stage}, **extra}


BRANCH = dict(model={'type': 'ToyBranchModel', 'with_bn': False}, optimizer=SGD, val=False)
LOSS_MODULE = dict(model={'type': 'ToyLossModuleModel', 'with_bn': False}, optimizer=SGD,
                   val=False)
SCALAR = dict(model={'type': 'ToyScalarModel', 'with_bn': False}, optimizer=ADAMW, val=False,
              clip_grad={'max_norm': 0.5})
# by-epoch cosine whose end MMEngine defaults from max_epochs
SCHED = dict(ds_config=zero(2), by_epoch=True, max_epochs=2, val=False,
             param_scheduler=[{'type': 'CosineAnnealingLR', 'by_epoch': True, 'eta_min': 0.01}],
             checkpoint={'type': 'CheckpointHook', 'interval': 1})
SCENARIOS: list[dict[str, Any]] = [
    {'name': 'branch_plain', 'mode': 'plain', 'cfg': BRANCH},
    *({'name': f'branch_z{s}', 'cfg': dict(BRANCH, ds_config=zero(s),
                                           model_wrapper_cfg=FIND_UNUSED)} for s in range(3)),
    {'name': 'branch_plain_accum2', 'mode': 'plain', 'cfg': dict(BRANCH, accumulative_counts=2)},
    {'name': 'branch_z2_accum2', 'cfg': dict(BRANCH, ds_config=zero(2), accumulative_counts=2,
                                             model_wrapper_cfg=FIND_UNUSED)},
    {'name': 'scalar_plain', 'mode': 'plain', 'cfg': SCALAR},
    {'name': 'scalar_z0', 'cfg': dict(SCALAR, ds_config=zero(0))},
    {'name': 'scalar_z1', 'cfg': dict(SCALAR, ds_config=zero(1))},
    {'name': 'scalar_z2', 'cfg': dict(SCALAR, ds_config=zero(2), checkpoint=EVERY_4)},
    {'name': 'scalar_z3', 'cfg': dict(SCALAR, ds_config=zero(3), checkpoint=EVERY_4,
                                      custom_hooks=[EMA, {'type': 'RecorderHook'}])},
    {'name': 'sched', 'cfg': SCHED},
    # OpenMMLab configs often set the switch by default: under ZeRO-3 a warning, then checks
    {'name': 'unused_z3', 'cfg': dict(ds_config=zero(3), val=False, with_bn=False,
                                      model_wrapper_cfg=FIND_UNUSED)},
    {'name': 'scalar_z2_bf16', 'cfg': dict(SCALAR, ds_config=zero(2, bf16={'enabled': True}))},
    {'name': 'loss_module_plain', 'mode': 'plain', 'cfg': LOSS_MODULE},
    {'name': 'loss_module_z3', 'cfg': dict(LOSS_MODULE, ds_config=zero(3))},
    # built and run with values the meta device lacks: the log's prediction is measured
    {'name': 'values_z3', 'cfg': dict(LOSS_MODULE, ds_config=zero(3), log_level='INFO',
                                      model={'type': 'ToyValuesModel', 'with_bn': False})},
]
RESUMED = [
    {'name': 'sched_longer', 'cfg': dict(SCHED, max_epochs=4, resume=True,
                                         load_from='{out}/sched/epoch_2.pth')},
    {'name': 'scalar_z2_resumed', 'cfg': dict(SCALAR, ds_config=zero(2), checkpoint=EVERY_4,
                                              resume=True, load_from='{out}/scalar_z2/iter_4.pth')},
    {'name': 'scalar_z3_resumed', 'cfg': dict(
        SCALAR, ds_config=zero(3), checkpoint=EVERY_4, resume=True,
        load_from='{out}/scalar_z3/iter_4.pth', custom_hooks=[EMA, {'type': 'RecorderHook'}])},
    # an evaluation engine (no optimizer) loading the trained weights under ZeRO-3
    {'name': 'scalar_z3_test', 'mode': 'test', 'cfg': dict(
        SCALAR, val=True, ds_config=zero(3), load_from='{out}/scalar_z3/iter_8.pth')},
]


def _launch(out: str, scenarios: list[dict], nproc: int = WORLD) -> str:
    return launch_scenarios('tests/dist/worker.py', out, scenarios, nproc)


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp('patterns'))
    with open(osp.join(path, 'first.log'), 'w') as f:
        f.write(_launch(path, SCENARIOS))
    with open(osp.join(path, 'resumed.log'), 'w') as f:
        f.write(_launch(path, RESUMED))
    return path


def result(out: str, name: str, rank: int = 0) -> dict:
    return torch.load(osp.join(out, f'{name}.rank{rank}.pt'))


def assert_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert value.shape == actual[key].shape, key
        assert torch.allclose(actual[key], value, atol=atol, rtol=0), \
            (key, (actual[key] - value).abs().max())


@pytest.mark.parametrize('stage', [0, 1, 2])
def test_ranks_that_skip_a_head_train_as_ddp_with_find_unused_parameters(out: str,
                                                                         stage: int) -> None:
    plain = result(out, 'branch_plain')
    used = [result(out, 'branch_plain', r)['head_used'] for r in range(WORLD)]
    assert any(a != b for a, b in zip(*used)), 'no iteration where only one rank used the head'
    for rank in range(WORLD):
        ours = result(out, f'branch_z{stage}', rank)
        assert ours['head_used'] == used[rank]
        assert_close(ours['state'], plain['state'])


def test_find_unused_parameters_with_gradient_accumulation(out: str) -> None:
    plain = result(out, 'branch_plain_accum2')
    for rank in range(WORLD):
        assert_close(result(out, 'branch_z2_accum2', rank)['state'], plain['state'])


@pytest.mark.parametrize(('stage', 'seed', 'fragments'), [
    # the first iteration is mixed: the ranks compare notes (one all-reduce), both raise
    (2, 42, ('some ranks used parameters that others did not (head.weight, head.bias)',)),
    # the first agrees, the second is not: the rank that differs raises, its peer follows
    (1, 44, ('this rank used other parameters than every rank used before',
             'now used: head.weight, head.bias')),
])
def test_without_the_switch_a_skipped_parameter_is_a_clear_error(
        tmp_path: Any, stage: int, seed: int, fragments: tuple[str, ...]) -> None:
    """Within seconds, naming the parameters and the switch: no gloo abort, no hang."""
    start = time.monotonic()
    proc = run_torchrun(['tests/dist/worker.py', str(tmp_path), json.dumps(
        {'name': 'off', 'cfg': dict(BRANCH, ds_config=zero(stage), seed=seed)})], timeout=200)
    assert proc.returncode != 0
    assert time.monotonic() - start < 90
    for fragment in (*fragments, 'find_unused_parameters=True'):
        assert fragment in proc.stdout, proc.stdout[-6000:]
    assert 'Received data size' not in proc.stdout


def test_find_unused_parameters_under_zero3_warns_and_trains(out: str) -> None:
    """OpenMMLab configs often set the switch by default: ZeRO-3 warns, then checks."""
    with open(osp.join(out, 'first.log')) as f:
        log = f.read()
    assert log.count('cannot be honoured under ZeRO-3') == 1, log[-4000:]
    assert result(out, 'unused_z3')['global_steps'] == 8


@pytest.mark.parametrize('name', ['scalar_z0', 'scalar_z1', 'scalar_z2', 'scalar_z3'])
def test_zero_dim_parameters_train_as_plain_mmengine(out: str, name: str) -> None:
    plain = result(out, 'scalar_plain')
    for rank in range(WORLD):
        ours = result(out, name, rank)
        assert ours['shapes']['logit_scale'] == () and ours['shapes']['temperature'] == ()
        assert_close(ours['state'], plain['state'])
    assert plain['state']['logit_scale'] != 0.3  # trained
    assert plain['state']['temperature'] == 2.0  # frozen


def test_zero_dim_parameters_in_bf16(out: str) -> None:
    ours = result(out, 'scalar_z2_bf16')
    assert ours['shapes']['logit_scale'] == ()
    assert abs(float(ours['state']['logit_scale']) -
               float(result(out, 'scalar_plain')['state']['logit_scale'])) < 0.05


@pytest.mark.parametrize('stage', [2, 3])
def test_zero_dim_parameters_resume_exactly(out: str, stage: int) -> None:
    for rank in range(WORLD):
        straight = result(out, f'scalar_z{stage}', rank)
        resumed = result(out, f'scalar_z{stage}_resumed', rank)
        assert resumed['losses'] == straight['losses'][4:]
        for key, value in straight['state'].items():
            assert torch.equal(resumed['state'][key], value), key
        if stage == 3:
            for key, value in straight['ema'].items():
                assert torch.equal(resumed['ema'][key], value), key
    assert result(out, 'scalar_z3')['ema']['logit_scale'].shape == ()


def test_zero_dim_parameters_load_into_an_evaluation_engine(out: str) -> None:
    tested = result(out, 'scalar_z3_test')
    trained = result(out, 'scalar_z3')
    assert tested['has_optimizer'] is False
    assert 'accuracy' in tested['test_metrics']
    assert tested['shapes']['logit_scale'] == ()
    assert torch.equal(tested['state']['logit_scale'], trained['state']['logit_scale'])


@pytest.mark.parametrize('stage', [2, 3])
def test_zero_dim_parameters_export_and_load_strictly(out: str, stage: int,
                                                      tmp_path: Any) -> None:
    ckpt = osp.join(out, f'scalar_z{stage}', 'iter_8.pth')
    state = consolidated_state_dict(ckpt)
    assert state['logit_scale'].shape == () and state['temperature'].shape == ()
    exported = str(tmp_path / 'model.pth')
    args = ['convert', ckpt, exported] + (['--ema'] if stage == 3 else [])
    proc = run_command([sys.executable, '-m', 'mmengine_deepspeed', *args], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    model = ToyScalarModel(with_bn=False)
    load_checkpoint(model, exported, strict=True)
    expected = result(out, f'scalar_z{stage}')['ema' if stage == 3 else 'state']
    assert model.logit_scale.shape == ()
    assert torch.equal(model.logit_scale.detach(), expected['logit_scale'])


def test_zero_dim_parameters_reshard_to_one_rank(out: str) -> None:
    """A 2-rank ZeRO-3 checkpoint resumed on 1 rank (a universal checkpoint)."""
    ckpt = osp.join(out, 'scalar_z3', 'iter_4.pth')
    _launch(out, [{'name': 'scalar_reshard', 'cfg': dict(
        SCALAR, ds_config=zero(3), max_iters=4, resume=True, load_from=ckpt)}], nproc=1)
    resumed = result(out, 'scalar_reshard')
    assert resumed['shapes']['logit_scale'] == ()
    assert_close(resumed['state'], consolidated_state_dict(ckpt), atol=0)


def test_resuming_with_a_longer_schedule_warns_once(out: str) -> None:
    """MMEngine's semantics are kept (the saved end), with one warning naming the fix."""
    with open(osp.join(out, 'resumed.log')) as f:
        log = f.read()
    warnings = [line for line in log.splitlines()
                if 'param_scheduler[0] (CosineAnnealingLR) resumed with end=2' in line]
    assert len(warnings) == 1, log[-4000:]
    assert 'max_epochs=4' in warnings[0] and 'begin=2, end=4' in warnings[0]
    straight, longer = result(out, 'sched'), result(out, 'sched_longer')
    per_epoch = len(straight['lrs']) // 2
    assert len(longer['lrs']) == 2 * per_epoch
    assert longer['lrs'] == [straight['lrs'][-1]] * len(longer['lrs'])  # stuck at the old end


def test_deepspeed_behaviours_zero_dim_parameters_rely_on(tmp_path: Any) -> None:
    """Pins DeepSpeed 0.19: the 0-dim trap and the two ways around it zero/zero_dim.py takes."""
    env = {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1',
           'MASTER_PORT': str(free_port())}
    proc = run_command([sys.executable, 'tests/dist/scalar_pin_worker.py'], timeout=180,
                       extra_env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for stage in range(4):
        assert f'RAW_STAGE{stage} view_error' in proc.stdout, proc.stdout[-3000:]
    for stage in range(3):
        assert f'MARKED_STAGE{stage} ()' in proc.stdout, proc.stdout[-3000:]
    assert 'CLIP_STAGE0 shape_error' in proc.stdout
    assert 'ZERO3_SHAPE ()' in proc.stdout


def test_a_loss_module_only_some_ranks_run_trains_at_zero3(out: str) -> None:
    """DeepSpeed's ZeRO-3 stops when the ranks ran different submodules ("Detected a
    disagreement on list length"); a module without parameters (MMDetection's bbox loss,
    skipped on a rank without positive samples) has nothing to gather, so its hooks are off
    and the run gives MMEngine + DDP's parameters."""
    used = [result(out, 'loss_module_z3', rank)['head_used'] for rank in range(WORLD)]
    assert used[0] != used[1]  # in some iteration one rank ran the loss module, the other not
    for rank in range(WORLD):
        assert_close(result(out, 'loss_module_z3', rank)['state'],
                     result(out, 'loss_module_plain', rank)['state'])


def test_the_logs_prediction_for_a_model_the_meta_device_cannot_run_is_measured(out: str) -> None:
    """Its construction and its forward read values: the first iteration's saved tensors are
    counted and the partitioned model itself is counted (ZeRO-3)."""
    logs = glob.glob(osp.join(out, 'values_z3', '*', '*.log'))
    log = '\n'.join(Path(p).read_text() for p in logs)
    found = re.search(r'after the first iteration: (\d+) MiB; `mmengine-deepspeed plan` predicts '
                      r'(\d+) MiB \(the meta device cannot run this model \((.*?)\): its '
                      r'activations measured in this first iteration\)', log)
    assert found, log[-4000:]
    measured, predicted = int(found[1]), int(found[2])
    assert found[3] == 'RuntimeError: Tensor.item() cannot be called on meta tensors'
    assert 0.9 * measured <= predicted <= 1.5 * measured, (measured, predicted)
