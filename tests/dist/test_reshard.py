"""Resume on another world size or ZeRO stage (DeepSpeed universal checkpoints).

Every run keeps the global batch at 8 (4 per rank on 2 ranks, 8 on 1) and has
no BatchNorm, so a resharded run must continue the straight run's curve: same
losses (averaged over ranks) and weights within 1e-5, which needs AdamW's
moments and step carried over, not only the weights.
"""
from __future__ import annotations

import glob
import json
import os
import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import run_torchrun

pytestmark = pytest.mark.dist

TOLERANCE = 1e-5


def cfg(stage: int, world: int, **extra: Any) -> dict:
    return dict(ds_config={'zero_optimization': {'stage': stage}}, with_bn=False,
                batch_size=8 // world, optimizer={'type': 'AdamW', 'lr': 0.02},
                checkpoint={'type': 'CheckpointHook', 'interval': 4, 'by_epoch': False},
                **extra)


def scenario(name: str, config: dict, **extra: Any) -> str:
    return json.dumps({'name': name, 'cfg': config, **extra})


@pytest.fixture(scope='module')
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp('reshard'))

    def ckpt(run: str) -> str:
        return osp.join(out, run, 'iter_4.pth')

    launches = [
        (2, [scenario('two_z2', cfg(2, 2)), scenario('two_z3', cfg(3, 2))]),
        (1, [scenario('one_z2', cfg(2, 1)), scenario('one_z3', cfg(3, 1)),
             scenario('z2_2to1', cfg(2, 1, resume=True, load_from=ckpt('two_z2'))),
             scenario('z3_2to1', cfg(3, 1, resume=True, load_from=ckpt('two_z3')))]),
        (2, [scenario('z2_1to2', cfg(2, 2, resume=True, load_from=ckpt('one_z2'))),
             scenario('z3_1to2', cfg(3, 2, resume=True, load_from=ckpt('one_z3'))),
             scenario('z2_to_z3', cfg(3, 2, resume=True, load_from=ckpt('two_z2')))]),
    ]
    cached = osp.join(ckpt('two_z2'), 'deepspeed_universal')
    stamps = []
    for nproc, items in launches:
        proc = run_torchrun(['tests/dist/worker.py', out, *items], nproc=nproc, timeout=400)
        assert proc.returncode == 0, proc.stdout[-8000:]
        # the conversion's per-parameter files with their modification times, after each
        # launch (the files around them are adapted to the loading stage, on purpose)
        stamps.append({osp.relpath(p, cached): os.stat(p).st_mtime_ns
                       for p in glob.glob(osp.join(cached, 'zero', '*', '*.pt'))}
                      | ({'CONVERTED': os.stat(osp.join(cached, 'CONVERTED')).st_mtime_ns}
                         if osp.isfile(osp.join(cached, 'CONVERTED')) else {}))
    with open(osp.join(out, 'conversion_stamps.json'), 'w') as f:
        json.dump(stamps, f)
    return out


def _load(out: str, name: str) -> list[dict]:
    ranks = [torch.load(p) for p in sorted(glob.glob(osp.join(out, f'{name}.rank*.pt')))]
    assert ranks, name
    return ranks


def _mean_losses(ranks: list[dict]) -> list[float]:
    return [sum(r['losses'][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]['losses']))]


@pytest.mark.parametrize(('resumed', 'straight'), [
    ('z2_2to1', 'two_z2'), ('z3_2to1', 'two_z3'), ('z2_1to2', 'two_z2'),
    ('z3_1to2', 'two_z3'), ('z2_to_z3', 'two_z2')])
def test_resharded_run_continues_the_straight_curve(out: str, resumed: str, straight: str) -> None:
    ref, got = _load(out, straight), _load(out, resumed)
    diff = max((ref[0]['state'][k] - v).abs().max().item() for k, v in got[0]['state'].items())
    print(f'{resumed}: max abs weight diff vs {straight}: {diff:.2e}')
    assert diff <= TOLERANCE
    assert _mean_losses(got) == pytest.approx(_mean_losses(ref)[4:], abs=TOLERANCE)
    assert got[0]['lrs'] == pytest.approx(ref[0]['lrs'][4:], abs=1e-12)
    assert got[0]['global_steps'] == 8


def test_conversion_is_cached_beside_the_checkpoint_and_reused(out: str) -> None:
    """two_z2's checkpoint is converted by the second launch (to 1 rank) and resumed again
    by the third (to ZeRO-3 on 2 ranks): the third converts nothing, every per-parameter
    file of the conversion is the one the second wrote."""
    with open(osp.join(out, 'conversion_stamps.json')) as f:
        before, after_first, after_reuse = json.load(f)
    assert before == {}
    assert 'CONVERTED' in after_first and len(after_first) > 3
    assert all(after_reuse[name] == stamp for name, stamp in after_first.items()), \
        {n for n, s in after_first.items() if after_reuse.get(n) != s}
