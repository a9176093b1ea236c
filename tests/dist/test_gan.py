"""Several optimizers: the toy GAN (MMEngine's tutorial) with one DeepSpeed engine per optimizer.

Three launches for the whole module (see ``gan_worker.py``): one process for
parity with MMEngine's plain Runner at ZeRO 0-3 (BatchNorm statistics match only
in one process); two ranks for straight-vs-resumed runs at ZeRO-2/3; one rank
resharding a 2-rank ZeRO-3 checkpoint.
"""
from __future__ import annotations

import os
import os.path as osp
from typing import Any

import pytest
import torch
from mmengine.runner import load_checkpoint

from mmengine_deepspeed.checkpoint.export import consolidated_state_dict, export_checkpoint
from mmengine_deepspeed.checkpoint.layout import read_meta
from mmengine_deepspeed.cli import describe
from tests.helpers import launch_scenarios
from tests.toy_gan import ToyGAN, ToyImageDataset

pytestmark = pytest.mark.dist


def zero(stage: int) -> dict:
    return {'zero_optimization': {'stage': stage}}


EVERY_6 = {'type': 'CheckpointHook', 'interval': 6, 'by_epoch': False}
EMA = {'type': 'EMAHook', 'momentum': 0.2}
RANDN = {'type': 'ToyGAN', 'noise_from': 'randn'}
PARITY = [
    {'name': 'plain', 'mode': 'plain', 'cfg': {}},
    {'name': 'z0', 'form': 'objects', 'cfg': {'ds_config': zero(0)}},
    *({'name': f'z{s}', 'cfg': {'ds_config': zero(s)}} for s in (1, 2, 3)),
    {'name': 'z3_val', 'mode': 'val', 'cfg': {'ds_config': zero(3)}},
    {'name': 'z2_bf16', 'cfg': {'ds_config': dict(zero(2), bf16={'enabled': True}),
                                'max_iters': 6}},
    # the tutorial's noise: torch.randn in train_step
    {'name': 'plain_randn', 'mode': 'plain', 'cfg': {'model': RANDN}},
    *({'name': f'z{s}_randn', 'cfg': {'ds_config': zero(s), 'model': RANDN}} for s in (0, 2, 3)),
]
RESUME = [
    {'name': 'straight_z2', 'cfg': {'ds_config': zero(2), 'max_iters': 12, 'checkpoint': EVERY_6}},
    {'name': 'resumed_z2', 'cfg': {'ds_config': zero(2), 'max_iters': 12, 'resume': True,
                                   'load_from': '{out}/straight_z2/iter_6.pth'}},
    {'name': 'straight_z3', 'cfg': {'ds_config': zero(3), 'max_iters': 12, 'checkpoint': EVERY_6,
                                    'custom_hooks': [EMA]}},
    {'name': 'resumed_z3', 'cfg': {'ds_config': zero(3), 'max_iters': 12, 'resume': True,
                                   'custom_hooks': [EMA],
                                   'load_from': '{out}/straight_z3/iter_6.pth'}},
    {'name': 'straight_z2_randn', 'cfg': {'ds_config': zero(2), 'max_iters': 12,
                                          'checkpoint': EVERY_6, 'model': RANDN}},
    {'name': 'resumed_z2_randn', 'cfg': {'ds_config': zero(2), 'max_iters': 12, 'resume': True,
                                         'model': RANDN,
                                         'load_from': '{out}/straight_z2_randn/iter_6.pth'}},
    {'name': 'weights_only_z3', 'cfg': {'ds_config': zero(3), 'max_iters': 12,
                                        'custom_hooks': [EMA],
                                        'checkpoint': dict(EVERY_6, save_optimizer=False)}},
]
RESHARD = [
    {'name': 'reshard_z3', 'cfg': {'ds_config': zero(3), 'max_iters': 6, 'resume': True,
                                   'custom_hooks': [EMA],
                                   'load_from': '{out}/straight_z3/iter_6.pth'}},
    {'name': 'weights_only_resumed', 'cfg': {
        'ds_config': zero(2), 'max_iters': 12, 'resume': True, 'custom_hooks': [EMA],
        'load_from': '{out}/weights_only_z3/iter_6.pth'}},
]


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp('gan'))
    for name, scenarios, nproc in (('parity', PARITY, 1), ('resume', RESUME, 2),
                                   ('reshard', RESHARD, 1)):
        with open(osp.join(path, f'{name}.log'), 'w') as f:
            f.write(launch_scenarios('tests/dist/gan_worker.py', path, scenarios, nproc))
    return path


def result(out: str, name: str, rank: int = 0) -> dict:
    return torch.load(osp.join(out, f'{name}.rank{rank}.pt'))


def assert_close(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(actual[key], value, atol=atol, rtol=0), \
            (key, (actual[key] - value).abs().max())


@pytest.mark.parametrize('name', ['z0', 'z1', 'z2', 'z3'])
def test_gan_trains_as_with_mmengine_runner(out: str, name: str) -> None:
    """30 iterations; the generator accumulates over 2, the discriminator clips, each has
    its own schedule; z0 passes the tutorial's hand-built OptimWrapperDict."""
    plain, ours = result(out, 'plain'), result(out, name)
    assert ours['engine_modules'] == {'generator': 'generator', 'discriminator': 'discriminator'}
    assert ours['stages'] == {'generator': int(name[1]), 'discriminator': int(name[1])}
    assert ours['steps'] == {'generator': 15, 'discriminator': 30}
    assert_close(ours['state'], plain['state'], atol=1e-5)
    assert ours['losses'] == pytest.approx(plain['losses'], abs=1e-5)
    assert ours['lr_g'] == pytest.approx(plain['lr_g']) and ours['lr_d'] == plain['lr_d']
    assert len(set(ours['lr_g'])) > 1 and len(set(ours['lr_d'])) > 1
    # the clipped discriminator's grad norm, logged per optimizer as MMEngine logs its lr
    assert 'train/discriminator.grad_norm' in ours['scalars']
    assert 'train/grad_norm' not in ours['scalars']
    assert all(n > 0 for n in ours['grad_norm_d'])
    # validation (after the last iteration) saw every submodule in eval mode, each engine's too
    assert ours['val_modes'] and not any(ours['val_modes'])


@pytest.mark.parametrize('stage', [0, 2, 3])
def test_gan_drawing_its_noise_trains_as_with_mmengine_runner(out: str, stage: int) -> None:
    """The tutorial's GAN draws its latent with torch.randn in train_step: DeepSpeedRunner
    draws from the global streams where Runner does, so the noise and the weights match."""
    plain, ours = result(out, 'plain_randn'), result(out, f'z{stage}_randn')
    assert_close(ours['state'], plain['state'], atol=1e-5)
    assert ours['losses'] == pytest.approx(plain['losses'], abs=1e-5)
    assert max((ours['state'][k] - v).abs().max().item()
               for k, v in result(out, f'z{stage}')['state'].items()) > 1e-3  # other noise


def test_bf16_submodules_get_their_inputs_cast(out: str) -> None:
    """The model hands fp32 noise and images to bf16 submodules: each engine casts them."""
    ours = result(out, 'z2_bf16')
    assert ours['dtypes'] == {'generator': 'torch.bfloat16', 'discriminator': 'torch.bfloat16'}
    assert len(ours['losses']) == 6 and all(0 < loss < 10 for loss in ours['losses'])


def test_val_without_training(out: str) -> None:
    """The score the plain model computes, in eval mode, with the weights the engine held."""
    ours = result(out, 'z3_val')
    model = ToyGAN()
    model.load_state_dict(ours['state'])
    model.eval()
    data = ToyImageDataset(size=8, seed=1)
    with torch.no_grad():
        scores = [float(s['score']) for s in model(data.images, data.noise, mode='predict')]
    assert ours['metrics'] == pytest.approx({'score': sum(scores) / len(scores)}, abs=1e-6)


@pytest.mark.parametrize('run', ['z2', 'z3', 'z2_randn'])
def test_resume_is_exact(out: str, run: str) -> None:
    """Also with the tutorial's torch.randn latent (z2_randn): the resumed run draws it
    from the streams the run that never stopped had."""
    for rank in range(2):
        straight = result(out, f'straight_{run}', rank)
        resumed = result(out, f'resumed_{run}', rank)
        assert_close(resumed['state'], straight['state'], atol=0)
        assert resumed['losses'][-6:] == straight['losses'][-6:]
        assert resumed['steps'] == straight['steps'] == {'generator': 6, 'discriminator': 12}
    if run == 'z3':
        assert_close(resumed['ema'], straight['ema'], atol=0)


def test_checkpoint_holds_each_engine(out: str) -> None:
    path = osp.join(out, 'straight_z3', 'iter_12.pth')
    assert {'deepspeed-generator', 'deepspeed-discriminator'} <= set(os.listdir(path))
    assert read_meta(path)['engines'] == {'generator': 'generator',
                                          'discriminator': 'discriminator'}
    line = next(x for x in describe(path).splitlines() if x.startswith('engines: '))
    assert 'generator (model.generator)' in line and 'discriminator (model.discriminator)' in line


@pytest.mark.parametrize('stage', [2, 3])
def test_export_loads_strictly_into_the_plain_model(out: str, stage: int,
                                                    tmp_path: Any) -> None:
    """Every key of the model, generator_ema (in no optimizer) included."""
    file = export_checkpoint(osp.join(out, f'straight_z{stage}', 'iter_12.pth'),
                             str(tmp_path / 'gan.pth'))
    model = ToyGAN()
    load_checkpoint(model, file, strict=True)
    state = {k: v.float() for k, v in model.state_dict().items()}
    assert_close(state, result(out, f'straight_z{stage}')['state'], atol=0)


def test_reshard_two_ranks_to_one(out: str) -> None:
    """A 2-rank ZeRO-3 checkpoint resumes on 1 rank with every engine's weights and EMA."""
    ours = result(out, 'reshard_z3')
    saved = consolidated_state_dict(osp.join(out, 'straight_z3', 'iter_6.pth'))
    assert_close(ours['state'], {k: v.float() for k, v in saved.items()}, atol=0)
    assert ours['steps'] == {'generator': 3, 'discriminator': 6}
    assert ours['ema'] is not None


def test_weights_only_checkpoint_of_several_engines(out: str) -> None:
    """save_optimizer=False at ZeRO-3 on 2 ranks: every engine's weights (and the EMA copy no
    optimizer holds) as a full checkpoint of the same step has them; resumed on 1 rank at
    ZeRO-2, each engine continues from them with a fresh optimizer."""
    weights_only = osp.join(out, 'weights_only_z3', 'iter_6.pth')
    assert not any(name.startswith('deepspeed') for name in os.listdir(weights_only))
    full = consolidated_state_dict(osp.join(out, 'straight_z3', 'iter_6.pth'))
    assert_close(consolidated_state_dict(weights_only), full, atol=0)
    resumed = result(out, 'weights_only_resumed')
    assert resumed['steps'] == {'generator': 3, 'discriminator': 6}
    assert len(resumed['losses']) == 12 and resumed['ema'] is not None  # 6 from the hub
    with open(osp.join(out, 'reshard.log')) as f:
        assert 'holds no optimizer state' in f.read()
