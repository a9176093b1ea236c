"""ds_config settings that depend on the model, applied just before ``deepspeed.initialize``.

config.py resolves the ds_config from the MMEngine config alone; some settings
can only be right once the model is known. Each is applied only where the
user left it to DeepSpeed, and an explicit value is always kept.
"""
from __future__ import annotations

import torch
from torch import nn

from ..compat import full_numel
from .resolve import precision, zero_stage

# DeepSpeed 0.19's default zero_optimization.reduce_bucket_size, in elements.
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def _has_running_stats(model: nn.Module) -> bool:
    # BatchNorm*/SyncBatchNorm/InstanceNorm* (and mmcv's variants) by their
    # public attributes rather than torch's private base class.
    return any(getattr(m, 'track_running_stats', False)
               and isinstance(getattr(m, 'running_mean', None), torch.Tensor)
               for m in model.modules())


def match_norm_buffers(ds_config: dict, model: nn.Module) -> None:
    """Cast buffers to the compute dtype when the model has BatchNorm-style layers.

    DeepSpeed 0.19 casts parameters to bf16/fp16 but leaves buffers in fp32
    unless ``data_types.buffer_dtype`` says otherwise. A BatchNorm then gets
    bf16 weights with fp32 running statistics and fails ("expected scalar
    type BFloat16 but found Float"). An explicit ``buffer_dtype`` is kept.

    Args:
        ds_config (dict): The resolved config, updated in place.
        model (nn.Module): The model about to be wrapped.
    """
    mode = precision(ds_config)
    if mode == 'fp32' or not _has_running_stats(model):
        return
    data_types = ds_config.setdefault('data_types', {})
    data_types.setdefault('buffer_dtype', mode)


def fit_reduce_bucket(ds_config: dict, model: nn.Module) -> None:
    """Under ZeRO-3, size the gradient reduce bucket to the model if the config does not.

    ZeRO-3 allocates its whole ``reduce_bucket_size`` buffer when the engine
    is built, and DeepSpeed's default of 5e8 elements is 1.9 GiB per rank in
    fp32 (0.95 GiB in bf16) however small the model. A bucket that holds all
    trainable parameters' gradients at once never fills before the end of
    the backward pass, so capping it there flushes at the same points and
    changes nothing but memory. An explicit ``reduce_bucket_size`` is kept.

    Args:
        ds_config (dict): The resolved config, updated in place.
        model (nn.Module): The model about to be wrapped (not yet partitioned).
    """
    zero = ds_config.get('zero_optimization')
    if zero_stage(ds_config) != 3 or not isinstance(zero, dict) \
            or 'reduce_bucket_size' in zero:
        return
    trainable = sum(full_numel(p) for p in model.parameters()
                    if p.requires_grad)
    zero['reduce_bucket_size'] = max(1, min(DEEPSPEED_REDUCE_BUCKET, trainable))


def fit_to_model(ds_config: dict, model: nn.Module) -> None:
    """Every model-dependent setting above, applied to ``ds_config`` in place."""
    match_norm_buffers(ds_config, model)
    fit_reduce_bucket(ds_config, model)
