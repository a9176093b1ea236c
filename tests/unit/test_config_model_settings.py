"""model_settings.py: the ds_config settings that depend on the model."""
from __future__ import annotations

import copy

import pytest

from mmengine_deepspeed.config.model_settings import fit_reduce_bucket, match_norm_buffers
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


def test_zero3_reduce_bucket_fits_the_trainable_parameters() -> None:
    """DeepSpeed's 5e8-element default would be allocated whole; a frozen part holds no grads."""
    model = ToyModel(with_bn=False)
    next(model.parameters()).requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ds: dict = {'zero_optimization': {'stage': 3}}
    fit_reduce_bucket(ds, model)
    assert ds['zero_optimization']['reduce_bucket_size'] == trainable
    assert 0 < trainable < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('ds', [
    {'zero_optimization': {'stage': 3, 'reduce_bucket_size': 123}},  # the user's choice
    {'zero_optimization': {'stage': 2}},  # ZeRO-1/2 allocate no bucket up front
    {},
])
def test_reduce_bucket_left_alone_when_set_or_not_zero3(ds: dict) -> None:
    before = copy.deepcopy(ds)
    fit_reduce_bucket(ds, ToyModel(with_bn=False))
    assert ds == before
