"""A deep model shaped like an OpenMMLab one, for partitioned construction (zero.Init).

``LayeredModel`` has what initialisation under ZeRO-3 gets wrong: an
``init_cfg`` list (Normal for Linear layers, Constant for BatchNorm, Xavier
and Kaiming overriding one layer each), a ``backbone`` with ``Pretrained`` + ``prefix``
when a checkpoint is given, a model ``init_weights`` that calls
``trunc_normal_`` on a parameter and ``.data.normal_()`` on a frozen layer,
tied weights, a 0-dim parameter, a buffer, BatchNorm and a custom data
preprocessor. Importing this module registers it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from mmengine.model import BaseModel, BaseModule
from mmengine.model.weight_init import trunc_normal_
from mmengine.registry import MODELS
from torch import nn

from tests.helpers import (  # noqa: F401  ToyPreprocessor: registers it
    IN_FEATURES,
    NUM_CLASSES,
    ToyPreprocessor,
    _outputs,
)


class Block(BaseModule):
    """Linear, BatchNorm, residual.

    No bias before the norm, as mmcv's ``ConvModule`` (``bias='auto'``):
    its gradient is zero in exact arithmetic, and Adam turns the rounding
    noise left there into full steps of either sign.
    """

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.fc(x)))


class Backbone(BaseModule):
    """Stem and blocks; ``init_cfg`` may load a checkpoint under a prefix."""

    def __init__(self, width: int, depth: int, init_cfg: Optional[Any] = None):
        super().__init__(init_cfg=init_cfg)
        self.stem = nn.Linear(IN_FEATURES, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))


@MODELS.register_module()
class LayeredModel(BaseModel):
    """A classifier ``depth`` blocks deep; see the module docstring.

    Args:
        width (int): Block width. Defaults to 16.
        depth (int): Number of blocks. Defaults to 3.
        pretrained (str, optional): A checkpoint of this model whose
            ``backbone.`` weights the backbone loads in ``init_weights``.
            Defaults to None.
    """

    def __init__(self, width: int = 16, depth: int = 3, pretrained: Optional[str] = None):
        super().__init__(
            data_preprocessor=dict(type='ToyPreprocessor'),
            init_cfg=[dict(type='Normal', layer='Linear', std=0.05, bias=0.01,
                           override=[dict(type='Xavier', name='head'),
                                     dict(type='Kaiming', name='neck')]),
                      dict(type='Constant', layer='BatchNorm1d', val=1.0, bias=0.0)])
        backbone_init = None if pretrained is None else dict(
            type='Pretrained', checkpoint=pretrained, prefix='backbone.')
        self.backbone = Backbone(width, depth, init_cfg=backbone_init)
        self.neck = nn.Linear(width, width)
        self.head = nn.Linear(width, NUM_CLASSES)
        # Tied: the auxiliary input projection is the stem's weight.
        self.aux = nn.Linear(IN_FEATURES, width, bias=False)
        self.aux.weight = self.backbone.stem.weight
        self.pos = nn.Parameter(torch.zeros(width))
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.register_buffer('gain', torch.linspace(0.5, 1.5, NUM_CLASSES))

    def init_weights(self) -> None:
        """MMEngine's init_cfg, then direct writes as many OpenMMLab models make."""
        super().init_weights()
        trunc_normal_(self.pos, std=0.2)
        self.frozen.weight.data.normal_(0.0, 0.1)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        features = self.backbone(inputs) + self.pos + 0.1 * self.aux(inputs)
        features = features + 0.1 * self.frozen(features) + 0.1 * self.neck(features)
        logits = self.head(features) * self.logit_scale.exp() * self.gain
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits.float(), labels))
        if mode == 'predict':
            return [dict(pred=p, label=t) for p, t in zip(logits.argmax(1), labels)]
        return logits


class PriorGenerator:
    """Not a module, as MMDetection's ``AnchorGenerator``: plain tensors built from
    numpy and lists in ``__init__`` with the legacy ``torch.Tensor(...)`` constructor."""

    def __init__(self, strides: list[int], ratios: list[float], scales: Any):
        self.strides = torch.Tensor(strides)            # a list of ints: data, not a shape
        self.ratios = torch.Tensor(ratios)              # a list of floats
        self.scales = torch.Tensor(np.asarray(scales))  # a numpy array
        self.grid = torch.Tensor(2, 3).fill_(1.0)       # a shape
        self.like = torch.Tensor(self.scales)           # a tensor
        self.base = torch.tensor(np.outer(self.ratios.numpy(), self.scales.numpy()))


@MODELS.register_module()
class TensorsInInitModel(BaseModel):
    """A model whose ``__init__`` does with tensors what real model code does.

    A prior generator (above), a buffer from numpy, a ``new_tensor`` of a
    parameter, a sinusoidal positional encoding computed in fp32, a Python list
    from ``torch.linspace(...).item()`` (SegFormer's drop-path rates), BatchNorm
    and dropout; all of it used in ``forward``.
    """

    def __init__(self, width: int = 16, positions: int = 600):
        super().__init__(data_preprocessor=dict(type='ToyPreprocessor'))
        self.prior = PriorGenerator([8, 16], [0.5, 1.0, 2.0], [4.0, 8.0])
        self.stem = nn.Linear(IN_FEATURES, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, NUM_CLASSES)
        self.drop_rates = [x.item() for x in torch.linspace(0, 0.2, 3)]
        self.dropout = nn.Dropout(self.drop_rates[1])
        self.register_buffer('mean', torch.from_numpy(np.linspace(-1, 1, width,
                                                                  dtype=np.float32)))
        self.register_buffer('offsets', self.head.weight.new_tensor([0.5, -0.5, 0.25, 0.0]))
        position = torch.arange(positions, dtype=torch.float32).unsqueeze(1)
        rate = torch.exp(torch.arange(0, width, 2).float() * (-math.log(10000.0) / width))
        encoding = torch.zeros(positions, width)
        encoding[:, 0::2] = torch.sin(position * rate)
        encoding[:, 1::2] = torch.cos(position * rate)
        self.register_buffer('encoding', encoding)

    def plain_tensors(self) -> dict[str, torch.Tensor]:
        """The prior generator's tensors and the drop rates (no module holds them)."""
        found = {k: v for k, v in vars(self.prior).items() if isinstance(v, torch.Tensor)}
        return dict(found, drop_rates=torch.tensor(self.drop_rates))

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        scale = (self.prior.base.mean() + self.prior.strides.sum() + self.prior.grid.sum()
                 + self.prior.like.mean()).float() / 100.0
        x = self.stem(inputs) * scale + self.mean + self.encoding[-1]
        x = self.dropout(torch.relu(self.norm(x)))
        return _outputs(self.head(x) + self.offsets, labels, mode)


@MODELS.register_module()
class ParentInitModel(TensorsInInitModel):
    """A parent's ``__init__`` working on layers already built, which zero.Init has
    partitioned by then: an initialiser drawing random numbers on one (MMCV's
    ``ConvModule`` initialises its conv so; every later draw depends on it), a layer built
    after that, ``.data.fill_``, ``self.apply(fn)``, and a weight's values read into a
    buffer."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        nn.init.kaiming_normal_(self.stem.weight, mode='fan_out')
        self.head = nn.Linear(self.stem.out_features, NUM_CLASSES)
        self.head.bias.data.fill_(0.5)
        self.apply(_norm_to_two)
        weight = self.stem.weight.view(self.stem.out_features, IN_FEATURES)
        self.register_buffer('stem_norm', weight.norm(dim=0))


def _norm_to_two(module: nn.Module) -> None:
    if isinstance(module, nn.BatchNorm1d):
        nn.init.constant_(module.weight, 2.0)


@MODELS.register_module()
class LazyInInitModel(TensorsInInitModel):
    """A lazy layer materialised by a dry run in ``__init__``: zero.Init cannot partition
    its uninitialised parameters, so the model is built whole instead."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.head = nn.LazyLinear(NUM_CLASSES)
        self.head(torch.zeros(1, self.stem.out_features))
