"""Checkpoints on 2 CPU ranks with real DeepSpeed: save, exact resume, load_from, export.

THE test is "straight vs resumed": a run of 8 iterations and a run resumed
from the checkpoint at iteration 4 must end with identical weights (max abs
diff 0.0) and log identical losses and learning rates.
"""
from __future__ import annotations

import glob
import json
import os
import os.path as osp
import stat
import sys
from typing import Any

import pytest
import torch
from mmengine.runner import load_checkpoint
from safetensors.torch import save_file

from mmengine_deepspeed.checkpoint.layout import LAST_CHECKPOINT, is_complete, read_meta
from tests.helpers import ToyModel, probe_inputs, run_command, run_torchrun

pytestmark = pytest.mark.dist

WORLD = 2
EVERY_4 = {'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False}
BF16 = {'enabled': True}


def zero(stage: int, **extra: Any) -> dict:
    return {'zero_optimization': {'stage': stage}, **extra}


# name -> (toy_config kwargs, checkpoint to resume from, relative to the straight run)
RESUME_CASES: dict[str, tuple[dict, str]] = {
    'z0': (dict(ds_config=zero(0), checkpoint=EVERY_4), 'iter_4.pth'),
    'z1': (dict(ds_config=zero(1), checkpoint=dict(EVERY_4, save_best='accuracy', rule='greater'),
                val_interval=4), 'iter_4.pth'),
    'z2_bf16': (dict(ds_config=zero(2, bf16=BF16), checkpoint=EVERY_4), 'iter_4.pth'),
    'z3': (dict(ds_config=zero(3), checkpoint=EVERY_4), 'iter_4.pth'),
    'z3_bf16': (dict(ds_config=zero(3, bf16=BF16), checkpoint=EVERY_4), 'iter_4.pth'),
    'z2_accum2': (dict(ds_config=zero(2), checkpoint=EVERY_4, accumulative_counts=2,
                       optimizer={'type': 'AdamW', 'lr': 0.01}), 'iter_4.pth'),
    'z3_epochs': (dict(ds_config=zero(3), by_epoch=True,
                       checkpoint={'type': 'CheckpointHook', 'interval': 1}), 'epoch_1.pth'),
    'z3_bf16_ema': (dict(ds_config=zero(3, bf16=BF16), checkpoint=EVERY_4, custom_hooks=[
        {'type': 'EMAHook', 'momentum': 0.2}, {'type': 'RecorderHook'}]), 'iter_4.pth'),
    # by iteration inside an epoch-based loop: iter 6 is mid-way through epoch 2 (4 per epoch)
    'z2_mid_epoch': (dict(ds_config=zero(2), by_epoch=True, max_epochs=3,
                          checkpoint={'type': 'CheckpointHook', 'interval': 6, 'by_epoch': False}),
                     'iter_6.pth'),
}


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp('ckpt'))


@pytest.fixture(scope='module')
def plain_weights(out: str) -> dict[str, str]:
    """A pretrained-style model saved as .pth (with/without state_dict, prefixed) and
    safetensors."""
    model = ToyModel()
    torch.manual_seed(5)
    for p in model.parameters():
        p.data.normal_()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    paths = {'wrapped': osp.join(out, 'pretrained.pth'), 'bare': osp.join(out, 'bare.pth'),
             'prefixed': osp.join(out, 'prefixed.pth'),
             'backbone': osp.join(out, 'backbone.pth'),
             'safetensors': osp.join(out, 'pretrained.safetensors')}
    torch.save({'meta': {'source': 'test'}, 'state_dict': state}, paths['wrapped'])
    torch.save(state, paths['bare'])
    torch.save({'state_dict': {f'module.{k}': v for k, v in state.items()}}, paths['prefixed'])
    torch.save({f'backbone.{k}': v for k, v in state.items()}, paths['backbone'])
    save_file(state, paths['safetensors'])
    model.eval()
    with torch.no_grad():
        torch.save(model(probe_inputs()), osp.join(out, 'pretrained_logits.pt'))
    return paths


def _scenarios(out: str, plain: dict[str, str]) -> list[str]:
    items: list[dict] = []
    for name, (cfg, ckpt) in RESUME_CASES.items():
        items.append({'name': f'straight_{name}', 'cfg': cfg})
        items.append({'name': f'resumed_{name}', 'cfg': dict(
            cfg, resume=True, load_from=osp.join(out, f'straight_{name}', ckpt))})
    # Auto-resume: the newest checkpoint lost its marker (a killed save) and is skipped.
    z2 = RESUME_CASES['z2_accum2'][0]
    items.append({'name': 'auto_src', 'cfg': z2})
    items.append({'name': 'auto', 'work_dir': osp.join(out, 'auto_src'),
                  'unmark': osp.join(out, 'auto_src', 'iter_8.pth'),
                  'cfg': dict(z2, resume=True)})
    # load_from for testing, across stages, from our directories and plain files.
    items += [
        {'name': 'load_z3_into_z0', 'mode': 'test', 'cfg': dict(
            ds_config=zero(0), load_from=osp.join(out, 'straight_z3', 'iter_8.pth'))},
        {'name': 'load_z0_into_z3', 'mode': 'test', 'cfg': dict(
            ds_config=zero(3), load_from=osp.join(out, 'straight_z0', 'iter_8.pth'))},
        {'name': 'load_z3bf16_into_z2', 'mode': 'test', 'cfg': dict(
            ds_config=zero(2), load_from=osp.join(out, 'straight_z3_bf16', 'iter_8.pth'))},
    ]
    for kind in ('wrapped', 'bare', 'prefixed', 'safetensors'):
        items.append({'name': f'load_{kind}_into_z3', 'mode': 'test',
                      'cfg': dict(ds_config=zero(3), load_from=plain[kind])})
    # runner.load_checkpoint into a built ZeRO-3 evaluation engine, strict, keys revised.
    items.append({'name': 'reload_into_z3', 'mode': 'test_reload', 'reload': plain['backbone'],
                  'cfg': dict(ds_config=zero(3))})
    # Finetuning: load_from under ZeRO-1/2 must reach the fp32 masters (lr 0 keeps them).
    for stage in (1, 2):
        items.append({'name': f'finetune_z{stage}', 'cfg': dict(
            ds_config=zero(stage), load_from=plain['wrapped'], max_iters=2, val=False,
            param_scheduler=None, optimizer={'type': 'SGD', 'lr': 0.0})})
    return [json.dumps(i) for i in items]


@pytest.fixture(scope='module')
def results(out: str, plain_weights: dict[str, str]) -> dict[str, list[dict]]:
    proc = run_torchrun(['tests/dist/worker.py', out, *_scenarios(out, plain_weights)],
                        timeout=500)
    assert proc.returncode == 0, proc.stdout[-8000:]
    names = [json.loads(s)['name'] for s in _scenarios(out, plain_weights)]
    return {n: [torch.load(osp.join(out, f'{n}.rank{r}.pt')) for r in range(WORLD)]
            for n in names}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize('case', list(RESUME_CASES))
def test_resume_is_exact(results: dict, case: str) -> None:
    for rank in range(WORLD):
        straight = results[f'straight_{case}'][rank]
        resumed = results[f'resumed_{case}'][rank]
        done = len(straight['losses']) - len(resumed['losses'])
        assert done == (6 if case == 'z2_mid_epoch' else 4), (len(straight['losses']),
                                                               len(resumed['losses']))
        diff = _max_diff(straight['state'], resumed['state'])
        print(f'{case} rank {rank}: max abs diff {diff}')
        assert diff == 0.0
        assert resumed['losses'] == straight['losses'][done:]
        assert resumed['lrs'] == straight['lrs'][done:]
        assert resumed['global_steps'] == straight['global_steps']
        if straight['ema'] is not None:
            assert _max_diff(straight['ema'], resumed['ema']) == 0.0


def test_checkpoint_directories_and_last_checkpoint(results: dict, out: str) -> None:
    work = osp.join(out, 'straight_z3')
    for step in (4, 8):
        path = osp.join(work, f'iter_{step}.pth')
        assert is_complete(path)
        meta = read_meta(path)
        assert (meta['iter'], meta['world_size'], meta['zero_stage'], meta['precision']) == \
            (step, 2, 3, 'fp32')
        assert osp.isfile(osp.join(path, 'rank_state_rank1.pt'))
    with open(osp.join(work, LAST_CHECKPOINT)) as f:
        assert f.read().strip() == osp.join(work, 'iter_8.pth')


def test_save_best_writes_a_complete_checkpoint(results: dict, out: str) -> None:
    best = glob.glob(osp.join(out, 'straight_z1', 'best_*'))
    assert best and all(is_complete(p) for p in best), best


def test_auto_resume_skips_an_incomplete_checkpoint(results: dict) -> None:
    src, auto = results['auto_src'][0], results['auto'][0]
    assert len(auto['losses']) == 4  # resumed from iter_4, not the unmarked iter_8
    assert auto['losses'] == src['losses'][4:]
    assert _max_diff(src['state'], auto['state']) == 0.0


def _source_state(results: dict, name: str) -> dict[str, torch.Tensor]:
    return results[name][0]['state']


@pytest.mark.parametrize(('name', 'source'), [
    ('load_z3_into_z0', 'straight_z3'), ('load_z0_into_z3', 'straight_z0')])
def test_load_from_our_checkpoint_across_stages(results: dict, name: str, source: str) -> None:
    for rank in results[name]:
        assert rank['has_optimizer'] is False  # test() restores no optimizer (MMEngine #1408)
        assert _max_diff(rank['state'], _source_state(results, source)) == 0.0


def test_load_from_bf16_checkpoint_takes_fp32_masters(results: dict) -> None:
    """ZeRO-3 bf16 → ZeRO-2 fp32: the fp32 masters, which round to the bf16 weights."""
    loaded = results['load_z3bf16_into_z2'][0]['state']
    source = _source_state(results, 'straight_z3_bf16')
    for key, value in source.items():
        if 'running' in key or 'num_batches' in key:
            continue
        assert torch.equal(loaded[key].to(torch.bfloat16).float(), value), key


def _pretrained(out: str) -> ToyModel:
    source = ToyModel()
    load_checkpoint(source, osp.join(out, 'pretrained.pth'))
    return source


@pytest.mark.parametrize('kind', ['wrapped', 'bare', 'prefixed', 'safetensors', 'reload'])
def test_load_from_plain_weights_into_zero3(results: dict, out: str, kind: str) -> None:
    expected = torch.load(osp.join(out, 'pretrained_logits.pt'))
    source = _pretrained(out)
    name = 'reload_into_z3' if kind == 'reload' else f'load_{kind}_into_z3'
    for rank in results[name]:
        assert rank['stage'] == 3 and rank['has_optimizer'] is False
        torch.testing.assert_close(rank['probe_logits'], expected, rtol=0, atol=1e-6)
        for key, value in source.state_dict().items():
            assert torch.equal(rank['state'][key], value.float()), key


@pytest.mark.parametrize('stage', [1, 2])
def test_finetune_load_from_reaches_the_fp32_masters(results: dict, out: str,
                                                      stage: int) -> None:
    """Loaded after initialize, the first step would restore ZeRO's stale masters."""
    source = _pretrained(out)
    for rank in results[f'finetune_z{stage}']:
        for name, param in source.named_parameters():
            assert torch.equal(rank['state'][name], param.detach()), name


def _cli(*args: str) -> Any:
    return run_command([sys.executable, '-m', 'mmengine_deepspeed', *args], timeout=120)


@pytest.mark.parametrize('fmt', ['pth', 'safetensors'])
def test_convert_exports_one_file_mmengine_loads(results: dict, out: str, fmt: str) -> None:
    target = osp.join(out, f'export_z3.{fmt}')
    args = ['convert', osp.join(out, 'straight_z3', 'iter_8.pth'), target]
    proc = _cli(*args, *(['--safetensors'] if fmt == 'safetensors' else []))
    assert proc.returncode == 0, proc.stdout[-3000:]
    # one line of its own: DeepSpeed's parsing messages and progress bars kept out
    assert proc.stdout.strip().splitlines()[-1] == f'wrote {target}', proc.stdout
    assert 'ZeroStageEnum' not in proc.stdout and 'checkpoint shards' not in proc.stdout
    reference = osp.join(out, f'reference_mode.{fmt}')  # what the umask gives a new file
    open(reference, 'w').close()
    assert stat.S_IMODE(os.stat(target).st_mode) == stat.S_IMODE(os.stat(reference).st_mode)
    described = _cli('inspect', target)
    assert described.returncode == 0, described.stdout[-3000:]
    for fragment in ('kind: ', 'not a checkpoint directory', 'iter: 8', 'zero_stage: 3',
                     'exported_weights: trained', 'float32', 'MiB'):
        assert fragment in described.stdout, described.stdout
    model = ToyModel()
    if fmt == 'pth':
        checkpoint = load_checkpoint(model, target, strict=True)
        assert checkpoint['meta']['iter'] == 8 and checkpoint['meta']['zero_stage'] == 3
    else:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(target), strict=True)
    assert _max_diff({k: v.float() for k, v in model.state_dict().items()},
                     _source_state(results, 'straight_z3')) == 0.0


def test_convert_exports_the_ema_weights(results: dict, out: str) -> None:
    target = osp.join(out, 'export_ema.pth')
    proc = _cli('convert', osp.join(out, 'straight_z3_bf16_ema', 'iter_8.pth'), target, '--ema')
    assert proc.returncode == 0, proc.stdout[-3000:]
    model = ToyModel()
    checkpoint = load_checkpoint(model, target, strict=True)
    assert checkpoint['meta']['exported_weights'] == 'ema'
    ema = results['straight_z3_bf16_ema'][0]['ema']
    assert _max_diff({k: v.float() for k, v in model.state_dict().items()}, ema) == 0.0
    refused = _cli('convert', osp.join(out, 'straight_z3', 'iter_8.pth'), target, '--ema')
    assert refused.returncode != 0 and 'holds no EMA weights' in refused.stdout


def test_convert_to_bf16(results: dict, out: str) -> None:
    target = osp.join(out, 'export_bf16.pth')
    proc = _cli('convert', osp.join(out, 'straight_z2_bf16', 'iter_8.pth'), target,
                '--dtype', 'bf16')
    assert proc.returncode == 0, proc.stdout[-3000:]
    state = torch.load(target)['state_dict']
    assert state['fc1.weight'].dtype == torch.bfloat16
    assert state['norm.num_batches_tracked'].dtype == torch.int64
    assert torch.equal(state['fc1.weight'].float(),
                       _source_state(results, 'straight_z2_bf16')['fc1.weight'])


def test_inspect_describes_a_checkpoint(results: dict, out: str) -> None:
    proc = _cli('inspect', osp.join(out, 'straight_z3_bf16', 'iter_4.pth'))
    assert proc.returncode == 0, proc.stdout[-3000:]
    for fragment in ('iter: 4', 'world_size: 2', 'zero_stage: 3', 'precision: bf16',
                     'complete: yes', 'zero_pp_rank_1_mp_rank_00_model_states.pt', 'MiB'):
        assert fragment in proc.stdout, proc.stdout
