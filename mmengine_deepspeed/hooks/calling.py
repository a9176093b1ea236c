"""Runner's ``call_hook`` with the runner's own hooks beside MMEngine's.

``runner.hooks`` holds what MMEngine's Runner registers (CheckpointHook and EMAHook as
their DeepSpeed-aware subclasses); the runner's own hooks (``registration.added_hooks``)
are kept in ``runner.added_hooks`` and called with them in priority order
(:class:`HookCalls`, which ``DeepSpeedRunner.call_hook`` delegates to).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from mmengine.hooks import Hook

from ..compat import call_with_hooks
from ..engine.spec import EngineSpecs
from ..engine.wrapper import released_guard
from ..zero.gather import release_all
from .registration import in_priority_order

# The events that end a phase: a hook called for them finds no ZeRO-3 parameter gathered,
# prefetched or in flight (GatheredParameters, state_dict() and exports work there).
PHASE_ENDS = frozenset({'after_train_epoch', 'after_train', 'after_val_epoch',
                        'after_test_epoch'})


class HookCalls:
    """The registered hooks and the runner's own, called together in priority order (at
    equal priority the registered ones first), sorted again only when either list changed:
    both may be edited at any time (docs/differences.md: remove a hook from
    ``runner.added_hooks``).

    Args:
        specs (EngineSpecs): The run's engines (built or not).
    """

    def __init__(self, specs: EngineSpecs):
        self._specs = specs
        # (the lists as last seen, their merged order)
        self._order: Optional[tuple[tuple[Optional[Hook], ...], list[Hook]]] = None

    def call(self, runner: Any, added: list[Hook], call_hook: Callable[..., None],
             fn_name: str, kwargs: dict) -> None:
        """MMEngine's ``call_hook`` (``call_hook``) over ``runner.hooks`` and ``added``; at
        the end of a phase (:data:`PHASE_ENDS`) ZeRO-3 engines first give back what they
        hold whole; ``before_train``'s hooks run under ZeRO-3's guard against computing on
        released parameters (``zero/released_guard.py``)."""
        if fn_name in PHASE_ENDS and self._specs.built:
            for engine in self._specs.engines().values():
                release_all(engine)
        listed = (*runner.hooks, None, *added)
        if self._order is None or listed != self._order[0]:
            self._order = (listed, in_priority_order(runner.hooks, added))
        if fn_name == 'before_train':  # hooks that set weights up (a teacher copied whole)
            with released_guard(runner.model):
                call_with_hooks(runner, self._order[1], call_hook, fn_name, kwargs)
            return
        call_with_hooks(runner, self._order[1], call_hook, fn_name, kwargs)
