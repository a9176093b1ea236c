"""When a run goes bad: the log says where, and a policy decides what follows.

A step whose loss or gradients are not finite is skipped on every rank at every
ZeRO stage (``engine/nonfinite.py``). :class:`NonFiniteHook` makes that visible
and acts on it, without a host read of its own:

* what it learns comes from the message hub as the hub is read at LoggerHook's
  interval (``DeferredMessageHub.observe``): each rank's non-finite losses,
  with the iteration they were logged at, and every optimizer's count of skipped
  updates (``skipped_steps``, logged at every precision);
* at each of the run's agreements (``strategy/agreement.py``, on a CPU group: the
  logging iterations, and about every 2 s between them) the ranks agree whether
  any of them saw a skipped update, a non-finite loss or a loss spike; only then do
  they read the hub (every loss until now) and gather what each saw (a second small
  collective, on failures only): the iteration, the ranks, the loss keys and the
  dataset indices of each rank's batch. Rank 0 logs it and appends it to
  ``work_dir/nonfinite_steps.jsonl``;
* the policy (``nonfinite=dict(policy=...)``, :class:`NonFinitePolicy`) then
  goes on (``skip``), ends every rank after a checkpoint of the last good state
  (``stop``; also ``skip`` past its limits), or rolls back (``rollback``): every
  rank restores the newest complete checkpoint taken before the first failed step,
  leaves the samples of the failed steps out from then on, and trains on
  (``loops.py``). The samples left out are kept in the message hub's runtime info,
  so checkpoints remember them and a resumed run keeps leaving them out, and in
  ``work_dir/excluded_samples.json``.

Since skipped steps never reach the weights, the state at any iteration is the
last good state: no checkpoint holds a NaN, and none is rotated away by a bad one.
"""
from __future__ import annotations

import json
import os.path as osp
from collections.abc import Iterable
from typing import Any, Optional

from mmengine.hooks import Hook
from typing_extensions import override

from ..checkpoint.checkpointer import agreed_path
from ..checkpoint.layout import latest_complete
from ..engine.optim_wrapper import DeepSpeedOptimWrapper
from ..engine.spec import named_wrappers
from ..failure import AgreedExit
from ..hooks.preemption import (
    at_update_boundary,
    checkpoint_dir,
    checkpoint_hook,
    save_preemption_checkpoint,
)
from ..strategy import agreement_of
from ..strategy.agreement import Agreement, logging_interval
from .failed_steps import FailedStep, FailedStepWatch, NonFinitePolicy
from .monitor import STEPS_FILE, gather_failed_steps, report_failed_steps

# The message hub's runtime-info key of the samples left out (saved with checkpoints).
EXCLUDED_KEY = 'excluded_samples'
EXCLUDED_FILE = 'excluded_samples.json'
# The exit status of a run the policy stopped (a failure, not a success).
STOP_STATUS = 3


class RollBack(Exception):
    """Raised on every rank alike from ``after_train_iter``; the loop has the strategy
    restore ``path`` and leave ``excluded`` (dataset indices, besides those left out
    already) out from there on (``RunStrategy.roll_back``).

    An exception, not a flag: the iteration must end here, on every rank. The hooks after
    this one (CheckpointHook among them) must not run on the state being abandoned (a
    checkpoint of it could rotate away the one rolled back to), and MMEngine's loop must
    not count the iteration (it does once ``after_train_iter`` returns).
    """

    def __init__(self, path: str, excluded: Iterable[int]):
        super().__init__(path)
        self.path = path
        self.excluded = frozenset(excluded)


class NonFiniteHook(Hook):
    """Logs failed steps with rank and samples; stops, or rolls back past bad data.

    DeepSpeedRunner runs it beside the registered hooks (``nonfinite`` and
    ``exclude_samples`` configure it).

    Args:
        policy (NonFinitePolicy): What follows a failed step.
        exclude_samples (Iterable[int]): Dataset indices the train loader leaves out.
    """

    priority = 'LOW'  # after LoggerHook, whose interval read of the hub it uses

    def __init__(self, policy: NonFinitePolicy, exclude_samples: Iterable[int] = ()):
        self.policy = policy
        self.exclude_samples = frozenset(exclude_samples)  # the config's
        self.rollbacks = 0
        self._observing: Any = None  # the DeferredMessageHub observed (message_hub.py)
        self._agreement: Optional[Agreement] = None  # the run's, from before_train
        self._reset(FailedStepWatch(policy))

    def _reset(self, watch: FailedStepWatch) -> None:
        self._watch = watch
        self._positions: dict[int, tuple[int, int]] = {}
        self._unresolved: list[FailedStep] = []  # since the last rollback
        self._stopping: Optional[str] = None

    @override
    def before_train(self, runner: Any) -> None:
        hub = runner.message_hub
        if not (hasattr(hub, 'observe') and hasattr(hub, 'read_pending')):
            raise TypeError(
                f'The message hub is a {type(hub).__name__}; NonFiniteHook observes losses '
                'through the DeferredMessageHub DeepSpeedRunner builds (message_hub.py). '
                'Leave build_message_hub to DeepSpeedRunner, or derive your hub from '
                'mmengine_deepspeed.message_hub.DeferredMessageHub.')
        if self._observing is not hub:
            hub.observe(self._observe, FailedStepWatch.watches)
            self._observing = hub
        wrappers = [w for w in named_wrappers(runner.optim_wrapper).values()
                    if isinstance(w, DeepSpeedOptimWrapper)]
        # fp16: an update skipped with finite losses is DeepSpeed's loss scaler at work
        # (which ends the run itself at its minimum scale), not a failed step
        self._reset(FailedStepWatch(
            self.policy, {w.skipped_steps_key: w.step_check.count_now() for w in wrappers},
            loss_scaled=[w.skipped_steps_key for w in wrappers if w.engine.fp16_enabled()]))
        # the config's, and those a resumed checkpoint left out
        excluded = self.exclude_samples | set(hub.runtime_info.get(EXCLUDED_KEY, []))
        if excluded:
            if getattr(runner.train_loop, 'resumable_sampler', None) is None:
                raise ValueError(
                    'exclude_samples needs MMEngine\'s train loops and the loader\'s default '
                    'batch sampler (a sampler DeepSpeedRunner can wrap); this run has a custom '
                    'train loop, a custom batch_sampler or an IterableDataset.')
            size = len(runner.train_dataloader.dataset)
            beyond = sorted(i for i in excluded if i >= size)
            if beyond:
                raise ValueError(
                    f'exclude_samples names dataset indices {beyond[:10]}'
                    f'{"..." if len(beyond) > 10 else ""}, past the end of the training '
                    f'dataset ({size} samples: indices 0-{size - 1}); give indices of this '
                    'dataset (excluded_samples.json of a rollback of this config lists them).')
            runner.train_loop.leave_out(excluded)
            runner.logger.info(f'Leaving out {len(excluded)} samples of the training '
                               f'data (exclude_samples): {sorted(excluded)[:20]}'
                               f'{"..." if len(excluded) > 20 else ""}')
        self._interval = logging_interval(runner)
        world = runner.world_size

        def flags() -> list[float]:
            if (runner.iter + 1) % self._interval == 0:
                hub.read_pending()  # the read LoggerHook makes at this iteration anyway
            # the same decision to gather on every rank, whatever each has read so far
            seen = self._watch.seen
            return [float(rank == runner.rank and seen) for rank in range(world)]

        self._agreement = agreement_of(runner, 'NonFiniteHook')
        self._agreement.provide('nonfinite', flags)

    def _observe(self, key: str, iteration: int, value: float) -> None:
        self._watch.observe(key, iteration, value)  # the hub's observer, for the run's watch

    @override
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        iteration = runner.iter  # a property of a property: read once
        loop = runner.train_loop
        if hasattr(loop, 'batch_position'):
            self._positions[iteration] = loop.batch_position(batch_idx)
        logging = (iteration + 1) % self._interval == 0
        if self._stopping is None and (
                logging or (self._agreement
                            or agreement_of(runner, 'NonFiniteHook')).due(iteration)):
            self._report(runner, logging)
        if self._stopping is not None and at_update_boundary(runner.optim_wrapper):
            self._stop(runner)

    def _report(self, runner: Any, logging: bool) -> None:
        """At the run's agreements: the logging iterations (the hub was read: everything
        is known) and, about every 2 s between them, what the host knows already (skips
        DeepSpeed decided): a stop or rollback comes within seconds of those."""
        if not any(agreement_of(runner, 'NonFiniteHook').agreed(runner.iter)['nonfinite']):
            if logging:  # between them, losses not read yet may still prove bad
                self._positions.clear()
            return
        runner.message_hub.read_pending()  # something failed: the losses until now, read
        # on every rank
        loop = runner.train_loop
        given_out = getattr(loop, 'given_out', None)
        positions = self._positions
        steps = gather_failed_steps(
            self._watch.take(), runner.rank,
            lambda it: given_out(positions[it]) if given_out is not None and it in positions
            else None)
        self._positions = {}
        self._watch.reported(steps, runner.iter)
        if self.policy.policy == 'rollback':
            self._unresolved += steps
        report_failed_steps(steps, work_dir=runner.work_dir, rank=runner.rank,
                            skipped=self._watch.skipped, logger=runner.logger)
        limit = self._watch.limit_reached()
        spiked = any(step.spikes for step in steps)
        if self.policy.policy == 'stop':
            self._stopping = 'nonfinite.policy="stop"'
        elif limit is not None or spiked:
            reason = limit or 'a loss spike'
            if self.policy.policy == 'rollback':
                self._roll_back(runner, reason)
            self._stopping = f'{reason} (nonfinite.policy="{self.policy.policy}")'

    def _roll_back(self, runner: Any, reason: str) -> None:
        """Raise :class:`RollBack` on every rank, or return where none can be taken (the
        run then stops, saying why)."""
        first = min(step.iteration for step in self._unresolved)
        path = self._checkpoint_before(runner, first)
        sampler = getattr(runner.train_loop, 'resumable_sampler', None)
        why_not = None
        if self.rollbacks >= self.policy.max_rollbacks:
            why_not = f'max_rollbacks={self.policy.max_rollbacks} reached'
        elif sampler is None:
            why_not = ('the train loop or loader cannot leave samples out (a custom train loop '
                       'or batch sampler: see the warning at its build)')
        elif not path:
            why_not = (f'no complete checkpoint was taken before iteration {first + 1} '
                       '(CheckpointHook\'s interval)')
        if why_not is not None or sampler is None:
            runner.logger.warning(f'No rollback: {why_not}.')
            return
        excluded = {i for step in self._unresolved for i in step.culprits()}
        # the loop's sampler owns what is left out (RunStrategy.roll_back adds these)
        after = sorted(sampler.excluded | excluded)
        self.rollbacks += 1
        self._unresolved = []
        self._watch.restart_limits()
        if runner.rank == 0:
            with open(osp.join(runner.work_dir, EXCLUDED_FILE), 'w', encoding='utf-8') as f:
                json.dump(after, f)
        runner.logger.warning(
            f'{reason}: rolling back to {path} (rollback {self.rollbacks} of at most '
            f'{self.policy.max_rollbacks}), leaving out the samples {sorted(excluded)} of the '
            f'failed steps from now on ({osp.join(runner.work_dir, EXCLUDED_FILE)} lists all '
            f'{len(after)}; checkpoints remember them).')
        agreement_of(runner, 'NonFiniteHook').restart()
        raise RollBack(path, excluded)

    @staticmethod
    def _checkpoint_before(runner: Any, iteration: int) -> str:
        """The newest complete checkpoint taken after at most ``iteration`` iterations,
        rank 0's answer on every rank ('' for none)."""
        path = None
        if runner.rank == 0:
            path = latest_complete(checkpoint_dir(runner, checkpoint_hook(runner)),
                                   at_most_iter=iteration)
        return agreed_path(path or '')

    def _stop(self, runner: Any) -> None:
        path = save_preemption_checkpoint(runner)
        if runner.rank == 0:  # MMEngine's other ranks show errors too: said once
            runner.logger.error(
                f'Stopping every rank after iteration {runner.iter + 1}: {self._stopping}. The '
                f'last good state is saved in {path} (no update that was not finite reached '
                f'it); see {osp.join(runner.work_dir, STEPS_FILE)} for the failed steps. '
                'Resume with --resume (resume=True), with exclude_samples to leave their '
                'samples out.')
        raise AgreedExit(STOP_STATUS)
