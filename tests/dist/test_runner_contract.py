"""MMEngine's Runner contract beyond train(): several runners in one process, deep copies.

Two launches (see ``contract_worker.py``): 2 ranks through ZeRO 0-3, and 1 rank. A runner
trains after another one in the same process, with or without
``torch.distributed.destroy_process_group()`` in between, and gives the weights the first
one gave with the same config.
"""
from __future__ import annotations

import glob
import os.path as osp
import re
from typing import Any

import pytest
import torch

from mmengine_deepspeed.checkpoint.export import consolidated_state_dict
from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist


Z2 = {'ds_config': {'zero_optimization': {'stage': 2}}}
EVERY_4 = {'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False}


def scenario(name: str, stage: int, **extra: object) -> dict:
    return {'name': name, 'cfg': {'ds_config': {'zero_optimization': {'stage': stage}},
                                  'max_iters': 3}, **extra}


TWO_RANKS = [scenario('z2_first', 2, deepcopy=True), scenario('z2_again', 2, destroy=True),
             scenario('z0', 0, destroy=True, deepcopy=True),
             scenario('z1', 1, destroy=True, deepcopy=True),
             scenario('z3_first', 3, destroy=True, deepcopy=True),
             scenario('z3_again', 3, rebuild=True, destroy=True),
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
              'cfg': {**Z2, 'resume': True, 'load_from': '{out}/straight/iter_4.pth'}}]
ONE_RANK = [scenario('z2_first', 2, destroy=True), scenario('z3_first', 3, destroy=True),
            scenario('z3_again', 3, destroy=True)]


@pytest.fixture(scope='module')
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    found: dict[Any, Any] = {}
    for nproc, scenarios in ((2, TWO_RANKS), (1, ONE_RANK)):
        out = str(tmp_path_factory.mktemp(f'contract{nproc}'))
        launch_scenarios('tests/dist/contract_worker.py', out, scenarios, nproc=nproc)
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


def test_second_build_optim_wrapper_says_what_happened(results: dict) -> None:
    message = results[2]['z3_again'][0]['rebuild_error']
    assert 'already built with their optimizers' in message and 'val()/test()' not in message


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
