"""The training data stream, made resumable without loading what was already seen.

Three things make a resumed run draw exactly the random numbers the
uninterrupted run drew, and start in seconds wherever it resumes, while the
run draws from the global random streams exactly where MMEngine's Runner does
(so one config gives Runner's parameters):

* **Iterators are created from the stream they were created from.** Creating
  a DataLoader iterator draws its base seed from the global torch RNG (as
  with Runner: loaders keep ``generator=None``). The loops record the streams
  just before each epoch's iterator is created (``loop.py``); a run resumed
  inside that epoch creates its iterator from them, then returns to the
  streams of the checkpoint (:func:`create_iterator`).
* **Skipping happens at the sampler.** :class:`ResumableSampler` wraps the
  sampler that the DataLoader's batch sampler iterates and drops the
  indices of batches already trained on, so nothing is loaded or
  transformed for them (MMEngine's ``IterBasedTrainLoop`` calls ``next()``
  once per trained iteration instead).
* **Worker-side randomness is per sample.** A DataLoader worker's RNG
  advances with every sample it transforms, so skipping samples would
  shift it. With workers, each index carries a seed derived from
  (seed, rank, epoch, position in the epoch) (:class:`SampleIndex`), and the
  worker reseeds python, numpy and torch from it before transforming that
  sample: a sample's random transform no longer depends on which worker
  fetched it or on what was skipped (and so differs from the one Runner's
  per-worker streams give: docs/differences.md says so). Without workers the transforms
  draw from the main process's stream, as with Runner, which the checkpoint
  restores as it was right after the last trained batch.

The wrapped sampler also remembers the indices it gave out last (which samples
a batch held, for the log of a step that was not finite) and can leave samples
out (``exclude_samples``, a rollback past bad data: ``guard/hook.py``): each
excluded index is replaced by the one before it in the rank's pass (by the first
one after it at the pass's start), so every rank keeps as many batches, of the same
size, at the same positions, and a run told to leave samples out from its start
sees exactly what a run that left them out from a later checkpoint sees.

A custom ``batch_sampler`` (grouped batches) and an ``IterableDataset`` are
not wrapped: their skipped batches are loaded and dropped, as MMEngine does,
which stays exact.
"""
from __future__ import annotations

import functools
import hashlib
import random
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info
from typing_extensions import override

from ..engine.virtual_ranks import VirtualRanks
from ..random_streams import rng_state, set_rng_state


def stream_seed(*parts: int) -> int:
    """A 32-bit seed from integers (numpy accepts no more), stable across processes."""
    digest = hashlib.blake2b('/'.join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, 'little')


def resumable_loader(loader: DataLoader) -> DataLoader:
    """``loader`` with workers that reseed per :class:`SampleIndex` (see :func:`seed_workers`).

    Returns:
        DataLoader: ``loader``.
    """
    seed_workers(loader)
    return loader


def create_iterator(loader: DataLoader, streams: Optional[dict],
                    virtual: Optional[VirtualRanks] = None) -> tuple[Any, dict]:
    """``iter(loader)``, drawn from ``streams`` when given, and the streams it was drawn from.

    Args:
        loader (DataLoader): The training dataloader.
        streams (dict, optional): The random streams (:func:`state.rng_state`)
            an earlier run created this epoch's iterator from; the current
            streams are put back afterwards. None creates it from the current
            streams, as MMEngine does.
        virtual (VirtualRanks, optional): A layout's virtual ranks on this rank: a new
            iterator (not one from ``streams``, whose draw the checkpoint's streams of
            every virtual rank hold) is drawn by each, as each rank of the N-rank run
            creates its own. Defaults to None.

    Returns:
        tuple[Any, dict]: The iterator, and the streams it was created
        from (for the checkpoint).
    """
    now = rng_state()
    if streams is None:
        iterator = iter(loader)
        if virtual is not None:
            virtual.new_loader_iterator()
        return iterator, now
    set_rng_state(streams)
    try:
        return iter(loader), streams
    finally:
        set_rng_state(now)


class SampleIndex(int):
    """A dataset index that carries the seed of its sample's random transforms."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SampleIndex:
        made = super().__new__(cls, index)
        made.seed = seed
        return made

    @override
    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return SampleIndex, (int(self), self.seed)


# How many given-out indices a sampler remembers (for the log of a bad step).
RECENT_INDICES = 1 << 16


def substituted(indices: Iterator[int], excluded: frozenset[int]) -> Iterator[int]:
    """``indices``, each excluded one replaced by the last one before it that is not (at
    the start, by the first one after it): as many indices, at the same positions."""
    last: Optional[int] = None
    waiting = 0
    for index in indices:
        if int(index) not in excluded:
            for _ in range(waiting):
                yield index
            waiting, last = 0, index
            yield index
        elif last is None:
            waiting += 1
        else:
            yield last
    if waiting:
        raise ValueError(f'exclude_samples leaves out every index this rank\'s sampler gives '
                         f'({waiting}): there is nothing to train on; exclude fewer samples.')


class ResumableSampler(Sampler):
    """A sampler that can start its next pass ``skip`` indices in, and seeds indices.

    Args:
        sampler (Sampler): The sampler the batch sampler iterated.
        seed (int): The run's seed.
        rank (int): This process's rank.
        seeded (bool): Yield :class:`SampleIndex` (for loaders with workers).
    """

    def __init__(self, sampler: Sampler, seed: int, rank: int, seeded: bool):
        self.sampler, self.seed, self.rank, self.seeded = sampler, seed, rank, seeded
        self.epoch = 0
        self._skip = 0
        self.excluded: frozenset[int] = frozenset()
        # (epoch, position in the pass, index) of the last indices given out
        self._recent: deque[tuple[int, int, int]] = deque(maxlen=RECENT_INDICES)

    def begin(self, epoch: int, skip: int = 0) -> None:
        """Make the next pass the one of ``epoch``, starting ``skip`` indices in."""
        self.epoch, self._skip = epoch, skip

    def exclude(self, indices: Iterable[int]) -> None:
        """Leave these dataset indices out of every pass that starts from now on."""
        self.excluded = frozenset(int(i) for i in indices)

    def given_out(self, epoch: int, start: int, stop: int) -> list[int]:
        """The dataset indices given out at positions ``[start, stop)`` of ``epoch``'s pass,
        as far as the last :data:`RECENT_INDICES` reach (the latest pass's, where a
        rollback gave a position out again)."""
        latest = {position: index for e, position, index in self._recent
                  if e == epoch and start <= position < stop}
        return [latest[position] for position in sorted(latest)]

    @override
    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        leaving_out = getattr(self.sampler, 'leaving_out', None)  # a layout's, per virtual rank
        indices = iter(self.sampler) if not self.excluded else (
            leaving_out(self.excluded) if leaving_out is not None
            else substituted(iter(self.sampler), self.excluded))
        for _ in range(skip):  # index arithmetic only: nothing is loaded
            next(indices, None)
        for position, index in enumerate(indices, start=skip):
            self._recent.append((self.epoch, position, int(index)))
            if not self.seeded:
                yield index
                continue
            # a layout's index seeds as its virtual rank's (virtual_ranks.VirtualIndex)
            rank = getattr(index, 'rank', self.rank)
            at = getattr(index, 'position', position)
            yield SampleIndex(index, stream_seed(self.seed, rank, self.epoch, at))

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # set_epoch, dataset, ...: what code holding the batch sampler reads
        sampler = self.__dict__.get('sampler')
        if sampler is None:  # not initialised yet (copy, pickle)
            raise AttributeError(name)
        return getattr(sampler, name)


def _seeded_getitem(getitem: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def getitem_seeded(dataset: Any, index: Any) -> Any:
        if isinstance(index, SampleIndex):
            random.seed(index.seed)
            np.random.seed(index.seed)
            torch.manual_seed(index.seed)
            index = int(index)
        return getitem(dataset, index)
    return getitem_seeded


_SEEDED_CLASSES: dict[type, type] = {}


def seed_samples_in_worker(dataset: Any) -> None:
    """In a worker, make ``dataset`` reseed from each :class:`SampleIndex` it gets.

    The worker's copy of the dataset gets a subclass of its own class (the
    same object otherwise), whose ``__getitem__`` reseeds first: the user's
    dataset in the main process is untouched.
    """
    cls = type(dataset)
    if cls not in _SEEDED_CLASSES:
        _SEEDED_CLASSES[cls] = type(cls.__name__, (cls,), {
            '__getitem__': _seeded_getitem(cls.__getitem__), '__module__': cls.__module__})
    try:
        dataset.__class__ = _SEEDED_CLASSES[cls]
    except TypeError as e:  # a class with __slots__ or a native base
        warnings.warn(f'{cls.__name__} cannot take per-sample seeds ({e}): its random '
                      'transforms in DataLoader workers will not resume exactly.', stacklevel=1)


class SeedingWorkerInit(functools.partial):
    """The loader's ``worker_init_fn``, then per-sample seeding of the worker's dataset.

    A ``functools.partial`` like MMEngine's own (``func``, ``args`` and
    ``keywords`` are those of the function it replaces), so code that reads
    ``worker_init_fn.func`` sees MMEngine's ``worker_init_fn``.
    """

    @override
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = super().__call__(*args, **kwargs)
        info = get_worker_info()
        if info is not None:
            seed_samples_in_worker(info.dataset)
        return result


def _no_init(worker_id: int) -> None:
    """The stand-in ``func`` of a loader that had no ``worker_init_fn``."""


def seed_workers(loader: DataLoader) -> None:
    """Make ``loader``'s workers reseed from each :class:`SampleIndex` they fetch.

    Set when the loader is built, before any iterator starts (persistent)
    workers; indices without a seed are fetched as before.
    """
    if loader.num_workers > 0 and not isinstance(loader.worker_init_fn, SeedingWorkerInit):
        loader.worker_init_fn = SeedingWorkerInit(loader.worker_init_fn or _no_init)


def make_resumable(loader: DataLoader, seed: int, rank: int) -> Optional[ResumableSampler]:
    """Wrap the sampler that ``loader``'s default batch sampler iterates.

    Returns:
        ResumableSampler | None: The wrapper; None for a custom
        ``batch_sampler``, a loader without batches, or an ``IterableDataset``
        (whose data does not come through indices): left as they are, their
        skipped batches are loaded and dropped.
    """
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None or batch_sampler is None \
            or isinstance(loader.dataset, IterableDataset):
        return None
    current = batch_sampler.sampler  # type: ignore[attr-defined]
    if isinstance(current, ResumableSampler):
        return current
    wrapper = ResumableSampler(current, seed, rank,
                               seeded=isinstance(loader.worker_init_fn, SeedingWorkerInit))
    batch_sampler.sampler = wrapper  # type: ignore[attr-defined]
    return wrapper
