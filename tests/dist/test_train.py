"""DeepSpeedRunner on 2 CPU ranks (gloo) under torchrun, real DeepSpeed.

All scenarios run in one torchrun launch (see ``worker.py``); the tests below
read what each rank wrote. The parity tests compare against a plain MMEngine
``Runner`` on one process with the same global batch, optimizer, schedulers,
clipping, accumulation and seed.
"""
from __future__ import annotations

import json
import os.path as osp
from typing import Any

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from tests.helpers import (
    ToyDataset,
    ToyModel,
    ema_state,
    model_state,
    probe_inputs,
    recorder,
    run_torchrun,
    toy_config,
)

pytestmark = pytest.mark.dist

MICRO_BATCH = 4
WORLD_SIZE = 2

BF16 = {'enabled': True}

TRAIN_SCENARIOS: dict[str, dict[str, Any]] = {
    'zero0': dict(ds_config={'zero_optimization': {'stage': 0}}),
    'zero1_epochs': dict(by_epoch=True, ds_config={'zero_optimization': {'stage': 1}}),
    'zero2_bf16': dict(ds_config={'zero_optimization': {'stage': 2}, 'bf16': BF16},
                       clip_grad={'max_norm': 1.0}),
    'zero3_bf16_epochs': dict(by_epoch=True,
                              ds_config={'zero_optimization': {'stage': 3}, 'bf16': BF16}),
    'zero3_fp32': dict(ds_config={'zero_optimization': {'stage': 3}}),
    'custom_train_step': dict(model={'type': 'ToyCustomStepModel'},
                              ds_config={'zero_optimization': {'stage': 2}}),
}

# Parity: no BatchNorm (per-rank batch statistics differ from whole-batch ones).
ADAMW = {'type': 'AdamW', 'lr': 0.01, 'weight_decay': 0.05}
EMA = {'type': 'EMAHook', 'momentum': 0.2, 'begin_iter': 2}
RECORDER = {'type': 'RecorderHook'}
# DeepSpeed 0.19's defaults for what the runner sizes to the model (the bucket: larger than
# the toy model, as 5e8 is, without allocating 5e8 elements per rank)
DEEPSPEED_ZERO3_SIZES = dict(reduce_bucket_size=10**6, stage3_prefetch_bucket_size=50_000_000,
                             stage3_max_live_parameters=10**9, stage3_max_reuse_distance=10**9,
                             sub_group_size=10**9)
_LAYER = max(sum(p.numel() for p in m.parameters(recurse=False))
             for m in ToyModel(with_bn=False).modules())
LAYER_SIZES = dict(reduce_bucket_size=_LAYER, stage3_prefetch_bucket_size=_LAYER,
                   stage3_max_live_parameters=2 * _LAYER, stage3_max_reuse_distance=2 * _LAYER,
                   sub_group_size=_LAYER)
PARITY_SCENARIOS: dict[str, dict[str, Any]] = {
    'parity_zero0': dict(ds_config={'zero_optimization': {'stage': 0}},
                         clip_grad={'max_norm': 0.5},
                         paramwise_cfg={'custom_keys': {'fc2': {'lr_mult': 0.5}}}),
    'parity_zero2_accum2': dict(ds_config={'zero_optimization': {'stage': 2}},
                                optimizer=ADAMW, accumulative_counts=2,
                                clip_grad={'max_norm': 0.5}),
    'parity_zero2_accum2_remainder': dict(ds_config={'zero_optimization': {'stage': 2}},
                                          accumulative_counts=2, max_iters=7),
    'parity_zero1': dict(ds_config={'zero_optimization': {'stage': 1}}, optimizer=ADAMW),
    'parity_zero3': dict(ds_config={'zero_optimization': {'stage': 3}},
                         clip_grad={'max_norm': 0.5}),
    # ZeRO-3 with buffers and limits of one layer, as the runner sizes them for a large
    # model (the toy model is below their floor), against DeepSpeed's own defaults; every
    # parameter partitioned (persistence 0), so the limits bind
    'parity_zero3_layer_sizes': dict(
        ds_config={'zero_optimization': dict(LAYER_SIZES, stage=3,
                                             stage3_param_persistence_threshold=0)},
        optimizer=ADAMW),
    'parity_zero3_deepspeed_sizes': dict(
        ds_config={'zero_optimization': dict(DEEPSPEED_ZERO3_SIZES, stage=3,
                                             stage3_param_persistence_threshold=0)},
        optimizer=ADAMW),
    # EMAHook: the averaged weights, and validation on them, as MMEngine computes them.
    'parity_ema_zero0': dict(ds_config={'zero_optimization': {'stage': 0}}, val_interval=4,
                             custom_hooks=[EMA, RECORDER]),
    'parity_ema_zero2': dict(ds_config={'zero_optimization': {'stage': 2}}, val_interval=4,
                             custom_hooks=[EMA, RECORDER]),
    'parity_ema_zero3': dict(ds_config={'zero_optimization': {'stage': 3}}, val_interval=4,
                             custom_hooks=[EMA, RECORDER]),
    # its own train_step calls the model, not the engine: the optim wrapper starts the
    # engine's backward (without, ZeRO-3 accumulation reduced wrongly)
    'parity_custom_step_zero3_accum2': dict(
        model={'type': 'ToyCustomStepModel', 'with_bn': False}, optimizer=ADAMW,
        ds_config={'zero_optimization': {'stage': 3}}, accumulative_counts=2),
}
for _cfg in PARITY_SCENARIOS.values():
    _cfg['with_bn'] = False

TEST_ONLY = {'test_only_zero3': dict(ds_config={'zero_optimization': {'stage': 3}})}


@pytest.fixture(scope='module')
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp('dist_train')
    scenarios = [json.dumps({'name': n, 'cfg': c}) for n, c in
                 {**TRAIN_SCENARIOS, **PARITY_SCENARIOS}.items()]
    scenarios += [json.dumps({'name': n, 'mode': 'test', 'cfg': c}) for n, c in TEST_ONLY.items()]
    proc = run_torchrun(['tests/dist/worker.py', str(out), *scenarios], nproc=WORLD_SIZE,
                        timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    names = [*TRAIN_SCENARIOS, *PARITY_SCENARIOS, *TEST_ONLY]
    return {n: [torch.load(osp.join(out, f'{n}.rank{r}.pt')) for r in range(WORLD_SIZE)]
            for n in names}


def _params_equal_across_ranks(ranks: list[dict]) -> None:
    first = ranks[0]['state']
    for other in ranks[1:]:
        for key, value in first.items():
            if 'running_' in key or 'num_batches' in key:
                continue  # BatchNorm statistics are per rank, as with MMEngine's DDP
            assert torch.equal(value, other['state'][key]), key


@pytest.mark.parametrize('name', list(TRAIN_SCENARIOS))
def test_trains(results: dict, name: str) -> None:
    ranks = results[name]
    cfg = TRAIN_SCENARIOS[name]
    r0 = ranks[0]
    assert r0['world_size'] == WORLD_SIZE and r0['backend'] == 'gloo'
    assert r0['stage'] == cfg['ds_config']['zero_optimization']['stage']
    bf16 = 'bf16' in cfg['ds_config']
    assert r0['param_dtype'] == ('torch.bfloat16' if bf16 else 'torch.float32')
    assert r0['wrapper'] == 'DeepSpeedEngineWrapper'
    assert r0['fc1_through_wrapper']  # runner.model.fc1: the user's submodule
    assert r0['global_steps'] == 8  # one update per iteration, 8 iterations
    losses = r0['losses']
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    assert r0['metrics'] and 'accuracy' in r0['metrics'][-1]
    # DeepSpeed reports the norm except under ZeRO-0 fp32, where we compute it
    # only when clipping asks for it (as MMEngine logs it only with clip_grad).
    if r0['stage'] > 0 or bf16 or 'clip_grad' in cfg:
        assert r0['grad_norm'] is not None and r0['grad_norm'] > 0
    else:
        assert r0['grad_norm'] is None
    # The frozen parameter stayed frozen; the lr the logger sees is scheduled.
    assert torch.equal(r0['state']['frozen'], torch.full((4,), 0.5))
    assert r0['lrs'][0] != r0['lrs'][-1]
    _params_equal_across_ranks(ranks)


def test_custom_train_step_is_called(results: dict) -> None:
    r0 = results['custom_train_step'][0]
    assert r0['module'] == 'ToyCustomStepModel'
    assert 'train/custom_step' in r0['scalars']


def _baseline(tmp_path: Any, cfg: dict) -> dict:
    """Plain MMEngine Runner, one process, no DeepSpeed, the same global batch."""
    kwargs = dict(cfg, ds_config=None, batch_size=MICRO_BATCH * WORLD_SIZE)
    runner_cfg = toy_config(str(tmp_path), **kwargs)
    runner_cfg.pop('ds_config', None)
    runner = Runner.from_cfg(Config(runner_cfg))
    runner.train()
    rec = recorder(runner)
    return dict(state=model_state(runner.model), lrs=rec.lrs, ema=ema_state(runner),
                metrics=rec.metrics)


@pytest.mark.parametrize('name', list(PARITY_SCENARIOS))
def test_parity_with_plain_mmengine(results: dict, tmp_path: Any, name: str) -> None:
    cfg = PARITY_SCENARIOS[name]
    base = _baseline(tmp_path, cfg)
    ours = results[name][0]
    diffs = {k: (ours['state'][k] - v).abs().max().item() for k, v in base['state'].items()}
    worst = max(diffs.values())
    print(f'{name}: max abs diff {worst:.3e}')
    assert worst <= 1e-6, diffs
    assert ours['lrs'] == pytest.approx(base['lrs'], abs=1e-12)
    if base['ema'] is not None:
        ema_diff = max((ours['ema'][k] - v).abs().max().item() for k, v in base['ema'].items())
        print(f'{name}: EMA max abs diff {ema_diff:.3e}')
        assert ema_diff <= 1e-6
        assert ours['metrics'] == base['metrics']  # validation ran on the EMA weights
        assert max((ours['ema'][k] - v).abs().max().item()
                   for k, v in ours['state'].items()) > 1e-3  # EMA differs from the weights
    # The run moved the weights, so the equality above is not trivial.
    init = ToyModel(with_bn=False)
    init.init_weights()
    moved = max((base['state'][k] - v).abs().max().item() for k, v in model_state(init).items())
    assert moved > 1e-2


def test_zero3_layer_sized_limits_train_as_deepspeeds_defaults(results: dict) -> None:
    """What the runner's ZeRO-3 sizes change (config/model_settings.py; the sizes
    themselves are unit-tested) does not change the results."""
    sized, defaults = (results[n][0] for n in ('parity_zero3_layer_sizes',
                                               'parity_zero3_deepspeed_sizes'))
    assert sized['zero_config']['sub_group_size'] == _LAYER
    for key, value in defaults['state'].items():
        torch.testing.assert_close(sized['state'][key], value, rtol=0, atol=1e-6)
    assert sized['losses'] == pytest.approx(defaults['losses'], abs=1e-6)


def test_test_only_builds_engine_without_optimizer(results: dict) -> None:
    for rank in results['test_only_zero3']:
        assert rank['has_optimizer'] is False
        assert rank['stage'] == 3
        # ZeRO-3 without an optimizer: only the parameter-partitioning
        # front-end, no optimizer states.
        assert rank['engine_optimizer'] == 'DeepSpeedZeRoOffload'
    # What the plain model computes with the weights the engine held (BatchNorm in eval
    # mode; MMEngine's test() leaves the weights as built: no init_weights, no load_from).
    data = ToyDataset(size=16, seed=1)
    for rank in results['test_only_zero3']:
        model = ToyModel()
        model.load_state_dict(rank['state'])
        model.eval()
        with torch.no_grad():
            inputs = model.data_preprocessor(dict(inputs=data.inputs, labels=data.labels))
            accuracy = float((model(inputs['inputs']).argmax(1) == data.labels).float().mean())
            probe = model(probe_inputs())
        assert rank['test_metrics']['accuracy'] == pytest.approx(accuracy, abs=1e-6)
        assert torch.allclose(rank['probe_logits'], probe, atol=1e-6)
