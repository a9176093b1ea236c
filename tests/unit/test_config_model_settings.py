"""model_settings.py: the ds_config settings that depend on the model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mmengine_deepspeed.config.model_settings import (
    DEEPSPEED_REDUCE_BUCKET,
    ZERO3_FLOOR,
    fit_zero_sizes,
    match_norm_buffers,
    zero3_sizes,
    zero12_sizes,
)
from tests.helpers import ToyModel


def test_bf16_with_batchnorm_casts_buffers() -> None:
    ds: dict = {'bf16': {'enabled': True}}
    match_norm_buffers(ds, ToyModel(with_bn=True))
    assert ds['data_types'] == {'buffer_dtype': 'bf16'}


def test_buffer_dtype_left_alone_without_norm_or_when_set() -> None:
    ds: dict = {'bf16': {'enabled': True}}
    match_norm_buffers(ds, ToyModel(with_bn=False))
    assert 'data_types' not in ds
    ds = {'bf16': {'enabled': True}, 'data_types': {'buffer_dtype': 'fp32'}}
    match_norm_buffers(ds, ToyModel(with_bn=True))
    assert ds['data_types']['buffer_dtype'] == 'fp32'
    ds = {}
    match_norm_buffers(ds, ToyModel(with_bn=True))
    assert ds == {}


def test_zero3_sizes_follow_the_largest_layer() -> None:
    """Buckets hold the largest layer, two are live, sub-groups are at most 16 per engine;
    a frozen layer counts for gathering (it is gathered too) but not for the optimizer.
    Built on the meta device: the sizes need shapes only."""
    with torch.device('meta'):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 3072), nn.Linear(3072, 8))
        many = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(40)])
    model[0].requires_grad_(False)
    ds: dict = {'zero_optimization': {'stage': 3}}
    fit_zero_sizes(ds, model)
    layer = 4096 * 4096 + 4096
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ZERO3_FLOOR < trainable < layer
    assert ds['zero_optimization'] == dict(
        stage=3, reduce_bucket_size=trainable, stage3_prefetch_bucket_size=layer,
        stage3_max_live_parameters=2 * layer, stage3_max_reuse_distance=2 * layer,
        sub_group_size=layer)
    sizes = zero3_sizes(many)
    assert sizes['reduce_bucket_size'] == layer
    assert sizes['sub_group_size'] == -(-40 * layer // 16) > layer


def test_a_small_model_keeps_one_bucket_and_stays_gathered() -> None:
    model = ToyModel(with_bn=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sizes = zero3_sizes(model)
    assert sizes['reduce_bucket_size'] == trainable  # one bucket, no larger than the grads
    assert sizes['stage3_max_live_parameters'] == 2 * ZERO3_FLOOR
    assert sizes['sub_group_size'] == ZERO3_FLOOR


def test_zero3_sizes_keep_each_explicit_value() -> None:
    ds: dict = {'zero_optimization': {'stage': 3, 'reduce_bucket_size': 123,
                                      'sub_group_size': 10**9}}
    fit_zero_sizes(ds, ToyModel(with_bn=False))
    zero = ds['zero_optimization']
    assert zero['reduce_bucket_size'] == 123 and zero['sub_group_size'] == 10**9
    assert zero['stage3_max_live_parameters'] == 2 * zero['stage3_prefetch_bucket_size']


@pytest.mark.parametrize('ds', [
    {'zero_optimization': {'stage': 0}},  # ZeRO-0 allocates no bucket
    {},
])
def test_zero_sizes_left_alone_at_zero0(ds: dict) -> None:
    before = copy.deepcopy(ds)
    fit_zero_sizes(ds, ToyModel(with_bn=False))
    assert ds == before


@pytest.mark.parametrize('stage', [1, 2])
def test_zero12_bucket_follows_the_model(stage: int) -> None:
    """ZeRO-1/2's gradient bucket (allocated at every backward, and filled whole under
    deterministic mode) is one layer-sized bucket, at most the trainable elements, instead
    of DeepSpeed's 5e8; nothing else is set (the all-gather bucket allocates nothing)."""
    with torch.device('meta'):
        big = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])
    ds: dict = {'zero_optimization': {'stage': stage}}
    fit_zero_sizes(ds, big)
    layer = 4096 * 4096 + 4096
    assert ds['zero_optimization'] == {'stage': stage, 'reduce_bucket_size': layer}
    small = ToyModel(with_bn=False)
    trainable = sum(p.numel() for p in small.parameters() if p.requires_grad)
    assert zero12_sizes(small) == {'reduce_bucket_size': trainable}
    assert trainable < ZERO3_FLOOR < DEEPSPEED_REDUCE_BUCKET


def test_zero12_bucket_keeps_an_explicit_value() -> None:
    ds: dict = {'zero_optimization': {'stage': 2, 'reduce_bucket_size': DEEPSPEED_REDUCE_BUCKET}}
    fit_zero_sizes(ds, ToyModel(with_bn=False))
    assert ds['zero_optimization']['reduce_bucket_size'] == DEEPSPEED_REDUCE_BUCKET
