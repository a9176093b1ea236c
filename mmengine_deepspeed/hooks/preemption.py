"""Preemption: a SIGTERM or SIGUSR1 on any rank stops every rank after a checkpoint.

Slurm (preemption, ``--time``, ``scancel``) and Kubernetes (eviction) send
SIGTERM, then SIGKILL after a grace period (slurm's ``KillWait``, 30 s by
default); ``#SBATCH --signal=B:USR1@120`` asks for SIGUSR1 ahead of the time
limit. :class:`PreemptionHook` turns either into a clean stop:

1. while ``train()`` runs, the signal only sets a flag (never inside a step
   or a collective, where a rank cannot stop alone);
2. the ranks agree whether any of them got a signal with the run's other
   agreements (``strategy/agreement.py``: one small all-reduce on a CPU group,
   about every 2 seconds of training and at every logging iteration), so a
   rank that got none stops with the others, at the first update boundary
   from there;
3. they save a complete checkpoint, named as CheckpointHook names it at that
   iteration (``iter_N.pth``), ``last_checkpoint`` naming it;
4. rank 0 logs one line saying why, and every rank exits with status
   128 + the signal's number, as a process killed by it would: a scheduler
   or wrapper sees a preemption, not a success, and ``--resume`` /
   ``resume=True`` / ``--max-restarts`` continue exactly from there.

A second signal while saving changes nothing: the save completes (a SIGKILL
instead leaves a directory without ``COMPLETE``, never named by
``last_checkpoint``). DeepSpeedRunner registers the hook as the default hook
``preemption``; ``default_hooks=dict(preemption=None)`` turns it off.
"""
from __future__ import annotations

import contextlib
import os
import os.path as osp
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any, Optional

from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import HOOKS
from typing_extensions import override

from ..checkpoint.layout import LAST_CHECKPOINT, write_text_atomic
from ..compat import save_with_checkpoint_hook
from ..engine.spec import named_wrappers
from ..failure import AgreedExit
from ..strategy import agreement_of
from ..strategy.agreement import Agreement

DEFAULT_SIGNALS = ('SIGTERM', 'SIGUSR1')


def _signal_numbers(names: Sequence[str]) -> list[signal.Signals]:
    # SIGUSR1 does not exist on Windows
    return [signal.Signals[name] for name in names if name in signal.Signals.__members__]


@HOOKS.register_module()
class PreemptionHook(Hook):
    """Stop all ranks cleanly, with a checkpoint, when any rank gets a stop signal.

    Args:
        signals (Sequence[str]): Signal names to catch while training. Defaults
            to ``('SIGTERM', 'SIGUSR1')``.
        interval (int, optional): Agree on a stop every this many iterations.
            None: with the run's other agreements (``strategy/agreement.py``: at
            LoggerHook's intervals, and in between about every 2 seconds of
            training, one small all-reduce on a CPU group for all of them).
            Defaults to None.
    """

    priority = 'LOWEST'  # after CheckpointHook, which may already save this iteration

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS,
                 interval: Optional[int] = None):
        unknown = [name for name in signals
                   if name not in signal.Signals.__members__ and name not in DEFAULT_SIGNALS]
        if unknown:
            raise ValueError(f'PreemptionHook(signals={list(signals)}): {unknown} are not '
                             "signal names; use names such as 'SIGTERM', 'SIGUSR1'.")
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(f'PreemptionHook(interval={interval!r}) must be an integer >= 1, '
                             'or None to agree with the run\'s other agreements.')
        self.signals = _signal_numbers(signals)
        self.interval = interval
        self.received: Optional[int] = None
        self._stop: Optional[list[int]] = None  # each rank's signal, once agreed
        self._agreement: Optional[Agreement] = None  # the run's, from before_train

    def during_train(self, runner: Any, stack: contextlib.ExitStack) -> None:
        """DeepSpeedRunner's hook event at the start of ``train()``: the signals are
        caught until ``stack`` (``train()``'s) closes, however ``train()`` ends."""
        stack.enter_context(self.catching_signals())

    @contextlib.contextmanager
    def catching_signals(self) -> Iterator[None]:
        """Catch the signals for the duration of the block (the runner's ``train()``).

        Outside ``train()`` the previous handlers are in place again, so a
        signal after a crash or after training ends the process as usual.
        """
        if threading.current_thread() is not threading.main_thread():
            yield  # Python delivers signals to the main thread only
            return
        previous = {number: signal.signal(number, self._on_signal) for number in self.signals}
        try:
            yield
        finally:
            for number, handler in previous.items():
                # None: a handler not set from Python, which cannot be put back as such
                signal.signal(number, signal.SIG_DFL if handler is None else handler)

    def _on_signal(self, number: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = number
            name = signal.Signals(number).name
            os.write(2, f'[rank {os.environ.get("RANK", "0")}] {name} received: stopping when '
                        'the ranks next agree (about 2 s), after a checkpoint.\n'.encode())

    @override
    def before_train(self, runner: Any) -> None:
        self._stop = None
        self._agreement = agreement_of(runner, 'PreemptionHook')
        self._agreement.provide(
            'signal', lambda: [float(self.received or 0) if rank == runner.rank else 0.0
                               for rank in range(runner.world_size)])

    @override
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        """Agree on a stop; if any rank got a signal, save and leave ``train()`` (at an
        update boundary: accumulated gradients are not in a checkpoint)."""
        agreement = self._agreement or agreement_of(runner, 'PreemptionHook')
        iteration = runner.iter  # a property of a property: read once
        due = (iteration + 1) % self.interval == 0 if self.interval else agreement.due(iteration)
        if due and self._stop is None:
            by_rank = [int(x) for x in agreement.agreed(iteration)['signal']]
            self._stop = by_rank if any(by_rank) else None
        if self._stop is None or not at_update_boundary(runner.optim_wrapper):
            return
        number = max(self._stop)
        path = save_preemption_checkpoint(runner)
        ranks = [rank for rank, got in enumerate(self._stop) if got]
        runner.logger.warning(
            f'{signal.Signals(number).name} reached rank{"s" if len(ranks) > 1 else ""} '
            f'{", ".join(map(str, ranks))}: stopped after iteration {runner.iter + 1} and saved '
            f'{path}; resume with --resume (resume=True) to continue exactly from there.')
        raise AgreedExit(128 + number)  # 128 + the signal, as a shell reports it


def at_update_boundary(optim_wrapper: Any) -> bool:
    """Whether the last iteration updated the parameters (no accumulated gradients
    are pending, which a checkpoint would not hold)."""
    return all(w.should_update() for w in named_wrappers(optim_wrapper).values())


def checkpoint_hook(runner: Any) -> Optional[CheckpointHook]:
    """The run's CheckpointHook, whose ``out_dir`` and names the run's checkpoints take."""
    return next((h for h in runner.hooks if isinstance(h, CheckpointHook)), None)


def checkpoint_dir(runner: Any, hook: Optional[CheckpointHook]) -> str:
    """Where the run's checkpoints go: ``hook``'s (:func:`checkpoint_hook`) ``out_dir``,
    else ``work_dir``."""
    return getattr(hook, 'out_dir', None) or runner.work_dir


def save_preemption_checkpoint(runner: Any) -> str:
    """Save the checkpoint of this iteration as CheckpointHook would (collective).

    An iteration-based CheckpointHook saves it itself (its name, its
    ``max_keep_ckpts`` rotation), unless it already did at this iteration.
    With an epoch-based one, or none, it is ``iter_N.pth`` in the hook's
    ``out_dir`` (else ``work_dir``), outside the rotation.

    Returns:
        str: The checkpoint directory.
    """
    step = runner.iter + 1
    meta = dict(epoch=runner.epoch, iter=step)
    hook = checkpoint_hook(runner)
    if hook is not None and not hook.by_epoch:
        path = osp.join(hook.out_dir, hook.filename_tmpl.format(step))
        # The same answer on every rank (the hook records its saves alike).
        if getattr(hook, 'last_ckpt', None) != path:
            save_with_checkpoint_hook(hook, runner, step, meta)
        return path
    out_dir = checkpoint_dir(runner, hook)
    filename = f'iter_{step}.pth'
    runner.save_checkpoint(out_dir, filename, save_optimizer=getattr(hook, 'save_optimizer', True),
                           save_param_scheduler=getattr(hook, 'save_param_scheduler', True),
                           meta=meta, by_epoch=False)
    path = osp.join(out_dir, filename)
    if runner.rank == 0:
        write_text_atomic(osp.join(runner.work_dir, LAST_CHECKPOINT), path)
    return path
