"""A checkpoint taken just before a validation in training gets the streams after it; a
layout's virtual ranks draw what the validation drew for its loader."""
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

    Under a layout each rank of the N-rank run validates, creating its own validation
    loader iterator: the rank's other virtual ranks draw that seed too
    (``VirtualRanks.new_loader_iterator``). What the model draws in ``predict`` over the
    validation data is the rank's own (docs/differences.md).
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
            strategy = strategy_of(runner, 'StreamsAfterValidationHook')
            if strategy.virtual_ranks is not None:
                strategy.virtual_ranks.new_loader_iterator()
            strategy.checkpointer.after_validation(runner.epoch, runner.iter)
