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

import contextlib
from collections.abc import Iterator
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

    Args:
        count (int): The virtual ranks this rank runs (k).
        model (nn.Module): The user's model (whose buffers each virtual rank keeps).
        first (int): This rank's first virtual rank. Defaults to 0.
        world_size (int, optional): The layout's ranks (N). Defaults to ``count``.
    """

    def __init__(self, count: int, model: nn.Module, first: int = 0,
                 world_size: Optional[int] = None):
        self.count, self.first = count, first
        self.world_size = world_size if world_size is not None else count
        self._buffers = [b for b in model.buffers() if b is not None]
        # per virtual rank after the first: (streams, buffers); None until training starts
        self._kept: Optional[list[tuple[RawStreams, list[torch.Tensor]]]] = None

    def begin(self) -> None:
        """Before an iteration: at the first, every virtual rank starts from this rank's
        streams and buffers (the N-rank run's ranks all start alike: the same seed, the
        same draws before training)."""
        if self._kept is None:
            streams = raw_streams()
            self._kept = [(streams, [b.detach().clone() for b in self._buffers])
                          for _ in range(self.count - 1)]

    def new_loader_iterator(self) -> None:
        """Make the other virtual ranks draw what this rank drew creating a DataLoader
        iterator (the training loader's each epoch, the validation loader's each
        validation: each rank of the N-rank run creates its own), so that their streams
        stay those of their ranks. Before training nothing is kept yet: they start from
        this rank's streams, which hold the draw."""
        if self._kept is None:
            return
        for index in range(1, self.count):
            with self.as_rank(index):
                loader_iterator_draw()

    @contextlib.contextmanager
    def as_rank(self, index: int) -> Iterator[None]:
        """Run the body as this rank's virtual rank ``index`` (0: the rank itself)."""
        if index == 0:
            yield
            return
        assert self._kept is not None, 'begin() starts the virtual ranks'
        own_streams = raw_streams()
        own_buffers = [b.detach().clone() for b in self._buffers]
        streams, buffers = self._kept[index - 1]
        set_raw_streams(streams)
        self._put(buffers)
        try:
            yield
        finally:
            with torch.no_grad():
                for live, kept in zip(self._buffers, buffers):
                    kept.copy_(live)
            self._put(own_buffers)
            self._kept[index - 1] = (raw_streams(), buffers)
            set_raw_streams(own_streams)

    def _put(self, buffers: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for live, kept in zip(self._buffers, buffers):
                live.copy_(kept)

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every virtual rank's streams and buffers on this rank, its own first (None
        before training): what any number of ranks resuming the layout takes them from."""
        if self._kept is None:
            return None
        own = (raw_streams(), self._buffers)
        return dict(world_size=self.world_size, first=self.first, ranks=[
            dict(streams=saved_form(streams),
                 buffers=[b.detach().cpu().clone() for b in buffers])
            for streams, buffers in (own, *self._kept)])

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

        def buffers(entry: dict[str, Any]) -> list[torch.Tensor]:
            return [saved.to(live.device, live.dtype)
                    for saved, live in zip(entry['buffers'], self._buffers)]

        own, *others = [entry for entry in mine if entry is not None]
        set_raw_streams(raw_form(own['streams']))
        self._put(buffers(own))
        self._kept = [(raw_form(entry['streams']), buffers(entry)) for entry in others]
