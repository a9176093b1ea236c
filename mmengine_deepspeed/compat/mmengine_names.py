"""The MMEngine names of :mod:`mmengine_deepspeed.compat` (see its docstring)."""
from __future__ import annotations

from typing import Any, Callable, cast

from mmengine.runner.loops import _InfiniteDataloaderIterator

# IterBasedTrainLoop.dataloader_iterator's type, which code (and MMEngine's own tests)
# checks: the resumable loop's iterator subclasses it (tests/unit/test_data_order.py).
InfiniteDataloaderIterator = _InfiniteDataloaderIterator


def accumulative_counts(wrapper: Any) -> int:
    """An ``OptimWrapper``'s ``accumulative_counts`` (stored, but not exposed)."""
    return int(wrapper._accumulative_counts)


def count_backward(wrapper: Any) -> None:
    """Count one backward as MMEngine's ``OptimWrapper.backward`` does (``_inner_count``,
    an instance attribute its accumulation boundaries read; no public counter). Pinned by
    tests/unit/test_compat.py."""
    wrapper._inner_count += 1


def backward_counts(wrapper: Any) -> tuple[int, int]:
    """An ``OptimWrapper``'s backwards counted so far and in all (``_inner_count``,
    ``_max_counts``: what its accumulation boundaries and loss scale read; no public
    accessor). Pinned by tests/unit/test_compat.py."""
    return int(wrapper._inner_count), int(wrapper._max_counts)


def set_backward_counts(wrapper: Any, accumulative: int, counted: int, maximum: int) -> None:
    """Set what ``OptimWrapper.initialize_count_status`` sets (its accumulation, the
    backwards counted and in all, the last window's remainder), without its warnings: for
    a count changed mid-run (an iteration made of more micro-steps). Pinned by
    tests/unit/test_compat.py."""
    wrapper._accumulative_counts = accumulative
    wrapper._inner_count, wrapper._max_counts = counted, maximum
    wrapper._remainder_counts = maximum % accumulative


def found_inf_supported(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` skips on the device when given ``found_inf``: torch's
    fused optimizers, which set ``_step_supports_amp_scaling`` (read by
    ``torch.amp.GradScaler``; no public flag). Pinned by tests/unit/test_compat.py."""
    return bool(getattr(optimizer, '_step_supports_amp_scaling', False))


def ema_started(hook: Any, runner: Any) -> bool:
    """Whether MMEngine's ``EMAHook`` has begun averaging (its ``begin_iter`` /
    ``begin_epoch``; ``EMAHook._ema_started``, no public one)."""
    return bool(hook._ema_started(runner))


def set_experiment_name(runner: Any, name: str) -> None:
    """Set ``Runner.experiment_name`` (read-only property over ``_experiment_name``),
    before the logger and message hub take it."""
    runner._experiment_name = name


def save_with_checkpoint_hook(hook: Any, runner: Any, step: int, meta: dict) -> None:
    """Save as ``CheckpointHook`` saves at ``step``: its file name, its ``max_keep_ckpts``
    rotation, ``last_checkpoint``. No public method saves outside its interval; the
    preemption checkpoint needs one (tests/dist/test_failures.py)."""
    hook._save_checkpoint_with_step(runner, step, meta)


def randomness_cfg(runner: Any) -> dict:
    """The runner's ``randomness`` settings (``Runner._randomness_cfg``, an instance
    attribute set in ``Runner.__init__``; no public accessor)."""
    return cast(dict, runner._randomness_cfg)


def diff_rank_seed(runner: Any) -> bool:
    """``randomness.diff_rank_seed`` as the runner holds it (MMEngine's loops read it the same
    way to build their dataloader)."""
    return bool(randomness_cfg(runner).get('diff_rank_seed', False))


def call_with_hooks(runner: Any, hooks: list, call_hook: Callable[..., None], fn_name: str,
                    kwargs: dict) -> None:
    """``call_hook(fn_name, **kwargs)`` with ``hooks`` as ``runner``'s hook list for the
    call (MMEngine's ``call_hook`` iterates ``Runner._hooks``, which ``runner.hooks``
    returns; DeepSpeedRunner adds its own hooks there for one call only,
    tests/dist/test_runner_contract.py). One function, twice per iteration: a try, not a
    context manager."""
    registered = runner._hooks
    runner._hooks = hooks
    try:
        call_hook(fn_name, **kwargs)
    finally:
        runner._hooks = registered


def set_loop_position(loop: Any, epoch: int, iteration: int) -> None:
    """Restore a train loop's epoch and iteration (MMEngine's ``resume`` does the same)."""
    loop._epoch = epoch
    loop._iter = iteration


def route_from_cfg_to(runner_class: type) -> None:
    """``Runner.from_cfg(cfg)`` builds the runner ``cfg.runner_type`` names where that is
    ``runner_class`` or a subclass: MMagic's ``tools/train.py`` calls it whatever the config
    says (MMDetection's builds ``RUNNERS.build(cfg)``), which trained a plain ``Runner``
    silently. Only ``Runner.from_cfg`` itself is routed (a subclass's, and so
    ``RUNNERS.build``, are MMEngine's) and only for such a ``runner_type``; calling this
    again changes nothing. Pinned by tests/unit/test_compat.py and tests/dist/test_setup.py.
    """
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    plain = Runner.__dict__['from_cfg'].__func__
    if getattr(plain, 'routes_to', None) is not None:
        return

    def from_cfg(cls: type, cfg: Any) -> Any:
        if cls is Runner:
            named = cfg.get('runner_type')
            chosen = RUNNERS.get(named) if isinstance(named, str) else named
            if isinstance(chosen, type) and issubclass(chosen, runner_class):
                return RUNNERS.build(cfg)
        return plain(cls, cfg)

    from_cfg.__doc__ = plain.__doc__
    from_cfg.routes_to = runner_class  # type: ignore[attr-defined]
    Runner.from_cfg = classmethod(from_cfg)  # type: ignore[method-assign,assignment]


def scalar_histories(hub: Any) -> dict:
    """A MessageHub's histories by key: the dict itself (``MessageHub._log_scalars``, an
    instance attribute; the ``log_scalars`` property returns the same dict, but the runner's
    hub reads its kept tensors before it returns). Pinned by tests/unit/test_compat.py."""
    return cast(dict, hub._log_scalars)


def register_message_hub(name: str, hub: Any) -> None:
    """Make ``hub`` (a MessageHub subclass's instance) what ``MessageHub.get_instance(name)``
    and ``MessageHub.get_current_instance()`` return: MMEngine's ``ManagerMixin`` keeps one
    private ``_instance_dict`` per class, so a subclass's instances are not MessageHub's.
    Pinned by tests/unit/test_message_hub.py."""
    from mmengine.logging import MessageHub

    instances = MessageHub._instance_dict
    instances.pop(name, None)  # the newest is the current one
    instances[name] = hub
