"""ds_config settings that depend on the model, applied just before ``deepspeed.initialize``.

resolve.py resolves the ds_config from the MMEngine config alone; some settings
can only be right once the model is known. Each is applied only where the
user left it to DeepSpeed, and an explicit value is always kept.
"""
from __future__ import annotations

import torch
from torch import nn

from ..compat import full_numel
from .resolve import precision, zero_stage

# DeepSpeed 0.19's default zero_optimization.reduce_bucket_size, in elements: the cap.
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# The least a bucket or ZeRO-3 limit is sized to, in elements (40 MB in fp32): a small
# model keeps DeepSpeed's behaviour (one bucket, everything gathered), which measured
# 25-30 % faster per iteration on CPU than layer-sized buckets for a 1.4M-parameter GPT.
ZERO3_FLOOR = 10_000_000


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


def largest_layer(model: nn.Module) -> int:
    """The most parameter elements one module holds itself (its own, not its children's):
    what ZeRO-3 gathers at once, and what its buffers are sized to."""
    return max((sum(full_numel(p) for p in module.parameters(recurse=False))
                for module in model.modules()), default=0)


def _layer_elements(model: nn.Module) -> tuple[int, int]:
    """(the bucket-sized layer ``L``: the largest layer, at least :data:`ZERO3_FLOOR`, at most
    DeepSpeed's default bucket; the trainable elements)."""
    largest = largest_layer(model)
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return min(DEEPSPEED_REDUCE_BUCKET, max(ZERO3_FLOOR, largest)), trainable


def reduce_bucket(model: nn.Module) -> int:
    """``reduce_bucket_size`` sized to ``model``: one layer-sized bucket, no larger than the
    trainable elements (a bucket of more is never filled), at any ZeRO stage."""
    layer, trainable = _layer_elements(model)
    return max(1, min(layer, trainable))


def zero12_sizes(model: nn.Module) -> dict[str, int]:
    """ZeRO-1/2's gradient bucket sized to ``model`` rather than to billions of parameters.

    DeepSpeed's ZeRO-1/2 optimizer allocates ``reduce_bucket_size`` elements with
    ``torch.empty`` at every backward (``setup_buckets``; twice with ``overlap_comm``),
    in fp32 at ZeRO-1. The default, 5e8 elements, is 2 GB: on a GPU it is held
    whether or not it is written, and under MMEngine's ``deterministic=True``
    torch fills every ``torch.empty`` (``fill_uninitialized_memory``), so all of
    it is written every iteration: 3x ZeRO-0's memory and 5x its time on an
    11M-parameter ResNet (RESULTS.md). One bucket as large as the largest layer
    (at least :data:`ZERO3_FLOOR`), no larger than the trainable elements, costs
    at most one more collective per layer-sized slice of gradients. Each gradient
    element is still reduced once over the same ranks, so results do not change.

    ``allgather_bucket_size`` is left to DeepSpeed: its ZeRO-1/2 gathers the updated
    partitions with ``all_gather_into_tensor`` where the backend has it (the bucket
    is then not read), and otherwise in shards that are views of the flat buffer;
    it allocates nothing, and a smaller value would only cut the gather into more
    collectives.

    Returns:
        dict[str, int]: ``zero_optimization`` keys and values.
    """
    return dict(reduce_bucket_size=reduce_bucket(model))


def zero3_sizes(model: nn.Module) -> dict[str, int]:
    """ZeRO-3's buffer and limit settings sized to ``model`` rather than to billions of parameters.

    DeepSpeed's defaults (1e9 live parameters and reuse distance, 1e9-element
    optimizer sub-groups, a 5e8-element reduce bucket) let ZeRO-3 keep the whole
    model gathered through forward and backward, step the optimizer over the
    whole partition at once and allocate a bucket larger than most models:
    its training peak then exceeds ZeRO-0's (benchmarks/RESULTS.md, section 4).
    As the HF integration's "auto" values do from the hidden size, these scale
    with the largest layer ``L`` (the most parameters one module holds itself,
    at least ``ZERO3_FLOOR``): the prefetch bucket holds one such layer, and so
    does the reduce bucket, which ZeRO-3 allocates up front, unless all
    trainable parameters take less; at most two layers are live (or kept for
    reuse) at once, and the optimizer steps sub-groups of at least ``L``
    elements, at most 16 per engine. Every gradient is still reduced once and
    every parameter gathered when its module runs, so results do not change.
    ``stage3_param_persistence_threshold`` keeps DeepSpeed's default: parameters
    under 1e5 elements stay whole on every rank, which costs little and spares a
    collective to modules only some ranks run.

    Returns:
        dict[str, int]: ``zero_optimization`` keys and values.
    """
    layer, trainable = _layer_elements(model)
    return dict(reduce_bucket_size=reduce_bucket(model),
                stage3_prefetch_bucket_size=layer,
                stage3_max_live_parameters=2 * layer, stage3_max_reuse_distance=2 * layer,
                sub_group_size=max(layer, -(-trainable // 16)))


def fit_zero_sizes(ds_config: dict, model: nn.Module) -> None:
    """Fill the stage's model-sized settings the config leaves unset: :func:`zero12_sizes`
    at ZeRO-1/2, :func:`zero3_sizes` at ZeRO-3, none at ZeRO-0.

    An explicit value is kept, each key on its own.

    Args:
        ds_config (dict): The resolved config, updated in place.
        model (nn.Module): The model about to be wrapped (partitioned or not).
    """
    zero = ds_config.get('zero_optimization')
    stage = zero_stage(ds_config)
    if stage == 0 or not isinstance(zero, dict):
        return
    for key, value in (zero3_sizes if stage == 3 else zero12_sizes)(model).items():
        zero.setdefault(key, value)


def fit_to_model(ds_config: dict, model: nn.Module) -> None:
    """Every model-dependent setting above, applied to ``ds_config`` in place."""
    match_norm_buffers(ds_config, model)
    fit_zero_sizes(ds_config, model)
