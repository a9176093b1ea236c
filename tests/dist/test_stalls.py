"""Nothing in a steady-state iteration makes a GPU wait: counted on 2 CPU ranks.

``stall_worker.py`` counts, per iteration over iterations 10-39 (LoggerHook's
interval 10), device synchronizes, host reads of tensor values and
``torch.distributed`` collectives, by issuer. This package and MMEngine together
stay within 0.3 host reads, 0.1 collectives and no synchronize per iteration, at
every ZeRO stage, with one optimizer and several (a GAN), with EMAHook, under a layout
(virtual ranks' streams and buffers switched per micro-step, each one's batch split, and
split again after an out-of-memory retry);
DeepSpeed
issues no synchronize unless the ds_config asks for its timers.

ZeRO-0 in fp32 is where this package itself skips non-finite updates
(``engine/nonfinite.py``): with a fused optimizer (``fused=True``, as these scenarios
use at ZeRO-0) the decision stays on the device; with any other, it costs one host
read per update, as ``torch.amp.GradScaler``'s does, and no more (``z0_unfused``).
"""
from __future__ import annotations

import json
import os.path as osp
from typing import Any

import pytest

from tests.helpers import launch_scenarios
from tests.toy_gan import ADAM

pytestmark = pytest.mark.dist


def zero(stage: int, **extra: Any) -> dict:
    return {'zero_optimization': {'stage': stage}, **extra}


def fused(stage: int) -> dict:
    """The optimizers, fused at ZeRO-0 (skipped on the device when not finite)."""
    return {'optimizer': {'type': 'SGD', 'lr': 0.1, 'momentum': 0.9, 'fused': stage == 0}}


def gan_fused(stage: int) -> dict:
    adam = dict(ADAM, fused=stage == 0)
    return {'optim_wrapper': dict(constructor='SubmoduleOptimWrapperConstructor',
                                  generator=dict(optimizer=adam, accumulative_counts=2),
                                  discriminator=dict(optimizer=adam,
                                                     clip_grad=dict(max_norm=1.0)))}


EMA = [{'type': 'EMAHook', 'momentum': 0.1}]
SCENARIOS: list[dict[str, Any]] = [
    *({'name': f'z{s}', 'cfg': {'ds_config': zero(s), 'with_bn': False, **fused(s)}}
      for s in range(4)),
    *({'name': f'gan_z{s}', 'model': 'gan', 'cfg': {'ds_config': zero(s), **gan_fused(s)}}
      for s in (0, 3)),
    *({'name': f'ema_z{s}', 'cfg': {'ds_config': zero(s), 'with_bn': False,
                                    'custom_hooks': EMA, **fused(s)}} for s in (0, 3)),
    # a layout: each virtual rank's streams and BatchNorm buffers switched per micro-step,
    # its batch in 2 micro-batches (their logged losses averaged on the device)
    {'name': 'layout_z2', 'cfg': {'ds_config': zero(2), 'with_bn': True, 'layout': {
        'world_size': 4, 'micro_batches': 2, 'split_batchnorm': True}, **fused(2)}},
    # micro_batches='auto' after rank 1 ran out of memory (a test double) in the first
    # forward: every batch split again in this process, each iteration
    {'name': 'layout_retried_z1', 'out_of_memory_on_rank1': {'at': [1], 'in': 'forward'},
     'cfg': {'ds_config': zero(1), 'with_bn': False, **fused(1),
             'layout': {'world_size': 4, 'micro_batches': 'auto'}}},
    {'name': 'z0_unfused', 'cfg': {'ds_config': zero(0), 'with_bn': False}},
    # DeepSpeed's timer when asked for: its synchronizes are counted
    {'name': 'timers_z2', 'cfg': {'ds_config': zero(2, timers={'throughput': {
        'enabled': True, 'synchronized': True}}), 'with_bn': False}},
]
CHECKED = [s['name'] for s in SCENARIOS if s['name'] not in ('timers_z2', 'z0_unfused')]


@pytest.fixture(scope='module')
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = str(tmp_path_factory.mktemp('stalls'))
    launch_scenarios('tests/dist/stall_worker.py', out, SCENARIOS, 2)
    found = {}
    for scenario in SCENARIOS:
        for rank in range(2):
            with open(osp.join(out, f'{scenario["name"]}.rank{rank}.json')) as f:
                found[f'{scenario["name"]}/{rank}'] = json.load(f)
    return found


def _ours(result: dict[str, Any], kind: str) -> float:
    counted = result['per_iteration']
    return counted.get(f'{kind}/ours', 0.0) + counted.get(f'{kind}/mmengine', 0.0)


@pytest.mark.parametrize('name', CHECKED)
def test_this_package_and_mmengine_make_no_gpu_wait(counts: dict, name: str) -> None:
    for rank in range(2):
        result = counts[f'{name}/{rank}']
        where = json.dumps(result['sites'], indent=1)
        assert _ours(result, 'sync') == 0, where
        assert _ours(result, 'read') <= 0.3, where
        assert _ours(result, 'collective') <= 0.1, where
        assert result['per_iteration'].get('sync/deepspeed', 0) == 0, result['per_iteration']


def test_the_retried_layout_is_counted_split(counts: dict) -> None:
    """The out-of-memory retry ran (its agreements go through the store, in the first
    iterations only): the counted iterations split every batch again."""
    assert counts['layout_retried_z1/0']['split'] == counts['layout_retried_z1/1']['split'] == 2


def test_the_count_sees_what_it_counts(counts: dict) -> None:
    """DeepSpeed's own collectives (gradient reduction) and, when the ds_config asks for
    them, its timer's two synchronizes per iteration."""
    assert counts['z2/0']['per_iteration']['collective/deepspeed'] >= 1
    assert counts['timers_z2/0']['per_iteration']['sync/deepspeed'] == 2


def test_an_unfused_optimizer_at_zero0_fp32_costs_one_read_per_update(counts: dict) -> None:
    """The decision to skip a non-finite update, which PyTorch's unfused optimizers cannot
    take on the device: one host read per update, and nothing else beyond the budget."""
    for rank in range(2):
        result = counts[f'z0_unfused/{rank}']
        decision = sum(n for site, n in result['sites'].items() if site.startswith('read ')
                       and 'mmengine_deepspeed/engine/nonfinite.py:' in site)
        assert decision == 1.0, result['sites']
        assert _ours(result, 'read') <= 1.3 and _ours(result, 'sync') == 0, result['sites']
