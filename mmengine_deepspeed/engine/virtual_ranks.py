"""One rank's virtual ranks: a batch each, their own random streams and buffers.

With ``layout=dict(world_size=N)`` on W ranks, each rank runs k = N/W virtual ranks as the
accumulation micro-steps of one iteration (``config/layout.py``). Rank r's loader gives
one :class:`MicroBatches` per iteration: the batches virtual ranks r*k ... r*k+k-1 get in
the N-rank run, in that order. Each micro-step runs with its virtual rank's random streams
(dropout, drop-path, random masking) and buffers (BatchNorm's running statistics), as the
N-rank run's rank would: the rank's own streams and buffers are its first virtual rank's,
and those of the others are kept here and switched in for their micro-step only.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from ..random_streams import (
    RawStreams,
    raw_form,
    raw_streams,
    saved_form,
    set_raw_streams,
)


def loader_iterator_draw() -> None:
    """What creating a DataLoader iterator draws from torch's default generator (a loader
    without its own ``generator``): the iterator's base seed, one int64
    (``torch.utils.data.dataloader._BaseDataLoaderIter``; tests/dist/test_layout.py's
    dropout runs fail where this differs)."""
    torch.empty((), dtype=torch.int64).random_()


class MicroBatches(list):
    """The batches of one iteration, one per virtual rank of this rank, in order."""


class VirtualRanks:
    """The random streams and buffers of this rank's virtual ranks after its first.

    An iteration runs its micro-steps in turn, switching once from each virtual rank to the
    next and from the last back to the first (k switches, each one read and one set of the
    four streams and a copy of the buffers each way).

    Args:
        count (int): The virtual ranks this rank runs (k).
        model (nn.Module): The user's model (whose buffers each virtual rank keeps).
        first (int): This rank's first virtual rank. Defaults to 0.
        world_size (int, optional): The layout's ranks (N). Defaults to ``count``.
        split (int): The micro-batches each virtual rank's batch runs in
            (``layout.micro_batches``). Defaults to 1.
    """

    def __init__(self, count: int, model: nn.Module, first: int = 0,
                 world_size: Optional[int] = None, split: int = 1):
        self.count, self.first, self.split = count, first, split
        self.world_size = world_size if world_size is not None else count
        self._buffers = [b for b in model.buffers() if b is not None]
        # per virtual rank: its (streams, buffers) as it left them; None until training
        # starts. The first's are live between iterations (its slot is filled when
        # another runs).
        self._slots: Optional[list[tuple[RawStreams, list[torch.Tensor]]]] = None

    @property
    def micro_steps(self) -> int:
        """Backwards per iteration: every virtual rank's micro-batches."""
        return self.count * self.split

    def begin(self) -> None:
        """Before an iteration: at the first, every virtual rank starts from this rank's
        streams and buffers (the N-rank run's ranks all start alike: the same seed, the
        same draws before training)."""
        if self._slots is None:
            streams = raw_streams()
            self._slots = [(streams, [b.detach().clone() for b in self._buffers])
                           for _ in range(self.count)]

    def run_in_turn(self, batches: list[Any], step: Callable[[Any], Any]) -> Any:
        """``step`` of each virtual rank's batch, each under its streams and buffers;
        returns the first's result (rank 0's, in the N-rank run's log)."""
        self.begin()
        first, at = None, 0
        try:
            for index, batch in enumerate(batches):
                self._switch(at, index)
                at = index
                result = step(batch)
                first = result if index == 0 else first
        finally:
            self._switch(at, 0)
        return first

    def _every(self) -> list[tuple[RawStreams, list[torch.Tensor]]]:
        """Every virtual rank's streams and buffers between iterations (the first's are the
        live ones; not copied)."""
        assert self._slots is not None
        return [(raw_streams(), self._buffers), *self._slots[1:]]

    def kept(self) -> list[tuple[RawStreams, list[torch.Tensor]]]:
        """Every virtual rank's streams and buffers as they are between iterations, copied:
        what :meth:`put_back` restores (an iteration retried from its start)."""
        self.begin()
        return [(streams, [b.detach().clone() for b in buffers])
                for streams, buffers in self._every()]

    def put_back(self, kept: list[tuple[RawStreams, list[torch.Tensor]]]) -> None:
        """Every virtual rank's streams and buffers as ``kept`` has them (:meth:`kept`'s, or a
        checkpoint's): the first's become this rank's own; ``kept`` stays usable again."""
        (streams, buffers), *others = kept
        set_raw_streams(streams)
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, buffers)  # (see _switch)
        self._slots = [(streams, [b.detach().clone() for b in self._buffers]),
                       *((raw, [b.clone() for b in own]) for raw, own in others)]

    def new_loader_iterator(self) -> None:
        """Make the other virtual ranks draw what this rank drew creating a DataLoader
        iterator (the training loader's each epoch, the validation loader's each
        validation: each rank of the N-rank run creates its own), so that their streams
        stay those of their ranks. Before training nothing is kept yet: they start from
        this rank's streams, which hold the draw."""
        if self._slots is None:
            return
        self.run_in_turn(list(range(self.count)),
                         lambda index: loader_iterator_draw() if index else None)

    def _switch(self, current: int, to: int) -> None:
        """Keep virtual rank ``current``'s streams and buffers, put ``to``'s in place."""
        if current == to:
            return
        assert self._slots is not None, 'begin() starts the virtual ranks'
        _, kept = self._slots[current]
        self._slots[current] = (raw_streams(), kept)
        streams, buffers = self._slots[to]
        set_raw_streams(streams)
        if self._buffers:
            # torch's private _foreach_copy_ (what torch.optim's foreach paths use): one
            # dispatch for all buffers instead of one per tensor, half a switch's copy time
            # on a host-bound step; tests/unit/test_data_virtual_ranks.py pins the copies.
            with torch.no_grad():
                torch._foreach_copy_(kept, self._buffers)
                torch._foreach_copy_(self._buffers, buffers)

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every virtual rank's streams and buffers on this rank, its own first (None
        before training): what any number of ranks resuming the layout takes them from."""
        if self._slots is None:
            return None
        return dict(world_size=self.world_size, first=self.first, ranks=[
            dict(streams=saved_form(streams),
                 buffers=[b.detach().cpu().clone() for b in buffers])
            for streams, buffers in self._every()])

    def load_state_dict(self, saved: list[Optional[dict[str, Any]]]) -> None:
        """This rank's virtual ranks from what every saved rank held (:meth:`state_dict`,
        by saved rank): the first's streams and buffers become this rank's own."""
        by_rank: dict[int, dict[str, Any]] = {}
        for state in saved:
            if state is None:
                continue
            if state['world_size'] != self.world_size:
                raise ValueError(
                    f'The checkpoint trained as the {state["world_size"]}-rank layout; this '
                    f'run is set to {self.world_size}. Resume with layout.world_size='
                    f'{state["world_size"]}.')
            for offset, entry in enumerate(state['ranks']):
                by_rank[state['first'] + offset] = entry
        mine = [by_rank.get(self.first + index) for index in range(self.count)]
        if any(entry is None for entry in mine):
            raise ValueError(f'The checkpoint lacks virtual ranks {self.first}-'
                             f'{self.first + self.count - 1} (a rank file is missing).')
        self.put_back([(raw_form(entry['streams']),
                        [value.to(live.device, live.dtype)
                         for value, live in zip(entry['buffers'], self._buffers)])
                       for entry in mine if entry is not None])

