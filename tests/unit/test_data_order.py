"""data/order.py and the loops' iterators (data/iterator.py): the resumable data stream,
in one process."""
from __future__ import annotations

import copy
import functools
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from mmengine.dataset import DefaultSampler
from mmengine.dataset import worker_init_fn as mmengine_worker_init_fn
from mmengine.runner import Runner
from torch.utils.data import DataLoader, Dataset

from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.compat import InfiniteDataloaderIterator
from mmengine_deepspeed.data.iterator import EpochIterator
from mmengine_deepspeed.data.order import (
    ResumableSampler,
    SampleIndex,
    SeedingWorkerInit,
    create_iterator,
    make_resumable,
    resumable_loader,
    seed_samples_in_worker,
    seed_workers,
    stream_seed,
)
from tests.helpers import ToyDataset  # noqa: F401  registers it


class Noisy(Dataset):
    """Each item is random numbers from python, numpy and torch."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple:
        return (index, random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_sampler_skips_without_touching_the_skipped_and_seeds_by_position() -> None:
    dataset = Noisy()
    sampler = DefaultSampler(dataset, shuffle=True, seed=3)
    order = list(sampler)
    wrapped = ResumableSampler(sampler, seed=3, rank=0, seeded=True)
    wrapped.begin(epoch=0)
    full = list(wrapped)
    assert [int(i) for i in full] == order and len(wrapped) == len(order)
    wrapped.begin(epoch=0, skip=4)
    resumed = list(wrapped)
    assert [(int(i), i.seed) for i in resumed] == [(int(i), i.seed) for i in full[4:]]
    wrapped.begin(epoch=1)
    assert [i.seed for i in wrapped] != [i.seed for i in full]  # other draws next epoch
    assert list(wrapped) == order  # the skip applied to one pass only
    assert wrapped.dataset is dataset  # attributes of the sampler read through


def test_sample_index_survives_the_trip_to_a_worker() -> None:
    index = pickle.loads(pickle.dumps(SampleIndex(7, 1234)))
    assert isinstance(index, SampleIndex) and index == 7 and index.seed == 1234
    assert [10, 11, 12, 13, 14, 15, 16, 17][index] == 17


def test_a_worker_dataset_reseeds_per_sample() -> None:
    dataset = Noisy()
    seed_samples_in_worker(dataset)
    assert isinstance(dataset, Noisy)
    first = dataset[SampleIndex(2, 99)]
    random.random(), np.random.rand(), torch.rand(3)  # the worker's stream moves on
    assert dataset[SampleIndex(2, 99)] == first
    assert dataset[SampleIndex(2, 98)] != first
    assert dataset[3][0] == 3  # plain indices as before
    assert stream_seed(1, 2, 3) == stream_seed(1, 2, 3) != stream_seed(1, 2, 4)


def test_iterators_draw_as_runners_and_can_be_drawn_from_saved_streams() -> None:
    """Created as MMEngine creates them, iterators draw their base seed from the global
    stream (Runner's parameters for random models); created from saved streams, they draw
    what they drew then and leave the current streams as they were (exact resume)."""
    loader = resumable_loader(DataLoader(Noisy(), batch_size=2, num_workers=0))
    assert loader.generator is None
    torch.manual_seed(5)
    plain_seed = iter(loader)._base_seed
    after_plain = torch.get_rng_state()
    torch.manual_seed(5)
    first, streams = create_iterator(loader, None)
    assert first._base_seed == plain_seed and torch.equal(torch.get_rng_state(), after_plain)
    torch.manual_seed(11)
    now = torch.get_rng_state()
    again, same = create_iterator(loader, streams)
    assert again._base_seed == plain_seed and same is streams
    assert torch.equal(torch.get_rng_state(), now)


def test_worker_init_fn_stays_mmengines_partial() -> None:
    """MMEngine's worker_init_fn partial (func and keywords) is kept, seeding added."""
    cfg = dict(batch_size=2, num_workers=2, dataset=dict(type='ToyDataset', size=8),
               sampler=dict(type='DefaultSampler', shuffle=True))
    ours = DeepSpeedRunner.build_dataloader(copy.deepcopy(cfg), seed=3)
    theirs = Runner.build_dataloader(copy.deepcopy(cfg), seed=3)
    assert isinstance(ours.worker_init_fn, functools.partial)
    assert isinstance(ours.worker_init_fn, SeedingWorkerInit)
    assert ours.worker_init_fn.func is theirs.worker_init_fn.func is mmengine_worker_init_fn
    assert ours.worker_init_fn.keywords == theirs.worker_init_fn.keywords
    restored = pickle.loads(pickle.dumps(ours.worker_init_fn))
    assert restored.keywords == theirs.worker_init_fn.keywords


def test_the_iteration_loops_iterator_is_mmengines_type_and_draws_as_it_does() -> None:
    dataset = Noisy()

    def loader() -> DataLoader:
        return DataLoader(dataset, batch_size=3, sampler=DefaultSampler(dataset, seed=1))

    torch.manual_seed(2)
    theirs = InfiniteDataloaderIterator(loader())
    after = torch.get_rng_state()
    torch.manual_seed(2)
    plain = loader()
    ours = EpochIterator(plain, make_resumable(plain, seed=1, rank=0))
    assert isinstance(ours, InfiniteDataloaderIterator)
    assert torch.equal(torch.get_rng_state(), after)
    assert [next(ours)[0].tolist() for _ in range(8)] == [
        next(theirs)[0].tolist() for _ in range(8)]


def test_make_resumable_wraps_the_default_batch_sampler_only() -> None:
    dataset = Noisy()
    loader = DataLoader(dataset, batch_size=3, sampler=DefaultSampler(dataset, seed=1),
                        num_workers=2)
    seed_workers(loader)
    wrapper = make_resumable(loader, seed=1, rank=0)
    assert wrapper is not None and wrapper.seeded
    assert loader.batch_sampler.sampler is wrapper and loader.sampler is wrapper.sampler
    assert make_resumable(loader, seed=1, rank=0) is wrapper
    wrapper.begin(0, skip=3)
    assert [b[0].tolist() for b in loader] == [
        b[0].tolist() for b in DataLoader(dataset, batch_size=3,
                                          sampler=DefaultSampler(dataset, seed=1))][1:]
    custom = DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])
    assert make_resumable(custom, seed=1, rank=0) is None


def test_workers_give_the_same_samples_whatever_was_skipped(tmp_path: Any) -> None:
    dataset = Noisy()

    def batches(skip: int) -> list:
        loader = DataLoader(dataset, batch_size=2, sampler=DefaultSampler(dataset, seed=1),
                            num_workers=2)
        seed_workers(loader)
        wrapper = make_resumable(loader, seed=1, rank=0)
        assert wrapper is not None
        wrapper.begin(0, skip=skip)
        return [[float(x) for x in column] for batch in loader for column in batch[1:]]

    assert batches(4) == batches(0)[len(batches(0)) - len(batches(4)):]


def test_worker_transforms_do_not_depend_on_the_number_of_workers() -> None:
    dataset = Noisy()

    def samples(workers: int) -> list:
        loader = DataLoader(dataset, batch_size=2, sampler=DefaultSampler(dataset, seed=1),
                            num_workers=workers)
        seed_workers(loader)
        make_resumable(loader, seed=1, rank=0)
        return [[float(x) for x in column] for batch in loader for column in batch[1:]]

    assert samples(1) == samples(2)


def test_iterable_datasets_are_skipped_by_loading() -> None:
    """Their data does not come through the sampler's indices: skipping those would
    restart the stream at its beginning."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(100))

    assert make_resumable(DataLoader(Stream(), batch_size=2), seed=0, rank=0) is None
    assert not hasattr(ResumableSampler.__new__(ResumableSampler), 'set_epoch')


def test_excluded_samples_are_replaced_in_place_and_a_resumed_pass_agrees() -> None:
    """Each left-out index becomes the one before it (the first after it at the pass's
    start): as many indices at the same positions and seeds, so ranks keep their batch
    counts; a pass resumed inside the epoch gives what the whole pass gave from there."""
    sampler = DefaultSampler(Noisy(), shuffle=True, seed=3)
    order = list(sampler)
    wrapped = ResumableSampler(sampler, seed=3, rank=0, seeded=True)
    wrapped.exclude([order[0], order[1], order[5]])
    wrapped.begin(epoch=0)
    full = list(wrapped)
    expected = [order[2], order[2], order[2], order[3], order[4], order[4], *order[6:]]
    assert [int(i) for i in full] == expected
    assert [i.seed for i in full] == [stream_seed(3, 0, 0, p) for p in range(len(order))]
    wrapped.begin(epoch=0, skip=4)
    assert [(int(i), i.seed) for i in wrapped] == [(int(i), i.seed) for i in full[4:]]
    assert wrapped.given_out(0, 4, 6) == [order[4], order[4]]  # what the pass gave out last
    wrapped.exclude(order)
    wrapped.begin(epoch=0)
    with pytest.raises(ValueError, match='leaves out every index'):
        list(wrapped)
