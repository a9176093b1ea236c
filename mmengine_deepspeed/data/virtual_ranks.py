"""A layout's training data: each rank loads its virtual ranks' batches of one iteration.

With ``layout=dict(world_size=N)`` on W ranks (``config/layout.py``), rank r runs the
virtual ranks r*k ... r*k+k-1 (k = N/W). Its sampler (:class:`VirtualRanksSampler`) is
the loader's own, N-rank sampler k times over, one per virtual rank (MMEngine's
``DefaultSampler`` / ``InfiniteSampler`` with that rank and N ranks: the indices rank v of
the N-rank run gets); each iteration's batch is the k virtual ranks' batches in turn, and
the loader's collate splits it back into one batch per virtual rank
(:class:`SplitCollate`, a :class:`~.engine.virtual_ranks.MicroBatches`). One loader batch is
one iteration, so ``len(loader)``, epochs and schedules mean what they mean on N ranks.

Each index carries its virtual rank and its position in that rank's pass
(:class:`VirtualIndex`), so that a sample's seed in a worker (``order.py``) is the one the
N-rank run gives it.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any, Callable, cast

from mmengine.dataset import DefaultSampler, InfiniteSampler
from torch.utils.data import BatchSampler, DataLoader, Sampler
from typing_extensions import override

from ..engine.virtual_ranks import MicroBatches
from .order import substituted


class VirtualIndex(int):
    """A dataset index with the virtual rank it goes to and its position in that rank's
    pass (what seeds the sample in a worker)."""

    rank: int
    position: int

    def __new__(cls, index: int, rank: int, position: int) -> VirtualIndex:
        made = super().__new__(cls, index)
        made.rank, made.position = rank, position
        return made

    @override
    def __reduce__(self) -> tuple[Any, ...]:
        return VirtualIndex, (int(self), self.rank, self.position)


def _as_rank(sampler: Sampler, rank: int, world_size: int) -> Sampler:
    """A copy of MMEngine's sampler as rank ``rank`` of ``world_size`` builds it."""
    copied = copy.copy(sampler)
    copied.rank, copied.world_size = rank, world_size  # type: ignore[attr-defined]
    if isinstance(sampler, DefaultSampler):
        if not sampler.round_up:
            raise ValueError(
                'layout needs the sampler\'s round_up=True (MMEngine\'s default): with '
                'round_up=False ranks get different numbers of samples, which one rank\'s '
                'virtual ranks cannot step together. Remove round_up=False from '
                'train_dataloader.sampler.')
        copied.num_samples = math.ceil(len(sampler.dataset) / world_size)  # type: ignore
        copied.total_size = copied.num_samples * world_size  # type: ignore[attr-defined]
    else:
        copied.indices = copied._indices_of_rank()  # type: ignore[attr-defined]
    return copied


class VirtualRanksSampler(Sampler):
    """The indices of one rank's virtual ranks, a batch of each in turn.

    Args:
        sampler (DefaultSampler | InfiniteSampler): The loader's sampler (its epoch is
            followed: MMEngine's loops call ``set_epoch`` on it).
        first (int): The first virtual rank of this rank.
        count (int): The virtual ranks of this rank.
        world_size (int): The layout's ranks (N).
        batch_size (int): One virtual rank's batch.
    """

    def __init__(self, sampler: Sampler, first: int, count: int, world_size: int,
                 batch_size: int):
        if type(sampler) not in (DefaultSampler, InfiniteSampler):
            raise ValueError(
                f'layout needs MMEngine\'s DefaultSampler or InfiniteSampler in '
                f'train_dataloader.sampler (it gives each virtual rank what that rank of the '
                f'{world_size}-rank run gets); this config has {type(sampler).__name__}.')
        self.sampler, self.batch_size = sampler, batch_size
        self.ranks = [_as_rank(sampler, first + j, world_size) for j in range(count)]

    @override
    def __iter__(self) -> Iterator[int]:
        return self.leaving_out(frozenset())

    def leaving_out(self, excluded: frozenset[int]) -> Iterator[int]:
        """A pass with the ``excluded`` dataset indices left out of each virtual rank's own
        pass, as that rank of the N-rank run leaves them out of its (``order.py``'s
        substitution, per virtual rank)."""
        epoch = getattr(self.sampler, 'epoch', None)
        for rank in self.ranks:
            if epoch is not None:
                rank.epoch = epoch  # type: ignore[attr-defined]
        streams = [substituted(iter(rank), excluded) if excluded else iter(rank)
                   for rank in self.ranks]
        position = 0
        while True:
            chunks = [[next(stream, None) for _ in range(self.batch_size)]
                      for stream in streams]
            chunks = [[i for i in chunk if i is not None] for chunk in chunks]
            if not chunks[0]:
                return
            for rank, chunk in zip(self.ranks, chunks):
                for at, index in enumerate(chunk):
                    yield VirtualIndex(index, rank.rank, position + at)  # type: ignore
            position += len(chunks[0])

    def __len__(self) -> int:
        return sum(len(cast(Any, rank)) for rank in self.ranks)

    def __getattr__(self, name: str) -> Any:
        sampler = self.__dict__.get('sampler')
        if sampler is None:
            raise AttributeError(name)
        return getattr(sampler, name)


class SplitCollate:
    """The loader's collate, once per micro-batch of a batch (a virtual rank's batch, or
    its equal parts where ``layout.micro_batches`` splits it).

    Args:
        collate (Callable): The loader's ``collate_fn``.
        count (int): The micro-batches a batch holds, in equal parts.
    """

    def __init__(self, collate: Callable[[list], Any], count: int):
        self.collate, self.count = collate, count

    def __call__(self, samples: list) -> MicroBatches:
        size, rest = divmod(len(samples), self.count)
        if rest:
            raise RuntimeError(f'A batch of {len(samples)} samples does not split into '
                               f'{self.count} micro-batches.')
        return MicroBatches(self.collate(samples[j * size:(j + 1) * size])
                            for j in range(self.count))


def run_as_virtual_ranks(loader: DataLoader, first: int, count: int, world_size: int,
                         split: int = 1) -> None:
    """Make ``loader`` give this rank's ``count`` virtual ranks' batches of each iteration
    (from virtual rank ``first``, of ``world_size``), each in ``split`` micro-batches
    (``layout.micro_batches``, checked to divide the batch), before any iterator is
    created.

    Raises:
        ValueError: A custom batch sampler, an ``IterableDataset``, a sampler other than
            MMEngine's, or a dataset too small for the layout.
    """
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None or type(batch_sampler) is not BatchSampler:
        raise ValueError(
            'layout needs the loader\'s default batch sampler (the batches of each virtual '
            'rank are made from its sampler); remove train_dataloader.batch_sampler.')
    batch_size = int(loader.batch_size)
    samples = len(loader.dataset)  # type: ignore[arg-type]
    if samples < world_size * batch_size:
        raise ValueError(
            f'The training dataset has {samples} samples, fewer than one batch for each of '
            f'the layout\'s {world_size} ranks ({world_size} x {batch_size}): lower '
            'layout.world_size or train_dataloader.batch_size.')
    sampler = VirtualRanksSampler(batch_sampler.sampler, first, count,  # type: ignore
                                  world_size, batch_size)
    batch_sampler.sampler = sampler
    batch_sampler.batch_size = batch_size * count
    loader.collate_fn = SplitCollate(loader.collate_fn, count * split)


def drawn_from(sampler: Sampler) -> Sampler:
    """The loader's own sampler, under a layout's :class:`VirtualRanksSampler`."""
    return sampler.sampler if isinstance(sampler, VirtualRanksSampler) else sampler


def samples_per_batch(loader: DataLoader) -> int:
    """The samples of one loader batch (one iteration): the batch sampler's, which a layout
    makes its virtual ranks' together."""
    return int(getattr(loader.batch_sampler, 'batch_size', None) or loader.batch_size or 1)
