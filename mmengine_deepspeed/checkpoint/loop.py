"""Train loops that resume exactly where a checkpoint was taken, without reloading data.

MMEngine's ``EpochBasedTrainLoop`` restarts an interrupted epoch from its
first batch (a checkpoint taken by iteration inside an epoch replays data),
and its ``IterBasedTrainLoop`` resumes by loading and dropping one batch per
trained iteration (80,000 batches decoded and augmented before the first step
of a resumed MMSegmentation schedule). These loops skip the batches already
trained on at the sampler (``data_order.py``): the sample order is the same
(the sampler is seeded by seed and epoch), nothing skipped is loaded, and the
time to the first resumed step does not grow with the resume point.
DeepSpeedRunner uses them wherever a config asks for MMEngine's loops.

Validation inside training runs on a copy of the random streams
(:class:`RandomStreamHook`): a checkpoint is taken before validation, so a
validation that drew random numbers would otherwise make the resumed run draw
other ones than the run that never stopped.
"""
from __future__ import annotations

import time
from typing import Any, Optional, cast

from mmengine.dataset import InfiniteSampler
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, LOOPS
from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop
from torch.utils.data import DataLoader
from typing_extensions import override

from .data_order import ResumableSampler, make_resumable
from .state import rng_state, set_rng_state


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


@LOOPS.register_module()
class ResumableEpochBasedTrainLoop(EpochBasedTrainLoop):
    """:class:`mmengine.runner.EpochBasedTrainLoop` that resumes mid-epoch exactly."""

    _skip_batches = 0

    def __init__(self, runner: Any, *args: Any, **kwargs: Any):
        super().__init__(runner, *args, **kwargs)
        self._sampler = make_resumable(self.dataloader, runner.seed, runner.rank)

    def skip_trained_batches(self) -> None:
        """Arrange to skip the batches of the current epoch already trained on.

        Called after the loop's ``_epoch`` / ``_iter`` were restored.
        """
        self._skip_batches = self._iter - self._epoch * len(self.dataloader)
        if self._skip_batches:
            _log_skip(self.runner, self._skip_batches, f'of epoch {self._epoch + 1} ',
                      self._sampler is not None)

    @override
    def run_epoch(self) -> None:
        """Iterate one epoch, from the first batch a mid-epoch checkpoint had not seen."""
        skip, self._skip_batches = self._skip_batches, 0
        if self._sampler is not None:
            self._sampler.begin(self._epoch, skip * int(self.dataloader.batch_size or 1))
        if not skip:
            super().run_epoch()
            return
        self.runner.call_hook('before_train_epoch')
        self.runner.model.train()
        for idx, data_batch in enumerate(self.dataloader, start=skip if self._sampler else 0):
            if idx >= skip:  # a custom batch_sampler: its skipped batches are loaded, dropped
                self.run_iter(idx, data_batch)
        self.runner.call_hook('after_train_epoch')
        self._epoch += 1


def _log_skip(runner: Any, batches: int, where: str, at_sampler: bool) -> None:
    how = ('at the sampler: nothing is loaded for them' if at_sampler else
           'by loading and dropping them (a custom batch_sampler or an IterableDataset '
           'cannot skip unloaded)')
    runner.logger.info(f'Resuming at iteration {runner.iter}: skipping the {batches} batches '
                       f'{where}already trained on, {how}.')


class EpochIterator:
    """Batches forever, epoch after epoch (MMEngine's ``_InfiniteDataloaderIterator``),
    able to start at any iteration without loading the batches before it.

    Args:
        loader (DataLoader): The train dataloader.
        sampler (ResumableSampler, optional): Its wrapped sampler; None where
            ``make_resumable`` left the loader as it was: batches are then loaded to
            be skipped.
    """

    def __init__(self, loader: DataLoader, sampler: Optional[ResumableSampler]):
        self.loader, self.sampler = loader, sampler
        self.epoch = 0
        self._iterator: Any = None  # the current epoch's DataLoader iterator
        self._skip = 0
        self._forwarding = 0

    def fast_forward(self, iterations: int) -> None:
        """Make the next ``iterations`` calls return None without loading anything, and
        the one after them the batch that iteration ``iterations`` would have seen."""
        if self.sampler is None:
            return  # MMEngine's loop loads and drops them, which stays exact
        self._forwarding = iterations
        per_epoch = len(self.loader)
        if isinstance(self.sampler.sampler, InfiniteSampler) or not per_epoch:
            self.epoch, within = 0, iterations  # one endless pass
        else:
            self.epoch, within = divmod(iterations, per_epoch)
        self._skip = within * int(self.loader.batch_size or 1)
        self._iterator = None

    def _start(self) -> None:
        sampler = self.loader.sampler
        if hasattr(sampler, 'set_epoch'):
            sampler.set_epoch(self.epoch)
        if self.sampler is not None:
            self.sampler.begin(self.epoch, self._skip)
        self._skip = 0
        self._iterator = iter(self.loader)

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._forwarding:
            self._forwarding -= 1
            return None
        if self._iterator is None:
            self._start()
        try:
            return next(self._iterator)
        except StopIteration:
            self.epoch += 1
            if self.loader.num_workers > 0:
                time.sleep(2)  # as MMEngine: workers can deadlock on an immediate restart
            self._start()
            return next(self._iterator)


@LOOPS.register_module()
class ResumableIterBasedTrainLoop(IterBasedTrainLoop):
    """:class:`mmengine.runner.IterBasedTrainLoop` whose resume loads no skipped batch."""

    def __init__(self, runner: Any, *args: Any, **kwargs: Any):
        super().__init__(runner, *args, **kwargs)
        # Ours in place of MMEngine's _InfiniteDataloaderIterator (the loop only calls next()).
        self.dataloader_iterator = cast(Any, EpochIterator(
            self.dataloader, make_resumable(self.dataloader, runner.seed, runner.rank)))

    def skip_trained_batches(self) -> None:
        """Arrange for ``run()``'s fast-forward over the trained iterations to load nothing."""
        iterator = cast(EpochIterator, self.dataloader_iterator)
        iterator.fast_forward(self._iter)
        if self._iter:
            _log_skip(self.runner, self._iter, '', iterator.sampler is not None)


@HOOKS.register_module()
class RandomStreamHook(Hook):
    """Validation during training leaves the training's random streams as they were.

    Python's, numpy's and torch's (CUDA's) RNG states are saved before and
    restored after each validation, so that the draws of a validation (a
    sampling model, a random test transform without workers) do not depend
    on whether the run was resumed after the checkpoint that preceded it.
    """

    priority = 'HIGHEST'

    def __init__(self) -> None:
        self._saved: Optional[dict] = None

    @override
    def before_val(self, runner: Any) -> None:
        self._saved = rng_state()

    @override
    def after_val(self, runner: Any) -> None:
        if self._saved is not None:
            set_rng_state(self._saved)
            self._saved = None
