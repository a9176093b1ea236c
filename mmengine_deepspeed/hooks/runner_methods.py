"""Runner's hook registration and calling, with the runner's own hooks beside MMEngine's.

``runner.hooks`` holds what MMEngine's Runner registers (CheckpointHook and EMAHook as
their DeepSpeed-aware subclasses); the runner's own hooks (``registration.added_hooks``)
are kept in :attr:`HookMethods.added_hooks` and called with them in priority order.
"""
from __future__ import annotations

from typing import Any, Optional

from mmengine.hooks import Hook
from mmengine.runner import Runner
from typing_extensions import override

from ..compat import call_with_hooks
from ..engine.spec import EngineSpecs
from ..engine.wrapper import released_guard
from ..zero.gather import release_all
from .registration import (
    added_hooks,
    added_hooks_info,
    deepspeed_custom_hooks,
    deepspeed_default_hooks,
    in_priority_order,
)

# The events that end a phase: a hook called for them finds no ZeRO-3 parameter gathered,
# prefetched or in flight (GatheredParameters, state_dict() and exports work there).
PHASE_ENDS = frozenset({'after_train_epoch', 'after_train', 'after_val_epoch',
                        'after_test_epoch'})


class HookMethods(Runner):
    """Runner's ``register_default_hooks`` / ``register_hooks`` / ``call_hook`` /
    ``get_hooks_info`` for DeepSpeedRunner (``hooks/registration.py``)."""

    added_hooks: list[Hook]  # the runner's own, run beside runner.hooks
    engine_specs: EngineSpecs
    nonfinite_hook: Hook  # configured by the runner's nonfinite / exclude_samples
    # (the registered hooks, the merged order): sorted again only when they change
    _hook_order: Optional[tuple[tuple[Optional[Hook], ...], list[Hook]]] = None

    @override
    def register_default_hooks(self, hooks: Optional[dict] = None) -> None:
        """MMEngine's default hooks, with the crash-safe checkpoint hook
        (``hooks/registration.py``)."""
        super().register_default_hooks(deepspeed_default_hooks(hooks))

    @override
    def register_hooks(self, default_hooks: Optional[dict] = None,
                       custom_hooks: Optional[list] = None) -> None:
        """MMEngine's hooks, with ``EMAHook`` made DeepSpeed-aware; the runner's own hooks
        (throughput, preemption, streams after validation, non-finite steps) beside
        them, in :attr:`added_hooks` (``hooks/registration.py``)."""
        self.added_hooks = in_priority_order(added_hooks(default_hooks, custom_hooks),
                                             [self.nonfinite_hook])
        self._hook_order = None
        super().register_hooks(default_hooks, deepspeed_custom_hooks(custom_hooks))

    @override
    def call_hook(self, fn_name: str, **kwargs: Any) -> None:
        """MMEngine's ``call_hook`` over the registered hooks and :attr:`added_hooks`,
        in priority order (at equal priority the registered ones first); at the end of
        a phase (:data:`PHASE_ENDS`) ZeRO-3 engines first give back what they hold whole;
        ``before_train``'s hooks run under ZeRO-3's guard against computing on released
        parameters (``zero/released_guard.py``)."""
        if fn_name in PHASE_ENDS and self.engine_specs.built:
            for engine in self.engine_specs.engines().values():
                release_all(engine)
        # both lists may be edited at any time (docs/differences.md: remove a hook from added_hooks)
        listed = (*self.hooks, None, *self.added_hooks)
        if self._hook_order is None or listed != self._hook_order[0]:
            self._hook_order = (listed, in_priority_order(self.hooks, self.added_hooks))
        if fn_name == 'before_train':  # hooks that set weights up (a teacher copied whole)
            with released_guard(self.model):
                call_with_hooks(self, self._hook_order[1], super().call_hook, fn_name, kwargs)
            return
        call_with_hooks(self, self._hook_order[1], super().call_hook, fn_name, kwargs)

    @override
    def get_hooks_info(self) -> str:
        """MMEngine's listing of the registered hooks, then the runner's own."""
        return f'{super().get_hooks_info()}\n{added_hooks_info(self.added_hooks)}'
