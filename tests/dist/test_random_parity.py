"""Models that draw random numbers give Runner's parameters (the same config, both runners).

``ToyRandomModel`` draws dropout masks and ``torch.randn`` noise in training and noise in
``predict`` (validated during training); ``ToyRandomDataset`` adds torch, numpy and python
noise to every sample in the main process. MMEngine's ``Runner`` (with DDP) and
``DeepSpeedRunner`` at ZeRO 0, 2 and 3 train the same config, fp32, iteration- and
epoch-based, on 1 and on 2 ranks: every parameter within 1e-5, the same losses, the same
validation metrics. (Resuming such runs bit-exactly: ``test_exact_resume.py``; the GAN with
``torch.randn`` in ``train_step``: ``test_gan.py``.)
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios

pytestmark = pytest.mark.dist

LOOPS = {
    'iter': dict(max_iters=12, val_interval=4),
    'epoch': dict(by_epoch=True, max_epochs=3, dataset_size=24),
}
BASE = dict(model={'type': 'ToyRandomModel', 'with_bn': False},
            dataset_type='ToyRandomDataset', optimizer={'type': 'AdamW', 'lr': 0.01})
STAGES = (0, 2, 3)


def scenarios() -> list[dict]:
    runs = []
    for loop, cfg in LOOPS.items():
        runs.append({'name': f'{loop}_runner', 'mode': 'plain', 'cfg': dict(BASE, **cfg)})
        runs += [{'name': f'{loop}_z{stage}', 'cfg': dict(
            BASE, **cfg, ds_config={'zero_optimization': {'stage': stage}})} for stage in STAGES]
    return runs


@pytest.fixture(scope='module', params=[1, 2], ids=['1rank', '2ranks'])
def runs(request: Any, tmp_path_factory: Any) -> tuple[int, dict[str, list[dict]]]:
    nproc = request.param
    out = str(tmp_path_factory.mktemp(f'random_parity_{nproc}'))
    launch_scenarios('tests/dist/worker.py', out, scenarios(), nproc=nproc)
    return nproc, {s['name']: [torch.load(osp.join(out, f'{s["name"]}.rank{r}.pt'))
                               for r in range(nproc)] for s in scenarios()}


@pytest.mark.parametrize('loop', sorted(LOOPS))
@pytest.mark.parametrize('stage', STAGES)
def test_random_models_give_runners_parameters(runs: Any, loop: str, stage: int) -> None:
    nproc, results = runs
    for rank in range(nproc):
        runner, ours = results[f'{loop}_runner'][rank], results[f'{loop}_z{stage}'][rank]
        diffs = {k: (ours['state'][k] - v).abs().max().item() for k, v in runner['state'].items()}
        assert max(diffs.values()) <= 1e-5, (rank, diffs)
        assert ours['losses'] == pytest.approx(runner['losses'], abs=1e-5), rank
        assert len(ours['metrics']) == len(runner['metrics']) > 0
        for mine, theirs in zip(ours['metrics'], runner['metrics']):
            assert mine == pytest.approx(theirs, abs=1e-6), rank


def test_the_runs_really_draw(runs: Any) -> None:
    """Dropout and noise change every loss: the equality above is not trivial."""
    _, results = runs
    losses = results['iter_runner'][0]['losses']
    assert len(set(losses)) == len(losses)
