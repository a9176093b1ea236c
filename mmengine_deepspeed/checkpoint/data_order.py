"""The training data stream, made resumable without loading what was already seen.

Three things make a resumed run draw exactly the random numbers the
uninterrupted run drew, and start in seconds wherever it resumes:

* **Iterators draw from their own generator.** Creating a DataLoader
  iterator draws a seed from the global torch RNG unless the loader has a
  ``generator``; the resumed loop creates its iterators at other points of
  that stream than the straight run did, shifting every later dropout mask
  and ``torch.randn``. :func:`resumable_loader` gives every runner dataloader
  one (seeded by seed and rank), so the global stream belongs to the model.
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
  fetched it or on what was skipped. Without workers the transforms draw
  from the main process's stream, which the checkpoint restores as it was
  right after the last trained batch.

A custom ``batch_sampler`` (grouped batches) and an ``IterableDataset`` are
not wrapped: their skipped batches are loaded and dropped, as MMEngine does,
which stays exact.
"""
from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info
from typing_extensions import override


def stream_seed(*parts: int) -> int:
    """A 32-bit seed from integers (numpy accepts no more), stable across processes."""
    digest = hashlib.blake2b('/'.join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, 'little')


def resumable_loader(loader: DataLoader, seed: Optional[int], rank: int) -> DataLoader:
    """``loader`` with a generator of its own (unless it has one) and seeding workers.

    Its iterators then draw their worker base seed from that generator, not
    from the global torch RNG (``torch.utils.data`` draws from
    ``loader.generator``), and its workers reseed per :class:`SampleIndex`.

    Returns:
        DataLoader: ``loader``.
    """
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(stream_seed(seed or 0, rank, 0x10AD))
    seed_workers(loader)
    return loader


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

    def begin(self, epoch: int, skip: int = 0) -> None:
        """Make the next pass the one of ``epoch``, starting ``skip`` indices in."""
        self.epoch, self._skip = epoch, skip

    @override
    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        indices = iter(self.sampler)
        for _ in range(skip):  # index arithmetic only: nothing is loaded
            next(indices, None)
        for position, index in enumerate(indices, start=skip):
            yield (SampleIndex(index, stream_seed(self.seed, self.rank, self.epoch, position))
                   if self.seeded else index)

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


class _WorkerInit:
    """The loader's ``worker_init_fn``, then per-sample seeding of the worker's dataset."""

    def __init__(self, init: Optional[Callable[[int], None]]):
        self.init = init

    def __call__(self, worker_id: int) -> None:
        if self.init is not None:
            self.init(worker_id)
        info = get_worker_info()
        if info is not None:
            seed_samples_in_worker(info.dataset)


def seed_workers(loader: DataLoader) -> None:
    """Make ``loader``'s workers reseed from each :class:`SampleIndex` they fetch.

    Set when the loader is built, before any iterator starts (persistent)
    workers; indices without a seed are fetched as before.
    """
    if loader.num_workers > 0 and not isinstance(loader.worker_init_fn, _WorkerInit):
        loader.worker_init_fn = _WorkerInit(loader.worker_init_fn)


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
                               seeded=isinstance(loader.worker_init_fn, _WorkerInit))
    batch_sampler.sampler = wrapper  # type: ignore[attr-defined]
    return wrapper
