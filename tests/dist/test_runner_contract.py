"""MMEngine's Runner contract beyond train(): several runners in one process, deep copies.

Two launches (see ``contract_worker.py``): 2 ranks through ZeRO 0-3, and 1 rank. A runner
trains after another one in the same process, with or without
``torch.distributed.destroy_process_group()`` in between, and gives the weights the first
one gave with the same config. ``save_optimizer=False`` and ``save_checkpoint()`` outside
``train()`` write weights-only checkpoints that resume.
"""
from __future__ import annotations

import glob
import json
import os
import os.path as osp
import re
from typing import Any

import pytest
import torch

from mmengine_deepspeed.checkpoint.export import consolidated_state_dict
from mmengine_deepspeed.checkpoint.layout import WEIGHTS_FILE
from mmengine_deepspeed.cli import describe
from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist


Z2 = {'ds_config': {'zero_optimization': {'stage': 2}}}
EVERY_4 = {'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False}
# Tied, frozen and 0-dim parameters, buffers, BatchNorm (tests/toy_layered.py).
LAYERED_BF16_Z3 = {'model': {'type': 'LayeredModel'}, 'optimizer': {'type': 'AdamW', 'lr': 0.01},
                   'ds_config': {'zero_optimization': {'stage': 3}, 'bf16': {'enabled': True}}}
WEIGHTS_ONLY = {'type': 'CheckpointHook', 'interval': 3, 'by_epoch': False,
                'save_optimizer': False}


def scenario(name: str, stage: int, **extra: object) -> dict:
    return {'name': name, 'cfg': {'ds_config': {'zero_optimization': {'stage': stage}},
                                  'max_iters': 3}, **extra}


TWO_RANKS = [scenario('z2_first', 2, deepcopy=True), scenario('z2_again', 2, destroy=True),
             scenario('z0', 0, destroy=True, deepcopy=True),
             scenario('z1', 1, destroy=True, deepcopy=True, save_first='before.pth'),
             scenario('z3_first', 3, destroy=True, deepcopy=True),
             scenario('z3_again', 3, rebuild=True, destroy=True),
             scenario('factory', 2, factory=True, destroy=True),
             # resume() / load_or_resume() before train(), and val() with resume=True
             {'name': 'straight', 'cfg': {**Z2, 'max_iters': 8, 'checkpoint': EVERY_4}},
             {'name': 'resume_first', 'cfg': {**Z2, 'max_iters': 8},
              'resume_first': '{out}/straight/iter_4.pth', 'destroy': True},
             {'name': 'load_or_resume_first', 'cfg': {**Z2, 'max_iters': 8, 'resume': True,
                                                      'load_from': '{out}/straight/iter_4.pth'},
              'load_or_resume_first': True, 'destroy': True},
             {'name': 'published', 'destroy': True, 'cfg': {**Z2, 'max_iters': 3, 'checkpoint': {
                 'type': 'CheckpointHook', 'interval': 2, 'by_epoch': False,
                 'published_keys': ['meta', 'state_dict']}}},
             {'name': 'val_resumed', 'val_only': True,
              'cfg': {**Z2, 'resume': True, 'load_from': '{out}/straight/iter_4.pth'}},
             # save_optimizer=False (bf16 ZeRO-3: fp32 masters in the optimizer partitions)
             {'name': 'wo_straight', 'save_after': {'full_6.pth': True},
              'cfg': {**LAYERED_BF16_Z3, 'max_iters': 6, 'checkpoint': WEIGHTS_ONLY}},
             {'name': 'wo_resumed', 'destroy': True, 'cfg': {
                 **LAYERED_BF16_Z3, 'max_iters': 6, 'resume': True,
                 'load_from': '{out}/wo_straight/iter_3.pth'}},
             {'name': 'wo_round_trip', 'save_after': {'again.pth': False}, 'destroy': True,
              'cfg': {**LAYERED_BF16_Z3, 'max_iters': 3, 'resume': True,
                      'load_from': '{out}/wo_straight/iter_3.pth'}},
             # save_checkpoint() before train() and after val()
             {'name': 'saves_z3', 'save_first': 'before.pth', 'val_only': True,
              'save_after': {'after_val.pth': True}, 'destroy': True,
              'cfg': {**LAYERED_BF16_Z3, 'ds_config': {'zero_optimization': {'stage': 3}}}},
             {'name': 'saves_z2', 'save_first': 'before.pth', 'val_only': True,
              'save_after': {'after_val.pth': True}, 'cfg': Z2},
             # EMAHook driven by hand on a model built partitioned (ZeRO-3), then val()
             {'name': 'ema_by_hand', 'ema_by_hand': True, 'val_only': True, 'destroy': True,
              'cfg': {'ds_config': {'zero_optimization': {'stage': 3}},
                      'custom_hooks': [{'type': 'RecorderHook'}, {'type': 'EMAHook'}]}}]
ONE_RANK = [scenario('z2_first', 2, destroy=True), scenario('z3_first', 3, destroy=True),
            scenario('z3_again', 3, destroy=True),
            # a weights-only checkpoint of 2 ranks at ZeRO-3, resumed on 1 rank at ZeRO-2
            {'name': 'wo_reshard', 'save_after': {'again.pth': False}, 'cfg': {
                **LAYERED_BF16_Z3, 'max_iters': 3, 'resume': True,
                'load_from': '{out2}/wo_straight/iter_3.pth',
                'ds_config': {'zero_optimization': {'stage': 2}, 'bf16': {'enabled': True}}}}]


@pytest.fixture(scope='module')
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    found: dict[Any, Any] = {}
    for nproc, scenarios in ((2, TWO_RANKS), (1, ONE_RANK)):
        out = str(tmp_path_factory.mktemp(f'contract{nproc}'))
        if 'out2' in found:
            scenarios = json.loads(json.dumps(scenarios).replace('{out2}', found['out2']))
        found[f'log{nproc}'] = launch_scenarios('tests/dist/contract_worker.py', out, scenarios,
                                                nproc=nproc)
        found[f'out{nproc}'] = out
        found[nproc] = {s['name']: [torch.load(osp.join(out, f'{s["name"]}.rank{r}.pt'),
                                               weights_only=False) for r in range(nproc)]
                        for s in scenarios}
    return found


@pytest.mark.parametrize('nproc', [2, 1])
def test_a_runner_after_another_trains_the_same(results: dict, nproc: int) -> None:
    """After destroy_process_group() (DeepSpeed kept the dead world's groups, and the
    rendezvous store its addresses) and without it, at every stage."""
    runs = results[nproc]
    for name in runs:
        assert 'accuracy' in runs[name][0]['metrics'], name
    pairs = [('z3_first', 'z3_again')] + ([('z2_first', 'z2_again')] if nproc == 2 else [])
    for first, again in pairs:
        for a, b in zip(runs[first], runs[again]):
            for key in a['state']:
                assert torch.equal(a['state'][key], b['state'][key]), (first, key)


def test_build_optim_wrapper_is_mmengines_factory(results: dict) -> None:
    """Called by the user it builds MMEngine's wrappers, any number of times, touching no
    engine; train() then trains with whatever runner.optim_wrapper is (the last one)."""
    rank = results[2]['factory'][0]
    assert rank['factory_types'] == ['OptimWrapper'] * 3 and rank['factory_same']
    assert rank['engines_before_train'] == 0
    assert rank['client_optimizer'] == 'AdamW'
    assert 0.01 * 0.5 <= rank['lrs'][0] <= 0.01  # AdamW's lr under LinearLR (the config: 0.1)
    again = results[2]['z3_again'][0]
    assert again['rebuilt'] == 'OptimWrapper' and again['still'] == 'DeepSpeedOptimWrapper'
    assert again['engines_after_rebuild'] == 1


def test_deepcopy_gives_the_model_with_its_weights(results: dict) -> None:
    """copy.deepcopy(runner.model), as custom EMA hooks, teachers and TTA wrappers do: the
    user's model, whole (ZeRO-3 gathered), without DeepSpeed's hooks, computing what the
    engine computes."""
    for name in ('z0', 'z1', 'z2_first', 'z3_first'):
        for rank in results[2][name]:
            assert rank['copy_type'] == 'ToyModel' and rank['copy_hooks'] == 0, name
            for key, value in rank['state'].items():
                assert torch.equal(value, rank['copy_state'][key]), (name, key)
            assert torch.allclose(rank['copy_out'], rank['model_out'], atol=1e-6), name


def test_resume_before_train_continues_exactly(results: dict) -> None:
    """runner.resume(path) or load_or_resume() before train() (a ZeRO-2 checkpoint, which
    the evaluation engine used to refuse as ZeRO-0): train() then ends where the straight
    run ends. val() with resume=True validates the checkpoint's weights."""
    runs = results[2]
    for name in ('resume_first', 'load_or_resume_first'):
        for straight, resumed in zip(runs['straight'], runs[name]):
            for key, value in straight['state'].items():
                assert torch.equal(value, resumed['state'][key]), (name, key)
    checkpoint = consolidated_state_dict(osp.join(results['out2'], 'straight', 'iter_4.pth'))
    for rank in runs['val_resumed']:
        for key, value in checkpoint.items():
            assert torch.equal(value.float(), rank['state'][key]), key


def test_published_keys_publish_one_file_mmengine_loads(results: dict) -> None:
    """CheckpointHook(published_keys=[...]) read the checkpoint as one file and crashed
    after_train; now the last checkpoint is published as MMEngine names it."""
    from mmengine.runner import load_checkpoint

    from tests.helpers import ToyModel
    files = glob.glob(osp.join(results['out2'], 'published', 'iter_3-*.pth'))
    assert len(files) == 1 and re.fullmatch(r'iter_3-[0-9a-f]{8}\.pth', osp.basename(files[0]))
    published = torch.load(files[0], weights_only=True)
    assert sorted(published) == ['meta', 'state_dict']
    model = ToyModel()
    load_checkpoint(model, files[0], strict=True)
    trained = results[2]['published'][0]['state']
    for key, value in model.state_dict().items():
        assert torch.equal(value.float(), trained[key]), key


def _size(path: str) -> int:
    return sum(osp.getsize(osp.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for key, value in a.items():
        assert torch.equal(value.float(), b[key].float()), (what, key)


def test_save_optimizer_false_writes_the_weights_and_no_optimizer_state(results: dict) -> None:
    """CheckpointHook(save_optimizer=False) used to write DeepSpeed's optimizer partitions
    anyway. Under bf16 ZeRO-3 the weights-only checkpoint holds the fp32 masters: what
    DeepSpeed's zero_to_fp32 makes of a full checkpoint of the same step, bit for bit."""
    from mmengine.runner import load_checkpoint

    from tests.toy_layered import LayeredModel
    folder = osp.join(results['out2'], 'wo_straight')
    for name in ('iter_3.pth', 'iter_6.pth'):
        path = osp.join(folder, name)
        with open(osp.join(path, 'meta.json')) as f:
            assert json.load(f)['optimizer_state'] is False
        assert not glob.glob(osp.join(path, 'deepspeed*')), os.listdir(path)
        assert _size(path) < 0.6 * _size(osp.join(folder, 'full_6.pth'))
    _assert_same(consolidated_state_dict(osp.join(folder, 'iter_6.pth')),
                 consolidated_state_dict(osp.join(folder, 'full_6.pth')), 'masters')
    # weights.pt is an MMEngine checkpoint file of the model
    load_checkpoint(LayeredModel(), osp.join(folder, 'iter_6.pth', WEIGHTS_FILE), strict=True)
    described = describe(osp.join(folder, 'iter_6.pth'))
    assert 'optimizer state: no (weights only)' in described and WEIGHTS_FILE in described


def test_resume_without_optimizer_state_continues_from_the_weights(results: dict) -> None:
    """Resuming a weights-only checkpoint says so once, and restores weights (fp32 masters
    exactly, also for a 0-dim parameter that DeepSpeed's ZeRO-3 set_full_hp_param fails on),
    loop position, data order, schedulers and learning rates; only Adam's moments restart."""
    runs, out = results[2], results['out2']
    assert results['log2'].count('holds no optimizer state') == 2  # 2 runs, on rank 0
    straight, resumed = runs['wo_straight'][0], runs['wo_resumed'][0]
    assert resumed['lrs'] == straight['lrs'][3:]
    # The first resumed step sees the saved weights and the batch the straight run saw.
    assert resumed['losses'][0] == straight['losses'][3]
    assert resumed['losses'][1] != straight['losses'][4]  # fresh Adam moments
    # Resumed, then saved again without a step: every value comes back bit for bit.
    saved = consolidated_state_dict(osp.join(out, 'wo_straight', 'iter_3.pth'))
    _assert_same(saved, consolidated_state_dict(osp.join(out, 'wo_round_trip', 'again.pth')),
                 'round trip')
    # ... also on 1 rank at ZeRO-2 (DeepSpeed's ZeRO-1/2 masters)
    _assert_same(saved, consolidated_state_dict(
        osp.join(results['out1'], 'wo_reshard', 'again.pth')), 'another layout')


def test_save_checkpoint_before_train_and_after_val(results: dict) -> None:
    """runner.save_checkpoint() before train() (ZeRO-3: a model built partitioned) and after
    val() (an engine without optimizer) failed; it saves what exists, as MMEngine's does."""
    for name in ('saves_z3', 'saves_z2', 'z1'):  # z1 then trains
        rank0 = results[2][name][0]
        folder = osp.join(results['out2'], name)
        _assert_same(consolidated_state_dict(osp.join(folder, 'before.pth')),
                     rank0['first_state'], f'{name} before')
        if name != 'z1':
            _assert_same(consolidated_state_dict(osp.join(folder, 'after_val.pth')),
                         rank0['state'], f'{name} after val')


def test_ema_hook_driven_by_hand_swaps_the_averaged_weights(results: dict) -> None:
    """MMEngine's EMAHook tests (and some user hooks) call before_run, then
    before_val_epoch / after_val_epoch, before any engine exists: under ZeRO-3 the averaged
    weights go in and the model's come back, whole; as MMEngine swaps, the averaged model
    holds the trained weights meanwhile, and gets its own back."""
    for rank in results[2]['ema_by_hand']:
        assert rank['parameter_names']
        for name in rank['parameter_names']:
            assert torch.equal(rank['swapped_in'][name],
                               torch.full_like(rank['before'][name], 0.5)), name
            assert torch.equal(rank['ema_swapped_in'][name], rank['before'][name])
            assert torch.equal(rank['ema_swapped_back'][name],
                               torch.full_like(rank['before'][name], 0.5)), name
        for key, value in rank['before'].items():
            assert torch.equal(rank['swapped_back'][key], value), key
        assert 'accuracy' in rank['metrics']  # val() afterwards builds its engine and runs
