"""Models larger than one rank: partitioned construction, offload, activation checkpointing.

One launch on 2 ranks (see ``partitioned_worker.py``), fp32, ZeRO-3 unless
said: the runner builds ``LayeredModel`` from its config inside
``deepspeed.zero.Init`` and must give the tensors it gives without it.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import pytest
import torch

from tests.helpers import launch_scenarios
from tests.toy_layered import LayeredModel

pytestmark = pytest.mark.dist

Z3 = {'zero_optimization': {'stage': 3}}
ADAMW = {'type': 'AdamW', 'lr': 0.01, 'weight_decay': 0.05}
EMA = {'type': 'EMAHook', 'momentum': 0.2}
HOOKS = [{'type': 'RecorderHook'}, {'type': 'InitStateHook'}, EMA]
BIG = {'type': 'LayeredModel', 'width': 1024, 'depth': 48}


def train(name: str, zero_init: bool = True, ds_config: dict = Z3, **cfg: Any) -> dict:
    cfg.setdefault('model', {'type': 'LayeredModel', 'pretrained': '{out}/pretrained.pth'})
    cfg.setdefault('custom_hooks', HOOKS)
    return {'name': name, 'cfg': dict(ds_config=ds_config, zero_init=zero_init, max_iters=4,
                                      optimizer=ADAMW, **cfg)}


Z3_BF16 = dict(Z3, bf16={'enabled': True})
CHECKPOINTING = {'partition_activations': True, 'cpu_checkpointing': True,
                 'contiguous_memory_optimization': False, 'number_checkpoints': 2,
                 'synchronize_checkpoint_boundary': True, 'profile': True}
OFFLOAD = {'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu'}}}
SCENARIOS = [
    {'name': 'memory_init', 'mode': 'memory', 'cfg': {'ds_config': Z3, 'model': BIG}},
    {'name': 'memory_whole', 'mode': 'memory',
     'cfg': {'ds_config': Z3, 'model': BIG, 'zero_init': False}},
    train('whole', zero_init=False),
    train('partitioned'),
    train('load_from', load_from='{out}/pretrained.pth',
          model={'type': 'LayeredModel'}),
    train('offload', ds_config=OFFLOAD),
    *(train(f'{name}_{mode}', zero_init=mode != 'whole', model={'type': model},
            custom_hooks=[{'type': 'InitStateHook'}], ds_config=ds_config)
      for name, model, ds_config in (('tensors', 'TensorsInInitModel', Z3),
                                     ('tensors_bf16', 'TensorsInInitModel', Z3_BF16),
                                     ('parent', 'ParentInitModel', Z3),
                                     ('lazy', 'LazyInInitModel', Z3))
      for mode in ('whole', 'init')),
    train('checkpointing', ds_config=dict(Z3, activation_checkpointing=CHECKPOINTING),
          activation_checkpointing=['backbone.blocks.0', 'backbone.blocks.2']),
]


@pytest.fixture(scope='module')
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], str]:
    out = str(tmp_path_factory.mktemp('partitioned'))
    torch.manual_seed(7)
    pretrained = LayeredModel()
    pretrained.init_weights()
    torch.save(pretrained.state_dict(), osp.join(out, 'pretrained.pth'))
    stdout = launch_scenarios('tests/dist/partitioned_worker.py', out, SCENARIOS, nproc=2)
    return {s['name']: [torch.load(osp.join(out, f'{s["name"]}.rank{r}.pt'), weights_only=False)
                        for r in (0, 1)] for s in SCENARIOS} | {
        'pretrained': [{'state': pretrained.state_dict()}]}, stdout


@pytest.fixture(scope='module')
def results(launched: tuple[dict, str]) -> dict[str, list[dict]]:
    return launched[0]


@pytest.fixture(scope='module')
def log(launched: tuple[dict, str]) -> str:
    return launched[1]


def assert_equal(a: dict, b: dict, keys: Any = None, atol: float = 0.0) -> None:
    for key in keys if keys is not None else a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=atol), \
            (key, (a[key].float() - b[key].float()).abs().max())


def test_construction_holds_half_the_model_per_rank(results: dict) -> None:
    """Each rank's peak RSS rise while the runner is built: at most 0.55x the fp32 model
    with zero.Init on 2 ranks (the limit is 0.5x), about 1x without it."""
    for partitioned, whole in zip(results['memory_init'], results['memory_whole']):
        assert partitioned['partitioned'] and not whole['partitioned']
        assert partitioned['rise_kib'] <= 0.55 * partitioned['model_kib'], partitioned
        assert whole['rise_kib'] >= 0.9 * whole['model_kib'], whole


def test_initialisation_is_exact(results: dict) -> None:
    """init_cfg (Normal, Constant, Xavier and Kaiming overrides, Pretrained with prefix), the
    model's own trunc_normal_ and .data.normal_(), tied weights, the 0-dim parameter, buffers and
    BatchNorm: the same tensors with and without zero.Init, then the same training."""
    for whole, partitioned in zip(results['whole'], results['partitioned']):
        assert partitioned['partitioned'] and not whole['partitioned']
        assert_equal(whole['init_state'], partitioned['init_state'])
        assert_equal(whole['state'], partitioned['state'])
        assert_equal(whole['ema'], partitioned['ema'])
    init = results['partitioned'][0]['init_state']
    pretrained = results['pretrained'][0]['state']
    backbone = [k for k in init if k.startswith('backbone.')]
    assert_equal(pretrained, init, backbone)  # Pretrained(prefix='backbone.') wins
    assert not torch.equal(pretrained['head.weight'], init['head.weight'])
    assert torch.equal(init['aux.weight'], init['backbone.stem.weight'])
    assert init['logit_scale'].shape == torch.Size([])


def test_load_from_streams_into_the_partitioned_model(results: dict) -> None:
    for rank in results['load_from']:
        assert rank['partitioned']
        assert_equal(results['pretrained'][0]['state'], rank['init_state'])


def test_offload_swaps_in_cpu_adam(results: dict) -> None:
    """AdamW from optim_wrapper is stepped by DeepSpeedCPUAdam with the same
    hyper-parameters: the weights match the run without offload."""
    for offload, device in zip(results['offload'], results['partitioned']):
        assert offload['optimizer'] == 'DeepSpeedCPUAdam'
        assert device['optimizer'] == 'AdamW'
        assert_equal(device['state'], offload['state'], atol=1e-5)


def test_deepspeed_activation_checkpointing(results: dict) -> None:
    """With ds_config's activation_checkpointing section, the listed modules run through
    DeepSpeed's checkpoint (partitioned, CPU-checkpointed activations) and train the same
    parameters (BatchNorm statistics see the recomputed forward as well, as with torch's)."""
    for checkpointed, plain in zip(results['checkpointing'], results['partitioned']):
        assert checkpointed['checkpoint_calls'] == 2 * 4  # two modules, four iterations
        assert plain['checkpoint_calls'] == 0
        assert_equal(plain['state'], checkpointed['state'], plain['params'], atol=1e-6)


@pytest.mark.parametrize('name', ['tensors', 'tensors_bf16'])
def test_tensors_made_in_init_build_under_zero_init(results: dict, name: str) -> None:
    """torch.Tensor(ndarray | list of floats | list of ints | shape | tensor), torch.tensor(
    ndarray), new_tensor, a buffer from numpy, an fp32 positional encoding and .item() in
    __init__: built under zero.Init they hold what the model built whole holds (plain tensors
    keep torch's dtype in bf16, as without zero.Init), and train the same."""
    for whole, partitioned in zip(results[f'{name}_whole'], results[f'{name}_init']):
        assert partitioned['partitioned'] and not whole['partitioned']
        assert_equal(whole['init_state'], partitioned['init_state'])
        assert_equal(whole['state'], partitioned['state'])
        for key, value in whole['plain'].items():
            assert value.dtype == partitioned['plain'][key].dtype == torch.float32, key
            assert torch.equal(value, partitioned['plain'][key]), key
        assert whole['plain']['strides'].tolist() == [8.0, 16.0]
        assert whole['plain']['grid'].shape == (2, 3)


def test_a_parent_s_init_on_built_layers_gives_the_whole_model_s_tensors(results: dict) -> None:
    """A parent's __init__ drawing random numbers on a layer zero.Init already partitioned
    (as MMCV's ConvModule does: DeepSpeed alone drew nothing there, and every later layer of
    MMDetection's necks and heads differed from Runner's), filling, applying and reading:
    built partitioned, the same tensors as built whole, and the same training."""
    for whole, partitioned in zip(results['parent_whole'], results['parent_init']):
        assert partitioned['partitioned'] and not whole['partitioned']
        assert_equal(whole['init_state'], partitioned['init_state'])
        assert_equal(whole['state'], partitioned['state'])
        assert torch.equal(partitioned['init_state']['head.bias'], torch.full((4,), 0.5))
        assert torch.equal(partitioned['init_state']['norm.weight'], torch.full((16,), 2.0))


def test_a_model_zero_init_cannot_build_is_built_whole(results: dict, log: str) -> None:
    """A lazy layer materialised in __init__: built whole, with one warning naming the
    model's call and the cost, and the same tensors as zero_init=False."""
    for whole, fallback in zip(results['lazy_whole'], results['lazy_init']):
        assert not fallback['partitioned']
        assert_equal(whole['init_state'], fallback['init_state'])
        assert_equal(whole['state'], fallback['state'])
    assert log.count('zero.Init could not build the model (') == 1  # rank 0 logs
    assert 'toy_layered.py:' in log and 'self.head = nn.LazyLinear(NUM_CLASSES)' in log
    assert 'MiB per rank until DeepSpeed partitions it' in log
