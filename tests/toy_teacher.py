"""Models that own part of their training math, as self-supervised ones do.

``ToyTeacherModel`` follows MMPretrain's BYOL: an averaged copy of its encoder
(MMEngine's ``ExponentialMovingAverage``, the base of MMPretrain's ``CosineEMA``)
that its ``loss`` updates from the online encoder and then reads for a target.
Importing this module registers it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from mmengine.model import ExponentialMovingAverage
from mmengine.registry import MODELS
from torch import nn

from tests.helpers import ToyModel, _outputs


@MODELS.register_module()
class ToyTeacherModel(ToyModel):
    """A classifier whose loss also pulls its features towards an EMA teacher's.

    Args:
        momentum (float): The teacher's EMA momentum. Defaults to 0.2.
        **kwargs: ``ToyModel``'s arguments.
    """

    def __init__(self, momentum: float = 0.2, **kwargs: Any):
        super().__init__(**kwargs)
        self.teacher = ExponentialMovingAverage(self.encoder(), momentum=momentum)

    def encoder(self) -> nn.Module:
        """The online encoder, as BYOL passes it to its target's update (built per call)."""
        return nn.Sequential(self.fc1, self.norm)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = super().forward(inputs)
        if mode != 'loss':
            return _outputs(logits, labels, mode)
        with torch.no_grad():
            self.teacher.update_parameters(self.encoder())
            target = self.teacher(inputs)
        online = self.encoder()(inputs)
        losses = _outputs(logits, labels, mode)
        losses['loss_teacher'] = nn.functional.mse_loss(online, target)
        return losses
