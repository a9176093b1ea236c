"""data/virtual_ranks.py and engine/virtual_ranks.py: what one rank of a layout loads and
how its virtual ranks keep their own random streams and buffers (one process)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from mmengine.dataset import DefaultSampler, InfiniteSampler, default_collate
from torch import nn
from torch.utils.data import DataLoader

from mmengine_deepspeed.data.virtual_ranks import (
    SplitCollate,
    VirtualRanksSampler,
    run_as_virtual_ranks,
    samples_per_batch,
)
from mmengine_deepspeed.engine.virtual_ranks import MicroBatches, VirtualRanks
from mmengine_deepspeed.engine.wrapper import mean_log_vars


def _n_rank_indices(dataset: list, rank: int, world_size: int, epoch: int) -> list[int]:
    """What rank ``rank`` of ``world_size`` gets from MMEngine's DefaultSampler."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(7 + epoch))
    indices = order.tolist()
    total = -(-len(dataset) // world_size) * world_size
    indices = (indices * (total // len(indices) + 1))[:total]
    return indices[rank:total:world_size]


@pytest.mark.parametrize('first', [0, 2])
def test_each_virtual_rank_gets_what_its_rank_of_the_n_rank_run_gets(first: int) -> None:
    dataset = list(range(21))
    sampler = DefaultSampler(dataset, shuffle=True, seed=7)
    virtual = VirtualRanksSampler(sampler, first, 2, 4, batch_size=2)
    sampler.set_epoch(3)  # MMEngine's loops set the loader's own sampler's epoch
    given = list(virtual)
    assert len(virtual) == len(given) == 2 * 6  # ceil(21 / 4) each
    for j in range(2):
        mine = [int(i) for i in given if i.rank == first + j]  # type: ignore[attr-defined]
        assert mine == _n_rank_indices(dataset, first + j, 4, 3)
        assert [i.position for i in given if i.rank == first + j] == list(range(6))  # type: ignore
    # a batch of each in turn: 2 of rank first, 2 of rank first + 1, ...
    assert [i.rank for i in given[:8]] == [first] * 2 + [first + 1] * 2 + [first] * 2 + \
        [first + 1] * 2  # type: ignore[attr-defined]


def test_an_endless_sampler_is_split_as_its_n_rank_copies() -> None:
    dataset = list(range(10))
    virtual = VirtualRanksSampler(InfiniteSampler(dataset, seed=1), 1, 2, 4, batch_size=3)
    stream = iter(virtual)
    first = [next(stream) for _ in range(6)]
    assert [i.rank for i in first] == [1, 1, 1, 2, 2, 2]  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(1)  # MMEngine's endless order: permutations
    everything = [i for _ in range(2) for i in torch.randperm(10, generator=generator).tolist()]
    assert [int(i) for i in first[:3]] == everything[1::4][:3]
    assert [int(i) for i in first[3:]] == everything[2::4][:3]


def test_a_loader_gives_one_batch_per_virtual_rank_per_iteration() -> None:
    dataset = [torch.tensor([float(i)]) for i in range(16)]
    loader = DataLoader(dataset, batch_size=2, sampler=DefaultSampler(dataset, seed=0),
                        collate_fn=default_collate)
    run_as_virtual_ranks(loader, 0, 2, 2)
    assert len(loader) == 4 and samples_per_batch(loader) == 4  # as each of 2 ranks
    batches = list(loader)
    assert all(isinstance(b, MicroBatches) and len(b) == 2 for b in batches)
    assert all(part.shape == (2, 1) for b in batches for part in b)
    seen = sorted(int(x) for b in batches for part in b for x in part.flatten())
    assert seen == list(range(16))


def test_what_a_layout_cannot_split_is_refused() -> None:
    dataset = list(range(8))
    with pytest.raises(ValueError, match='DefaultSampler or InfiniteSampler'):
        VirtualRanksSampler(torch.utils.data.SequentialSampler(dataset), 0, 2, 2, 2)
    with pytest.raises(ValueError, match='round_up=True'):
        VirtualRanksSampler(DefaultSampler(dataset, round_up=False, seed=0), 0, 2, 2, 2)
    batched = DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match='default batch sampler'):
        run_as_virtual_ranks(batched, 0, 2, 2)
    small = DataLoader(dataset, batch_size=4, sampler=DefaultSampler(dataset, seed=0))
    with pytest.raises(ValueError, match=r'fewer than one batch.*4 x 4'):
        run_as_virtual_ranks(small, 0, 2, 4)
    with pytest.raises(RuntimeError, match='does not split'):
        SplitCollate(default_collate, 2)([1, 2, 3])


def test_each_virtual_rank_keeps_its_streams_and_buffers() -> None:
    """The rank's own are its first virtual rank's; another's are switched in for its
    micro-step only, and go on from where its last micro-step left them."""
    model = nn.BatchNorm1d(2)
    virtual = VirtualRanks(2, model)
    torch.manual_seed(0)
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def step(index: int) -> int:
        seen[index].append(torch.rand(2))
        if index == 1:
            model.train()(torch.randn(4, 2) * 5 + 3)
        return index * 10

    assert virtual.run_in_turn([0, 1], step) == 0  # the first's result
    assert torch.equal(seen[0][0], seen[1][0])  # both started from the rank's streams
    assert torch.equal(model.running_mean, torch.zeros(2))  # the rank's own buffers back
    other_mean = virtual.state_dict()['ranks'][1]['buffers'][0]  # type: ignore[index]
    assert not torch.equal(other_mean, torch.zeros(2))
    virtual.run_in_turn([0, 1], step)
    assert not torch.equal(seen[0][1], seen[1][1])  # rank 1's went on after its randn
    state: Any = virtual.state_dict()
    again = VirtualRanks(2, model)
    again.load_state_dict([state])
    assert torch.equal(again.state_dict()['ranks'][1]['buffers'][0],  # type: ignore[index]
                       state['ranks'][1]['buffers'][0])
    # the 2-rank layout resumed on 2 ranks: rank 1 runs virtual rank 1 as its own
    alone = VirtualRanks(1, model, first=1, world_size=2)
    alone.load_state_dict([state])
    assert torch.equal(model.running_mean, state['ranks'][1]['buffers'][0])
    with pytest.raises(ValueError, match=r'trained as the 2-rank layout.*layout.world_size=2'):
        VirtualRanks(4, model).load_state_dict([state])


def test_a_split_batch_logs_the_mean_of_its_micro_batches() -> None:
    """Each key's mean over the micro-batches that logged it (a conditional branch may log
    a key in some only); one micro-batch's log is its own."""
    one = {'loss': torch.tensor(1.0)}
    assert mean_log_vars([one]) is one
    logged = mean_log_vars([{'loss': torch.tensor(1.0), 'aux': torch.tensor(4.0)},
                            {'loss': torch.tensor(3.0)}])
    assert list(logged) == ['loss', 'aux']
    assert logged['loss'].item() == 2.0 and logged['aux'].item() == 4.0


def test_virtual_ranks_kept_are_put_back_for_a_retried_iteration() -> None:
    """Every virtual rank's streams and buffers as an iteration began (kept), put back
    after it ran: the retried iteration draws and normalises as the first attempt did;
    what was kept can be put back again (a second retry)."""
    model = nn.BatchNorm1d(2).train()
    virtual = VirtualRanks(2, model)

    def step(index: int) -> torch.Tensor:
        model(torch.randn(4, 2) * 5 + 3)
        return torch.rand(2)

    virtual.run_in_turn([0, 1], step)  # the virtual ranks have gone apart
    kept = virtual.kept()
    first, after_first = virtual.run_in_turn([0, 1], step), virtual.state_dict()
    virtual.run_in_turn([0, 1], step)  # and on
    for _ in range(2):
        virtual.put_back(kept)
        assert torch.equal(virtual.run_in_turn([0, 1], step), first)
        state = virtual.state_dict()
        for got, want in zip(state['ranks'], after_first['ranks']):  # type: ignore[index]
            assert all(map(torch.equal, got['buffers'], want['buffers']))
            assert torch.equal(got['streams']['torch'], want['streams']['torch'])
