"""The MMEngine hooks DeepSpeedRunner replaces with DeepSpeed-aware ones, same arguments.

``CheckpointHook`` becomes :class:`DeepSpeedCheckpointHook` (deletes old
checkpoints only after the new one is complete), a :class:`PreemptionHook`
joins the default hooks (a stop signal saves and exits on every rank), ``EMAHook`` becomes
:class:`DeepSpeedEMAHook` (averages gathered fp32 weights), and a
:class:`ThroughputHook` is added unless the config has one.
"""
from __future__ import annotations

from typing import Any, Optional

from mmengine.hooks import CheckpointHook, EMAHook

from ..checkpoint.loop import RandomStreamHook
from .checkpoint import DeepSpeedCheckpointHook  # noqa: F401  registers it
from .ema import DeepSpeedEMAHook  # noqa: F401  registers it
from .monitor import ThroughputHook
from .preemption import PreemptionHook  # noqa: F401  registers it


def deepspeed_default_hooks(hooks: Optional[dict]) -> dict:
    """``default_hooks`` with the checkpoint hook (given or MMEngine's default) swapped
    and ``preemption`` (:class:`PreemptionHook`) added unless set to None."""
    hooks = dict(hooks or {})
    checkpoint = hooks.get('checkpoint', dict(type='CheckpointHook', interval=1))
    if isinstance(checkpoint, dict) and checkpoint.get('type') in ('CheckpointHook',
                                                                   CheckpointHook):
        checkpoint = dict(checkpoint, type='DeepSpeedCheckpointHook')
    if 'checkpoint' not in hooks or hooks['checkpoint'] is not None:
        hooks['checkpoint'] = checkpoint
    # MMEngine accepts None only for its own default hooks: leave ours out instead.
    preemption = hooks.pop('preemption', dict(type='PreemptionHook'))
    if preemption is not None:
        hooks['preemption'] = preemption
    return hooks


def deepspeed_custom_hooks(custom_hooks: Optional[list]) -> list[Any]:
    """``custom_hooks`` with ``EMAHook`` swapped, a ``ThroughputHook`` and the
    ``RandomStreamHook`` (validation off the training's random stream) added."""
    hooks = [dict(hook, type='DeepSpeedEMAHook')
             if isinstance(hook, dict) and hook.get('type') in ('EMAHook', EMAHook) else hook
             for hook in custom_hooks or []]
    for added in (ThroughputHook, RandomStreamHook):
        if not any(isinstance(h, added) or (isinstance(h, dict) and h.get('type') in
                                            (added.__name__, added)) for h in hooks):
            hooks.append(dict(type=added.__name__))
    return hooks
