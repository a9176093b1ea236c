"""Which MMEngine hooks DeepSpeedRunner replaces, and the hooks it runs beside them.

``CheckpointHook`` becomes :class:`DeepSpeedCheckpointHook` (deletes old checkpoints
only after the new one is complete) and ``EMAHook`` :class:`DeepSpeedEMAHook`
(averages gathered fp32 weights), same arguments. The runner's own hooks
(:func:`added_hooks`: a :class:`ThroughputHook` unless the config has one, the
:class:`PreemptionHook` that ``default_hooks.preemption`` configures, and the
:class:`StreamsAfterValidationHook`) are not registered: ``runner.hooks``,
``register_default_hooks`` and ``register_custom_hooks`` hold and count exactly what
MMEngine's would, and the runner calls its own with them, in priority order
(:func:`in_priority_order`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from mmengine.hooks import CheckpointHook, EMAHook, Hook
from mmengine.registry import HOOKS
from mmengine.runner.priority import Priority, get_priority

from .checkpoint import DeepSpeedCheckpointHook  # noqa: F401  registers it
from .ema import DeepSpeedEMAHook  # noqa: F401  registers it
from .monitor import ThroughputHook
from .preemption import PreemptionHook  # noqa: F401  registers it
from .streams import StreamsAfterValidationHook

# The default_hooks key that configures the PreemptionHook (None: no hook).
PREEMPTION_KEY = 'preemption'


def deepspeed_default_hooks(hooks: Optional[dict]) -> dict:
    """``default_hooks`` with the checkpoint hook (given or MMEngine's default) swapped;
    ``preemption`` is left out (it configures one of :func:`added_hooks`)."""
    hooks = dict(hooks or {})
    hooks.pop(PREEMPTION_KEY, None)
    checkpoint = hooks.get('checkpoint', dict(type='CheckpointHook', interval=1))
    if isinstance(checkpoint, dict) and checkpoint.get('type') in ('CheckpointHook',
                                                                   CheckpointHook):
        checkpoint = dict(checkpoint, type='DeepSpeedCheckpointHook')
    if 'checkpoint' not in hooks or hooks['checkpoint'] is not None:
        hooks['checkpoint'] = checkpoint
    return hooks


def deepspeed_custom_hooks(custom_hooks: Optional[list]) -> list[Any]:
    """``custom_hooks`` with ``EMAHook`` swapped for :class:`DeepSpeedEMAHook`."""
    return [dict(hook, type='DeepSpeedEMAHook')
            if isinstance(hook, dict) and hook.get('type') in ('EMAHook', EMAHook) else hook
            for hook in custom_hooks or []]


def _listed(hooks: Sequence[Any], kind: type) -> bool:
    return any(isinstance(h, kind) or (isinstance(h, dict) and h.get('type') in
                                       (kind.__name__, kind)) for h in hooks)


def added_hooks(default_hooks: Optional[dict], custom_hooks: Optional[list]) -> list[Hook]:
    """The hooks DeepSpeedRunner runs beside the registered ones.

    Args:
        default_hooks (dict, optional): The runner's ``default_hooks``; its
            ``preemption`` key configures the :class:`PreemptionHook` (None: none).
        custom_hooks (list, optional): The runner's ``custom_hooks``; one that is a
            ``ThroughputHook`` replaces the runner's.

    Returns:
        list[Hook]: Built, in priority order.
    """
    hooks: list[Hook] = []
    if not _listed(custom_hooks or [], ThroughputHook):
        hooks.append(ThroughputHook())
    hooks.append(StreamsAfterValidationHook())
    preemption = (default_hooks or {}).get(PREEMPTION_KEY, dict(type='PreemptionHook'))
    if preemption is not None:
        hooks.append(preemption if isinstance(preemption, Hook) else HOOKS.build(preemption))
    return in_priority_order(hooks, [])


def in_priority_order(registered: list[Hook], added: list[Hook]) -> list[Hook]:
    """``registered`` and the ``added`` hooks not among them, by priority; at equal
    priority registered ones first, as MMEngine places a hook registered later."""
    ids = {id(hook) for hook in registered}
    merged = registered + [hook for hook in added if id(hook) not in ids]
    return sorted(merged, key=lambda hook: get_priority(hook.priority))


def added_hooks_info(hooks: list[Hook]) -> str:
    """The runner's own hooks, for ``get_hooks_info()`` (as MMEngine lists its own)."""
    return 'Run beside them by DeepSpeedRunner, in priority order:\n' + '\n'.join(
        f'({Priority(get_priority(h.priority)).name:<12}) {type(h).__name__:<35}'
        for h in hooks)
