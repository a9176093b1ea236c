"""Train loops that resume exactly where a checkpoint was taken, without reloading data.

MMEngine's ``EpochBasedTrainLoop`` restarts an interrupted epoch from its
first batch (a checkpoint taken by iteration inside an epoch replays data),
and its ``IterBasedTrainLoop`` resumes by loading and dropping one batch per
trained iteration (80,000 batches decoded and augmented before the first step
of a resumed MMSegmentation schedule). These loops skip the batches already
trained on at the sampler (``order.py``): the sample order is the same
(the sampler is seeded by seed and epoch), nothing skipped is loaded, and the
time to the first resumed step does not grow with the resume point.
DeepSpeedRunner uses them wherever a config asks for MMEngine's loops.

They draw from the global random streams where MMEngine's loops do (an
epoch's iterator is created at its start; the iteration loop's first one when
the loop is built), and record the streams each iterator was created from, so a
run resumed inside an epoch creates that epoch's iterator as the uninterrupted
run did (``order.create_iterator``); the iteration loop's iterator is
``iterator.EpochIterator``.

Validation inside training draws from the training's streams, as with Runner.
A checkpoint is taken just before such a validation, so each rank rewrites its
streams in that checkpoint once the validation is over
(``hooks/streams.py``): a run resumed from it goes on from the streams the run
that never stopped went on from.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, cast

from mmengine.registry import LOOPS
from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop
from torch.utils.data import DataLoader
from typing_extensions import override

from ..compat import diff_rank_seed, set_loop_position
from ..engine.virtual_ranks import VirtualRanks
from ..engine.wrapper import released_guard
from ..guard.hook import EXCLUDED_KEY, RollBack
from ..random_streams import rng_state
from ..strategy import strategy_of
from .iterator import EpochIterator
from .order import ResumableSampler, create_iterator, make_resumable
from .virtual_ranks import run_as_virtual_ranks, samples_per_batch


def resumable_loop(loop: Any) -> Any:
    """A ``train_cfg`` asking for MMEngine's loops, asking for the resumable ones instead.

    Both ``type`` and ``by_epoch`` are left for MMEngine to refuse, as it does.
    """
    if not isinstance(loop, dict) or ('type' in loop and 'by_epoch' in loop):
        return loop
    loop = dict(loop)
    kind = loop.get('type')
    if kind in ('EpochBasedTrainLoop', EpochBasedTrainLoop) \
            or (kind is None and loop.get('by_epoch')):
        loop['type'] = 'ResumableEpochBasedTrainLoop'
    elif kind in ('IterBasedTrainLoop', IterBasedTrainLoop) \
            or (kind is None and loop.get('by_epoch') is False):
        loop['type'] = 'ResumableIterBasedTrainLoop'
    if loop.get('type') != kind:
        loop.pop('by_epoch', None)
    return loop


class IndexedBatches:
    """What both loops tell about their batches (``guard/hook.py`` asks), and their
    first iteration run under ZeRO-3's guard (``zero/released_guard.py``)."""

    dataloader: DataLoader
    runner: Any
    _guarded = False  # this process's first iteration has run

    def run_iter(self, *args: Any) -> None:
        """MMEngine's ``run_iter``; the first in this process stops code that computes on a
        released ZeRO-3 parameter (the steps after it pass nothing through the guard)."""
        if self._guarded:
            cast(Any, super()).run_iter(*args)
            return
        self._guarded = True
        with released_guard(self.runner.model):
            cast(Any, super()).run_iter(*args)

    @property
    def resumable_sampler(self) -> Optional[ResumableSampler]:
        """The sampler wrapper (None for a custom batch sampler)."""
        return cast(Optional[ResumableSampler], getattr(self, '_sampler', None))

    def leave_out(self, indices: Iterable[int]) -> None:
        """Leave the dataset ``indices`` (all of them: not only new ones) out of every pass
        from the next batch on, and keep them in the message hub, which checkpoints save.

        Raises:
            RuntimeError: For a custom batch sampler or an IterableDataset, which no
                sampler of ours wraps (``NonFiniteHook`` says so before training).
        """
        sampler = self.resumable_sampler
        if sampler is None:
            raise RuntimeError('Leaving samples out needs the loader\'s default batch sampler, '
                               'which this loop lacks.')
        sampler.exclude(indices)
        self.runner.message_hub.update_info(EXCLUDED_KEY, sorted(sampler.excluded))

    def given_out(self, position: tuple[int, int]) -> Optional[list[int]]:
        """The dataset indices of the batch at ``position`` (epoch, batch number in that
        epoch's pass: :meth:`batch_position`), if the sampler still remembers them;
        None for a custom batch sampler."""
        sampler = self.resumable_sampler
        if sampler is None:
            return None
        epoch, batch = position
        size = samples_per_batch(self.dataloader)
        return sampler.given_out(epoch, batch * size, (batch + 1) * size)


@LOOPS.register_module()
class ResumableEpochBasedTrainLoop(IndexedBatches, EpochBasedTrainLoop):
    """:class:`mmengine.runner.EpochBasedTrainLoop` that resumes mid-epoch exactly.

    Attributes:
        iterator_streams (dict | None): The random streams this epoch's
            iterator was created from (saved per rank with a checkpoint).
    """

    _skip_batches = 0
    _virtual: Optional[VirtualRanks] = None
    iterator_streams: Optional[dict] = None

    def __init__(self, runner: Any, dataloader: Any, *args: Any, **kwargs: Any):
        # built here as MMEngine would, so that a layout's loader is what MMEngine's
        # __init__ reads its length from (max_iters)
        dataloader, self._virtual = _built(runner, dataloader)
        super().__init__(runner, dataloader, *args, **kwargs)
        self._sampler = make_resumable(self.dataloader, runner.seed, runner.rank)

    def skip_trained_batches(self) -> None:
        """Arrange to skip the batches of the current epoch already trained on.

        Called after the loop's epoch and iteration were restored.
        """
        self._skip_batches = self.iter - self.epoch * len(self.dataloader)
        if self._skip_batches:
            _log_skip(self.runner, self._skip_batches, f'of epoch {self.epoch + 1} ',
                      self._sampler is not None)

    def batch_position(self, batch_idx: int) -> tuple[int, int]:
        """(epoch, batch number in its pass) of the batch ``after_train_iter`` got as
        ``batch_idx``."""
        return self.epoch, batch_idx

    @override
    def run_epoch(self) -> None:
        """Iterate one epoch as MMEngine does, from the first batch a mid-epoch checkpoint
        had not seen, through an iterator created from the streams the epoch's was; after a
        rollback, the epoch of the restored checkpoint instead (MMEngine's ``run()`` then
        goes on from there)."""
        skip, self._skip_batches = self._skip_batches, 0
        if self._sampler is not None:
            self._sampler.begin(self.epoch, skip * samples_per_batch(self.dataloader))
        self.runner.call_hook('before_train_epoch')
        self.runner.model.train()
        iterator, self.iterator_streams = create_iterator(
            self.dataloader, self.iterator_streams if skip else None, self._virtual)
        for idx, data_batch in enumerate(iterator, start=skip if self._sampler else 0):
            if idx >= skip:  # a custom batch_sampler: its skipped batches are loaded, dropped
                try:
                    self.run_iter(idx, data_batch)
                except RollBack as rollback:
                    roll_back(self, rollback)
                    self.run_epoch()
                    return
        self.runner.call_hook('after_train_epoch')
        set_loop_position(self, self.epoch + 1, self.iter)


def roll_back(loop: Any, rollback: RollBack) -> None:
    """The strategy's rollback (collective: every rank raised the same :class:`RollBack`)."""
    strategy_of(loop.runner, type(loop).__name__).roll_back(rollback.path, rollback.excluded)


def _built(runner: Any, dataloader: Any) -> tuple[Any, Optional[VirtualRanks]]:
    """The train loader as MMEngine's loops build it from a config, giving this rank's
    virtual ranks' batches where the run has a layout (``virtual_ranks.py``), and the
    strategy's virtual ranks then."""
    if isinstance(dataloader, dict):
        dataloader = runner.build_dataloader(dataloader, seed=runner.seed,
                                             diff_rank_seed=diff_rank_seed(runner))
    strategy = strategy_of(runner, 'the train loop')
    if strategy.layout is None:
        return dataloader, None
    virtual = strategy.start_virtual_ranks(dataloader)
    run_as_virtual_ranks(dataloader, virtual.first, virtual.count, virtual.world_size,
                         virtual.split)
    return dataloader, virtual


def _log_skip(runner: Any, batches: int, where: str, at_sampler: bool) -> None:
    how = ('at the sampler: nothing is loaded for them' if at_sampler else
           'by loading and dropping them (a custom batch_sampler or an IterableDataset '
           'cannot skip unloaded)')
    runner.logger.info(f'Resuming at iteration {runner.iter}: skipping the {batches} batches '
                       f'{where}already trained on, {how}.')


@LOOPS.register_module()
class ResumableIterBasedTrainLoop(IndexedBatches, IterBasedTrainLoop):
    """:class:`mmengine.runner.IterBasedTrainLoop` whose resume loads no skipped batch."""

    def __init__(self, runner: Any, dataloader: Any, *args: Any, **kwargs: Any):
        # MMEngine's __init__ builds the loader, then an _InfiniteDataloaderIterator (one
        # DataLoader iterator: one draw). The loader is built here as MMEngine would, so
        # that its sampler is wrapped and the streams are recorded just before that draw.
        dataloader, self._virtual = _built(runner, dataloader)
        self._sampler = make_resumable(dataloader, runner.seed, runner.rank)
        self._streams_at_start: Optional[dict] = rng_state()
        self._ours: Optional[EpochIterator] = None
        super().__init__(runner, dataloader, *args, **kwargs)

    # MMEngine's is a plain attribute; mypy takes no @override on a property over one
    @property  # type: ignore[override,explicit-override]
    def dataloader_iterator(self) -> EpochIterator:
        """The loop's :class:`EpochIterator` (an ``_InfiniteDataloaderIterator``)."""
        return cast(EpochIterator, self._ours)

    @dataloader_iterator.setter
    def dataloader_iterator(self, value: Any) -> None:
        if not isinstance(value, EpochIterator):  # MMEngine's __init__: ours goes on with it
            value = EpochIterator(self.dataloader, self._sampler, started=value,
                                  streams=self._streams_at_start, virtual=self._virtual)
            self._streams_at_start = None
        self._ours = value

    @property
    def iterator_streams(self) -> Optional[dict]:
        """The random streams the current epoch's iterator was created from."""
        return self.dataloader_iterator.streams

    @iterator_streams.setter
    def iterator_streams(self, streams: Optional[dict]) -> None:
        self.dataloader_iterator.streams = streams

    def batch_position(self, batch_idx: int) -> tuple[int, int]:
        """(epoch, batch number in its pass) of the batch the iterator returned last
        (``batch_idx`` is the iteration)."""
        return cast(EpochIterator, self._ours).position  # read every iteration: no property

    @override
    def run(self) -> Any:
        """MMEngine's ``run()``, whose advance over the trained iterations (a ``next()`` per
        iteration, dropped) loads nothing: the restore already started the iterator there."""
        self.dataloader_iterator.pass_over(self.iter)
        return super().run()

    @override
    def run_iter(self, data_batch: Any) -> None:
        """MMEngine's iteration; after a rollback, the loop goes on from the restored
        checkpoint's iteration (MMEngine's ``run()`` asks for the next batch)."""
        try:
            super().run_iter(data_batch)
        except RollBack as rollback:
            roll_back(self, rollback)

    def skip_trained_batches(self) -> None:
        """Start the iterator at the restored iteration (a resume, or a rollback), loading
        none of the batches before it."""
        iterator = self.dataloader_iterator
        iterator.start_at(self.iter)
        if self.iter:
            _log_skip(self.runner, self.iter, '', iterator.sampler is not None)
