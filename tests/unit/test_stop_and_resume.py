"""Unit tests of failure.py, preemption.py and checkpoint/data_order.py (one process)."""
from __future__ import annotations

import copy
import functools
import os
import pickle
import random
import signal
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from mmengine.dataset import DefaultSampler
from mmengine.dataset import worker_init_fn as mmengine_worker_init_fn
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.runner import Runner
from mmengine.runner.priority import get_priority
from torch.utils.data import DataLoader, Dataset

from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.checkpoint.data_order import (
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
from mmengine_deepspeed.compat import InfiniteDataloaderIterator
from mmengine_deepspeed.failure import is_failure
from mmengine_deepspeed.hooks.agreement import agreement_of
from mmengine_deepspeed.hooks.monitor import ThroughputHook
from mmengine_deepspeed.hooks.preemption import Preempted, PreemptionHook, _at_update_boundary
from mmengine_deepspeed.hooks.registration import (
    added_hooks,
    deepspeed_default_hooks,
    in_priority_order,
)
from mmengine_deepspeed.loops import EpochIterator
from tests.helpers import ToyDataset  # noqa: F401  registers it


class Noisy(Dataset):
    """Each item is random numbers from python, numpy and torch."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple:
        return (index, random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_a_preemption_exit_is_no_failure_but_an_error_is() -> None:
    assert not is_failure(Preempted(143))
    assert not is_failure(SystemExit(0)) and not is_failure(SystemExit(None))
    assert is_failure(SystemExit(2)) and is_failure(RuntimeError('x'))
    assert is_failure(KeyboardInterrupt())
    assert Preempted(143).code == 143


def test_preemption_hook_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'SIGTERMM'"):
        PreemptionHook(signals=['SIGTERMM'])
    with pytest.raises(ValueError, match='interval=0'):
        PreemptionHook(interval=0)


def test_signals_are_caught_only_inside_the_block() -> None:
    hook = PreemptionHook(signals=['SIGUSR1'])
    before = signal.getsignal(signal.SIGUSR1)
    with hook.catching_signals():
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
        assert hook.received == signal.SIGUSR1
        runner = SimpleNamespace(rank=0, world_size=1, hooks=[])
        hook.before_train(runner)  # no process group: this rank's own
        assert agreement_of(runner).agreed(0)['signal'] == [int(signal.SIGUSR1)]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_preemption_waits_for_an_accumulation_boundary() -> None:
    model = torch.nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    wrapper.initialize_count_status(model, 0, 10)
    wrapper._inner_count = 1  # after the first iteration: gradients pending
    assert not _at_update_boundary(wrapper)
    wrapper._inner_count = 2
    assert _at_update_boundary(wrapper)
    other = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    other.initialize_count_status(model, 0, 10)
    other._inner_count = 1
    wrapper._inner_count = 1
    assert not _at_update_boundary(OptimWrapperDict(a=other, b=wrapper))  # every one counts


def test_default_hooks_preemption_configures_the_runners_own_hook() -> None:
    """MMEngine's six default hooks stay six (``preemption`` is not registered); the key
    configures the PreemptionHook the runner runs beside them, None leaves it out."""
    assert 'preemption' not in deepspeed_default_hooks(None)
    assert 'preemption' not in deepspeed_default_hooks(dict(preemption=dict(interval=5)))

    def preemption(default_hooks: Any) -> list:
        return [h for h in added_hooks(default_hooks, None) if isinstance(h, PreemptionHook)]

    assert len(preemption(None)) == 1
    assert preemption(dict(preemption=None)) == []
    custom, = preemption(dict(preemption=dict(type='PreemptionHook', interval=5)))
    assert custom.interval == 5


def test_the_runners_own_hooks_run_in_priority_order_with_the_registered() -> None:
    registered = [Hook(), Hook()]
    registered[0].priority, registered[1].priority = 'VERY_HIGH', 'LOW'
    own = added_hooks(None, None)
    merged = in_priority_order(registered, own)
    assert merged[0] is registered[0] and set(map(id, merged)) == set(map(id, registered + own))
    priorities = [get_priority(h.priority) for h in merged]
    assert priorities == sorted(priorities)
    assert in_priority_order(merged, own) == merged  # a nested call adds nothing twice
    assert not any(isinstance(h, ThroughputHook)
                   for h in added_hooks(None, [dict(type='ThroughputHook', interval=3)]))


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
