"""``layout=dict(world_size=N)``: train as the N-rank run of a config would, on fewer ranks.

An OpenMMLab config names the layout it was tuned on (``8xb2``: 8 GPUs of 2 samples, the
learning rate for that global batch). With ``layout``, a run on W ranks (W dividing N)
trains as the N-rank run: each rank runs N/W virtual ranks' batches as the accumulation
micro-steps of one iteration (``data/virtual_ranks.py``, ``engine/virtual_ranks.py``).

``micro_batches`` (k) splits each virtual rank's batch into k micro-batches where the
config's per-GPU batch does not fit (``'auto'``: the smallest k whose predicted peak fits,
``plan``'s prediction against the device's memory or ``memory_gib``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

KEYS = ('world_size', 'micro_batches', 'memory_gib', 'split_batchnorm')
AUTO = 'auto'


@dataclass(frozen=True)
class Split:
    """Each virtual rank's batch in ``count`` micro-batches, and why that many."""

    count: int
    why: str


@dataclass(frozen=True)
class Layout:
    """The layout a run trains as.

    Args:
        world_size (int): N, the ranks of the run this one trains as.
        micro_batches (int | str): Micro-batches per virtual rank's batch (k; ``'auto'``:
            the smallest that fits). Defaults to 1.
        memory_gib (float, optional): The memory per rank ``'auto'`` fits into (default:
            the CUDA device's, on the CPU this machine's over its ranks). Defaults to None.
        split_batchnorm (bool): Split a model with BatchNorm, whose statistics then come
            from each micro-batch instead of the per-GPU batch. Defaults to False.
    """

    world_size: int
    micro_batches: Union[int, str] = 1
    memory_gib: Optional[float] = None
    split_batchnorm: bool = False

    @classmethod
    def of(cls, value: Any) -> Optional[Layout]:
        """The ``layout`` key (None: the run's own ranks), checked."""
        if value is None:
            return None
        if not isinstance(value, Mapping) or 'world_size' not in value \
                or set(value) - set(KEYS):
            raise ValueError(
                f'layout={value!r}: give the layout this run trains as, with its world size '
                'and optionally micro_batches, memory_gib and split_batchnorm, e.g. '
                'layout=dict(world_size=8) for an 8xb2 config.')
        world_size = value['world_size']
        if not _positive_int(world_size):
            raise ValueError(f'layout.world_size={world_size!r} must be a positive integer '
                             '(the GPUs the config was tuned on, e.g. 8 for 8xb2).')
        micro_batches = value.get('micro_batches', 1)
        if micro_batches != AUTO and not _positive_int(micro_batches):
            raise ValueError(f'layout.micro_batches={micro_batches!r}: give a positive integer '
                             "(the micro-batches of each per-GPU batch) or 'auto'.")
        memory = value.get('memory_gib')
        if memory is not None and (isinstance(memory, bool)
                                   or not isinstance(memory, (int, float)) or memory <= 0):
            raise ValueError(f'layout.memory_gib={memory!r}: give the memory per rank in GiB, '
                             'a positive number.')
        if memory is not None and micro_batches != AUTO:
            raise ValueError("layout.memory_gib is the budget of micro_batches='auto'; set "
                             "micro_batches='auto' or remove memory_gib.")
        split_batchnorm = value.get('split_batchnorm', False)
        if not isinstance(split_batchnorm, bool):
            raise ValueError(f'layout.split_batchnorm={split_batchnorm!r} must be True or False.')
        return cls(world_size, micro_batches, memory, split_batchnorm)

    def per_rank(self, world_size: int) -> int:
        """The virtual ranks each of ``world_size`` real ranks runs.

        Raises:
            ValueError: ``world_size`` does not divide :attr:`world_size`.
        """
        if world_size > self.world_size or self.world_size % world_size:
            raise ValueError(
                f'layout.world_size={self.world_size} cannot run on {world_size} ranks: each '
                f'rank runs the same number of virtual ranks, so launch on a number of ranks '
                f'that divides {self.world_size} ({_divisors(self.world_size)}), or set '
                'layout.world_size to a multiple of the ranks you have.')
        return self.world_size // world_size

    def split(self, batch_size: int, peak_mib: Optional[Callable[[int], float]] = None,
              budget_mib: Optional[float] = None) -> Split:
        """How many micro-batches each per-GPU batch of ``batch_size`` samples runs in.

        Args:
            batch_size (int): The config's per-GPU batch.
            peak_mib (Callable, optional): The predicted peak per rank at a micro-batch
                (``plan``'s); ``'auto'`` needs it.
            budget_mib (float, optional): What the peak must fit (``'auto'``;
                ``memory_gib`` wins).

        Raises:
            ValueError: ``micro_batches`` does not divide the batch, or none fits.
        """
        if self.micro_batches != AUTO:
            count = int(self.micro_batches)
            if batch_size % count:
                raise ValueError(
                    f'layout.micro_batches={count} does not divide the per-GPU batch '
                    f'(train_dataloader.batch_size={batch_size}): each micro-batch holds '
                    f'the same samples; choose one of {_divisors(batch_size)}.')
            return Split(count, f'layout.micro_batches={count}' if count > 1 else '')
        assert peak_mib is not None and budget_mib is not None, "'auto' predicts the peak"
        budget = self.memory_gib * 1024 if self.memory_gib is not None else budget_mib
        source = 'layout.memory_gib' if self.memory_gib is not None else 'the device\'s memory'
        whole = peak_mib(batch_size)
        for count in (d for d in range(1, batch_size + 1) if batch_size % d == 0):
            peak = whole if count == 1 else peak_mib(batch_size // count)
            if peak <= budget:
                part = batch_size // count
                return Split(count, (
                    f"micro_batches='auto': the whole batch of {batch_size} is predicted at "
                    f'{whole:.0f} MiB per rank, {"within" if count == 1 else "over"} '
                    f'{budget:.0f} MiB ({source})' + ('' if count == 1 else (
                        f'; {part} samples at {peak:.0f} MiB fit' if part > 1 else
                        f'; 1 sample at {peak:.0f} MiB fits'))))
        raise ValueError(
            f"layout.micro_batches='auto': even one sample is predicted at "
            f'{peak_mib(1):.0f} MiB per rank, over {budget:.0f} MiB ({source}): raise the '
            'ZeRO stage or offload (run `mmengine-deepspeed plan` on the config), or '
            'launch on more ranks.')


def finer(batch_size: int, count: int) -> Optional[int]:
    """The next split of a per-GPU batch of ``batch_size`` samples after ``count``
    micro-batches: each micro-batch in the fewest equal parts (its size's smallest factor
    above 1), so that the micro-batches already collated split again; None at one sample."""
    part = batch_size // count
    return next((count * d for d in range(2, part + 1) if part % d == 0), None)


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _divisors(number: int) -> str:
    return ', '.join(str(d) for d in range(1, number + 1) if number % d == 0)
