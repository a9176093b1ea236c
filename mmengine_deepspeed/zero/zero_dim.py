"""0-dim parameters (CLIP's ``logit_scale``, temperatures) through DeepSpeed.

DeepSpeed 0.19 broadcasts parameters as bytes, ``p.data.view(torch.uint8)``,
which torch refuses for a 0-dim tensor ("self.dim() cannot be 0 to view Float
as Byte"). It does so where we go through it:

* ``deepspeed.initialize`` sends rank 0's weights to every rank. Under
  ZeRO 0-2 we broadcast the 0-dim parameters ourselves first and mark them
  the way DeepSpeed marks parameters it must not broadcast
  (``ds_optim_param``, which its ``_broadcast_model`` tests and otherwise
  reads only for LoRA offload); the mark goes as soon as the engine exists.
  Reshaping them instead does not work there: ZeRO-1/2 record the shapes
  they see and reimpose them after every step.
* Under ZeRO-3, partitioning broadcasts again without consulting any mark.
  There the parameters are 1-element, 1-dim during ``initialize``, and the
  full shape ZeRO-3 recorded (``ds_shape``, no public setter) is made 0-dim
  after it; every later gather restores that shape.
* ``GatheredParameters(modifier_rank=...)`` broadcasts written ZeRO-3
  parameters on leaving: the gathered 0-dim ones get a 1-dim view of their
  data just for that (``engine.gathered``).

* ZeRO-0 in fp32 clips gradients one parameter at a time with an in-place
  multiply by a 1-element, 1-dim factor, which a 0-dim gradient refuses.
  For such models the engine's clipping is switched off and
  DeepSpeedOptimWrapper clips instead, with the same formula.

The user's model, its ``state_dict`` and every file we write keep the shape
the model declared. tests/dist/test_patterns.py pins the DeepSpeed
behaviours this relies on.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from ..compat import full_shape, set_full_shape, skip_engine_broadcast
from ..config.resolve import precision, zero_stage

SCALAR_SHAPE = torch.Size([])


def zero_dim_parameters(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The 0-dim parameters among ``params`` (ZeRO-3 ones by their full shape)."""
    return [p for p in params if full_shape(p) == SCALAR_SHAPE]


def engine_config(ds_config: dict, model: nn.Module) -> dict:
    """The ds_config for ``deepspeed.initialize``: ZeRO-0 fp32 clipping moved out if needed.

    Args:
        ds_config (dict): The resolved config (left unchanged).
        model (nn.Module): The bare model about to be wrapped.

    Returns:
        dict: ``ds_config``, or a copy with ``gradient_clipping`` 0 when the
        optim wrapper must clip (ZeRO-0, fp32, trainable 0-dim parameters).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if ds_config.get('gradient_clipping', 0) and precision(ds_config) == 'fp32' \
            and zero_stage(ds_config) == 0 and zero_dim_parameters(trainable):
        return dict(ds_config, gradient_clipping=0.0)
    return ds_config


@contextmanager
def initializable(model: nn.Module, zero3: bool) -> Iterator[None]:
    """Around ``deepspeed.initialize``: 0-dim parameters DeepSpeed can take.

    ZeRO 0-2: rank 0's values are broadcast here, and DeepSpeed's broadcast
    skips the marked parameters. ZeRO-3 also broadcasts while partitioning
    (``zero.Init``, no mark consulted): the parameters are 1-element, 1-dim
    during ``initialize`` and their recorded full shape (``ds_shape``) is
    made 0-dim after it, which every later gather restores.

    Args:
        model (nn.Module): The bare model about to be wrapped.
        zero3 (bool): Whether the engine partitions parameters (ZeRO-3).
    """
    scalars = zero_dim_parameters(model.parameters())
    if zero3:
        with broadcastable(scalars):
            yield
        for param in scalars:
            set_full_shape(param, SCALAR_SHAPE)
        return
    device = deepspeed.get_accelerator().current_device_name()
    for param in scalars:
        if dist.is_initialized() and dist.get_world_size() > 1:
            sent = param.data.to(device)
            dist.broadcast(sent, src=0)
            param.data.copy_(sent)
        skip_engine_broadcast(param, True)
    try:
        yield
    finally:
        for param in scalars:
            skip_engine_broadcast(param, False)


@contextmanager
def broadcastable(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Whole 0-dim parameters are 1-dim inside the block and 0-dim again after it.

    Args:
        params (Iterable[nn.Parameter]): Gathered parameters DeepSpeed is
            about to broadcast; the 0-dim ones among them are reshaped
            (no copy).
    """
    scalars = [p for p in zero_dim_parameters(params) if p.data.numel() == 1]
    for param in scalars:
        param.data = param.data.reshape(1)
    try:
        yield
    finally:
        for param in scalars:
            # A released ZeRO-3 parameter holds an empty placeholder: left alone.
            if param.data.numel() == 1:
                param.data = param.data.view(SCALAR_SHAPE)
