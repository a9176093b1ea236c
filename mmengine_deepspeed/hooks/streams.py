"""A checkpoint taken just before a validation in training gets the streams after it."""
from __future__ import annotations

from typing import Any

from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from typing_extensions import override

from ..strategy import strategy_of


@HOOKS.register_module()
class StreamsAfterValidationHook(Hook):
    """A checkpoint taken just before a validation in training gets the streams after it.

    Validation draws from the training's random streams (as with Runner); a
    run resumed from the checkpoint saved at that iteration must go on from
    the streams the validation left, as the run that never stopped did. Each
    rank rewrites its per-rank state in that checkpoint (``Checkpointer``).
    """

    priority = 'LOWEST'

    def __init__(self) -> None:
        self._training = False

    @override
    def before_train(self, runner: Any) -> None:
        self._training = True

    @override
    def after_train(self, runner: Any) -> None:
        self._training = False

    @override
    def after_val(self, runner: Any) -> None:
        if self._training:
            strategy_of(runner, 'StreamsAfterValidationHook').checkpointer.after_validation(
                runner.epoch, runner.iter)
