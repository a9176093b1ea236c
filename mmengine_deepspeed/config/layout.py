"""``layout=dict(world_size=N)``: train as the N-rank run of a config would, on fewer ranks.

An OpenMMLab config names the layout it was tuned on (``8xb2``: 8 GPUs of 2 samples, the
learning rate for that global batch). With ``layout``, a run on W ranks (W dividing N)
trains as the N-rank run: each rank runs N/W virtual ranks' batches as the accumulation
micro-steps of one iteration (``data/virtual_ranks.py``, ``engine/virtual_ranks.py``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Layout:
    """The layout a run trains as.

    Args:
        world_size (int): N, the ranks of the run this one trains as.
    """

    world_size: int

    @classmethod
    def of(cls, value: Any) -> Optional[Layout]:
        """The ``layout`` key (None: the run's own ranks), checked."""
        if value is None:
            return None
        if not isinstance(value, Mapping) or set(value) != {'world_size'}:
            raise ValueError(
                f'layout={value!r}: give the layout this run trains as, with its world size '
                'only, e.g. layout=dict(world_size=8) for an 8xb2 config.')
        world_size = value['world_size']
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f'layout.world_size={world_size!r} must be a positive integer '
                             '(the GPUs the config was tuned on, e.g. 8 for 8xb2).')
        return cls(world_size)

    def per_rank(self, world_size: int) -> int:
        """The virtual ranks each of ``world_size`` real ranks runs.

        Raises:
            ValueError: ``world_size`` does not divide :attr:`world_size`.
        """
        if world_size > self.world_size or self.world_size % world_size:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f'layout.world_size={self.world_size} cannot run on {world_size} ranks: each '
                f'rank runs the same number of virtual ranks, so launch on a number of ranks '
                f'that divides {self.world_size} ({", ".join(map(str, divisors))}), or set '
                'layout.world_size to a multiple of the ranks you have.')
        return self.world_size // world_size
