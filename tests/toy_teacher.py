"""Models that own part of their training math, as self-supervised ones do.

``ToyTeacherModel`` follows MMPretrain's BYOL: an averaged copy of its encoder
(MMEngine's ``ExponentialMovingAverage``, the base of MMPretrain's ``CosineEMA``)
that its ``loss`` updates from the online encoder and then reads for a target.
``ToyMeanTeacherModel`` follows MMDetection's semi-supervised detectors, whose
teacher a hook updates (``MeanTeacherHook``); ``ToyInStepCopyModel`` writes a
weight through ``.data`` in its loss. Importing this module registers them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from mmengine.hooks import Hook
from mmengine.model import BaseModel, ExponentialMovingAverage, is_model_wrapper
from mmengine.registry import HOOKS, MODELS
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


@MODELS.register_module()
class ToyMeanTeacherModel(BaseModel):
    """MMDetection's semi-supervised detectors in small: a student trained on the labels
    and on a frozen teacher's predictions; a hook (``TeacherMomentumHook``) first copies
    the student into the teacher, then moves the teacher towards it every iteration.

    Args:
        data_preprocessor (dict, optional): As ``ToyModel``'s.
    """

    def __init__(self, data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor or dict(type='ToyPreprocessor'))
        self.student = ToyModel(with_bn=False)
        self.teacher = ToyModel(with_bn=False)
        self.teacher.requires_grad_(False)

    def init_weights(self) -> None:
        """The student as ``ToyModel``; the teacher elsewhere, so that only the hook's first
        copy makes it the student."""
        self.student.init_weights()
        with torch.no_grad():
            for param in self.teacher.parameters():
                param.fill_(0.05)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.student(inputs)
        if mode != 'loss':
            return _outputs(logits, labels, mode)
        with torch.no_grad():
            target = self.teacher(inputs).softmax(1)
        losses = _outputs(logits, labels, mode)
        losses['loss_teacher'] = -(logits.log_softmax(1) * target).sum(1).mean()
        return losses


@HOOKS.register_module()
class TeacherMomentumHook(Hook):
    """What MMDetection's ``MeanTeacherHook`` does, under another name: the teacher's
    parameters set from the student's through ``.data``, outside any forward.

    Args:
        momentum (float): The student's weight per update. Defaults to 0.2.
        only_rank (int, optional): Update on this rank only (a rank-dependent branch);
            None: on every rank.
    """

    def __init__(self, momentum: float = 0.2, only_rank: Optional[int] = None):
        self.momentum, self.only_rank = momentum, only_rank

    def before_train(self, runner: Any) -> None:
        if self.only_rank in (None, runner.rank):
            self.momentum_update(self._model(runner), 1.0)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        if self.only_rank in (None, runner.rank):
            self.momentum_update(self._model(runner), self.momentum)

    @staticmethod
    def _model(runner: Any) -> nn.Module:
        return runner.model.module if is_model_wrapper(runner.model) else runner.model

    def momentum_update(self, model: nn.Module, momentum: float) -> None:
        """teacher <- (1 - momentum) * teacher + momentum * student, on ``.data``."""
        for src, dst in zip(model.student.parameters(), model.teacher.parameters()):
            dst.data.mul_(1 - momentum).add_(src.data, alpha=momentum)


@HOOKS.register_module()
class MeanTeacherHook(TeacherMomentumHook):
    """``TeacherMomentumHook`` under MMDetection's name, which the package knows
    (``zero/in_step.py`` HOOK_UPDATES): under ZeRO-3 its update runs on whole tensors."""


@MODELS.register_module()
class ToyInStepCopyModel(ToyModel):
    """A model that copies one layer's weight into another through ``.data`` inside its
    loss (a pattern the package does not know: under ZeRO-3 it stops the first iteration)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.shadow = nn.Linear(self.fc1.in_features, self.fc1.out_features)
        self.shadow.requires_grad_(False)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        if mode == 'loss':
            self.shadow.weight.data.copy_(self.fc1.weight.data)
        return super().forward(inputs, labels, mode)
