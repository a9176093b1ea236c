"""The iteration loop's endless iterator over the train loader, able to start at any
iteration without loading the batches before it (``loops.ResumableIterBasedTrainLoop``)."""
from __future__ import annotations

import time
from typing import Any, Optional

from mmengine.dataset import InfiniteSampler
from torch.utils.data import DataLoader
from typing_extensions import override

from ..compat import InfiniteDataloaderIterator
from ..engine.virtual_ranks import VirtualRanks
from .order import ResumableSampler, create_iterator
from .virtual_ranks import drawn_from, samples_per_batch


class EpochIterator(InfiniteDataloaderIterator):
    """MMEngine's ``_InfiniteDataloaderIterator`` (batches forever, epoch after epoch),
    able to start at any iteration without loading the batches before it.

    As MMEngine's, it creates its first DataLoader iterator when it is built
    and each next one when an epoch ends; it records the random streams each
    was created from (:attr:`streams`).

    Args:
        loader (DataLoader): The train dataloader.
        sampler (ResumableSampler, optional): Its wrapped sampler; None where
            ``make_resumable`` left the loader as it was: batches are then loaded to
            be skipped.
        started (_InfiniteDataloaderIterator, optional): MMEngine's iterator over
            ``loader``, whose first DataLoader iterator this one goes on with.
            Defaults to None (create one now).
        streams (dict, optional): The random streams ``started`` was created
            from. Defaults to None.
        virtual (VirtualRanks, optional): A layout's virtual ranks on this rank, which
            draw what each DataLoader iterator's creation draws. Defaults to None.
    """

    def __init__(self, loader: DataLoader, sampler: Optional[ResumableSampler],
                 started: Optional[InfiniteDataloaderIterator] = None,
                 streams: Optional[dict] = None, virtual: Optional[VirtualRanks] = None):
        self.sampler = sampler
        self._virtual = virtual
        self._skip = 0
        self._batch = 0  # the next batch's number in its epoch's pass
        self.position = (0, -1)  # (epoch, batch number) of the batch last returned
        self._passing = 0
        self._restart = self._from_saved = False
        # MMEngine's __init__ (not called) sets these three and creates an iterator,
        # which _start() does here, recording the streams it was created from.
        self._dataloader, self._epoch = loader, 0
        self.streams = streams
        if started is None:
            self._start()
        else:  # MMEngine's, built by IterBasedTrainLoop: go on with its DataLoader iterator
            self._iterator = started._iterator

    def start_at(self, iterations: int) -> None:
        """Make the next batch the one iteration ``iterations`` would have seen, from an
        iterator created from the streams of that epoch's (once :attr:`streams` holds them:
        the checkpoint restores them after this call), loading nothing before it."""
        if self.sampler is None or not iterations:
            return  # MMEngine's loop loads and drops them, which stays exact
        per_epoch = len(self._dataloader)
        if isinstance(drawn_from(self.sampler.sampler), InfiniteSampler) or not per_epoch:
            self._epoch, within = 0, iterations  # one endless pass
        else:
            self._epoch, within = divmod(iterations, per_epoch)
        self._skip = within * samples_per_batch(self._dataloader)
        # At an epoch's start the run that never stopped created the iterator when the
        # first batch was asked for, from the streams of that moment: so does this one.
        self._restart = True
        self._from_saved = within > 0

    def pass_over(self, calls: int) -> None:
        """Make the next ``calls`` calls return None: MMEngine's ``run()`` asks for one batch
        per trained iteration and drops it, where :meth:`start_at` already skipped them."""
        if self.sampler is not None:
            self._passing = calls

    def _start(self, streams: Optional[dict] = None) -> None:
        sampler = self._dataloader.sampler
        if hasattr(sampler, 'set_epoch'):
            sampler.set_epoch(self._epoch)
        if self.sampler is not None:
            self.sampler.begin(self._epoch, self._skip)
        self._batch = self._skip // samples_per_batch(self._dataloader)
        self._skip = 0
        self._iterator, self.streams = create_iterator(self._dataloader, streams,
                                                       self._virtual)

    @override
    def __iter__(self) -> EpochIterator:
        return self

    @override
    def __next__(self) -> Any:
        if self._passing:
            self._passing -= 1
            return None
        if self._restart:
            self._restart = False
            self._start(self.streams if self._from_saved else None)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._epoch += 1
            if self._dataloader.num_workers > 0:
                time.sleep(2)  # as MMEngine: workers can deadlock on an immediate restart
            self._start()
            batch = next(self._iterator)
        self.position = (self._epoch, self._batch)
        self._batch += 1
        return batch
