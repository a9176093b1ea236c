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

from ..random_streams import rng_state, set_rng_state


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
    """

    def __init__(self, count: int, model: nn.Module):
        self.count = count
        self._buffers = [b for b in model.buffers() if b is not None]
        # per virtual rank after the first: (streams, buffers); None until training starts
        self._kept: Optional[list[tuple[dict[str, Any], list[torch.Tensor]]]] = None

    def begin(self) -> None:
        """Before an iteration: at the first, every virtual rank starts from this rank's
        streams and buffers (the N-rank run's ranks all start alike: the same seed, the
        same draws before training)."""
        if self._kept is None:
            streams = rng_state()
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
        own_streams = rng_state()
        own_buffers = [b.detach().clone() for b in self._buffers]
        streams, buffers = self._kept[index - 1]
        set_rng_state(streams)
        with torch.no_grad():
            for live, kept in zip(self._buffers, buffers):
                live.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                for live, kept in zip(self._buffers, buffers):
                    kept.copy_(live)
                for live, own in zip(self._buffers, own_buffers):
                    live.copy_(own)
            self._kept[index - 1] = (rng_state(), buffers)
            set_rng_state(own_streams)

    def state_dict(self) -> Optional[dict[str, Any]]:
        """The other virtual ranks' streams and buffers (None before training)."""
        if self._kept is None:
            return None
        return dict(count=self.count, streams=[s for s, _ in self._kept],
                    buffers=[[b.detach().cpu() for b in buffers] for _, buffers in self._kept])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` saved (a run with as many virtual ranks)."""
        if state['count'] != self.count:
            raise ValueError(
                f'The checkpoint holds {state["count"]} virtual ranks per rank; this run has '
                f'{self.count}. Resume on as many ranks as the checkpoint was saved on.')
        self._kept = [(streams, [saved.to(live.device, live.dtype)
                                 for saved, live in zip(buffers, self._buffers)])
                      for streams, buffers in zip(state['streams'], state['buffers'])]
