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

from typing import Any, Optional

import torch
from mmengine.model import BaseModel, BaseModule
from mmengine.model.weight_init import trunc_normal_
from mmengine.registry import MODELS
from torch import nn

from tests.helpers import IN_FEATURES, NUM_CLASSES, ToyPreprocessor  # noqa: F401  registers


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
