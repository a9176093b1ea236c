"""Every CheckpointHook argument does what it does under MMEngine's own Runner.

One launch, one process: each case trains once with MMEngine's Runner (DDP) and once with
DeepSpeedRunner (ZeRO-0, equal to it within 6e-8, so validation picks the same best
checkpoint), with the same CheckpointHook arguments. The checkpoint names in the folder,
``last_checkpoint`` and the saved keys must agree; ours are directories where MMEngine's are
files, which is the documented difference.
"""
from __future__ import annotations

import json
import os
import os.path as osp
import re
from typing import Any

import pytest
import torch

from mmengine_deepspeed.checkpoint.layout import CLIENT_FILE, META_FILE
from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist


def hook(**kwargs: Any) -> dict:
    return dict(type='CheckpointHook', **kwargs)


CASES: dict[str, dict] = {
    'interval_max_keep': dict(max_iters=7, checkpoint=hook(interval=2, by_epoch=False,
                                                           max_keep_ckpts=2)),
    'by_epoch': dict(by_epoch=True, max_epochs=3, checkpoint=hook(interval=2)),
    'tmpl_out_dir_no_last': dict(max_iters=6, checkpoint=hook(
        interval=4, by_epoch=False, save_last=False, filename_tmpl='ckpt_{}.pth',
        out_dir='{out}/elsewhere')),
    'save_best': dict(max_iters=6, val_interval=2, checkpoint=hook(
        interval=3, by_epoch=False, save_best='accuracy', rule='greater')),
    'no_param_scheduler': dict(max_iters=4, checkpoint=hook(interval=4, by_epoch=False,
                                                            save_param_scheduler=False)),
    'local_backend_args': dict(max_iters=4, checkpoint=hook(
        interval=2, by_epoch=False, backend_args=dict(backend='local'))),
    # Constant lr: MMEngine's resume without optimizer state restarts from the configured
    # lr, where ours restores the scheduled one (the learning rates are not its moments).
    'no_optimizer': dict(max_iters=4, param_scheduler=None, checkpoint=hook(
        interval=2, by_epoch=False, save_optimizer=False)),
}
# Each runner resumes the iter_2 checkpoint it wrote with save_optimizer=False.
RESUMED = dict(max_iters=4, param_scheduler=None, resume=True)
ZERO0 = {'zero_optimization': {'stage': 0}}  # MMEngine's plain runs drop it
CHECKPOINT_NAME = re.compile(r'.*\.pth$|^last_checkpoint$')


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp('hook_args'))
    scenarios = []
    for case, cfg in CASES.items():
        # Distinct experiment names: runners built within the same second would share
        # MMEngine's MessageHub instance (and its best score).
        scenarios += [{'name': f'plain_{case}', 'mode': 'plain',
                       'cfg': dict(cfg, experiment_name=f'plain_{case}')},
                      {'name': f'ds_{case}',
                       'cfg': dict(cfg, experiment_name=f'ds_{case}',
                                   ds_config=ZERO0)}]
    for mode, prefix in (('plain', 'plain'), ('train', 'ds')):
        scenarios.append({'name': f'{prefix}_resumed', 'mode': mode, 'cfg': dict(
            RESUMED, experiment_name=f'{prefix}_resumed', ds_config=ZERO0,
            load_from=f'{{out}}/{prefix}_no_optimizer/iter_2.pth')})
    launch_scenarios('tests/dist/worker.py', out, scenarios, nproc=1)
    return out


def folder(out: str, name: str, cfg: dict) -> str:
    out_dir = cfg['checkpoint'].get('out_dir')
    # MMEngine puts checkpoints under out_dir/<work_dir's name> when out_dir is set.
    return osp.join(out_dir.replace('{out}', out), name) if out_dir else osp.join(out, name)


def listing(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if CHECKPOINT_NAME.match(n))


@pytest.mark.parametrize('case', list(CASES))
def test_checkpoint_hook_arguments_as_mmengine(out: str, case: str) -> None:
    cfg = CASES[case]
    plain, ours = folder(out, f'plain_{case}', cfg), folder(out, f'ds_{case}', cfg)
    assert listing(ours) == listing(plain), (listing(ours), listing(plain))
    assert any(name.endswith('.pth') for name in listing(plain))
    # last_checkpoint is written to the work_dir, also with out_dir set
    with open(osp.join(out, f'plain_{case}', 'last_checkpoint')) as a, \
            open(osp.join(out, f'ds_{case}', 'last_checkpoint')) as b:
        assert osp.basename(a.read().strip()) == osp.basename(b.read().strip())
    if case == 'no_optimizer':
        assert 'optimizer' not in torch.load(osp.join(plain, 'iter_2.pth'), weights_only=False)
        with open(osp.join(ours, 'iter_2.pth', META_FILE)) as f:
            assert json.load(f)['optimizer_state'] is False
    if case == 'no_param_scheduler':
        name = listing(plain)[0]
        assert 'param_schedulers' not in torch.load(osp.join(plain, name), weights_only=False)
        assert 'param_schedulers' not in torch.load(osp.join(ours, name, CLIENT_FILE),
                                                    weights_only=False)


def test_resuming_without_optimizer_state_as_mmengine(out: str) -> None:
    """Both runners resume the checkpoint they wrote with save_optimizer=False: the optimizer
    (SGD momentum) restarts in both, and the weights they end with agree as their straight
    runs do."""
    plain = torch.load(osp.join(out, 'plain_resumed.rank0.pt'), weights_only=False)
    ours = torch.load(osp.join(out, 'ds_resumed.rank0.pt'), weights_only=False)
    assert len(ours['losses']) == len(plain['losses']) == 2
    for key, value in plain['state'].items():
        assert torch.allclose(value, ours['state'][key], atol=1e-6), key
