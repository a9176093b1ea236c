"""What the ranks must agree on while training, in one small all-reduce every few iterations.

A stop signal that reached any rank, the peak memory over ranks: each hook that
needs every rank's view contributes numbers, and :class:`Agreement` reduces all of
them together (maximum over ranks) on a gloo group, from CPU data, so that a GPU
never waits for it, at iterations every rank computes alike:

* always at the logging iterations (where the log shows agreed figures);
* in between, often enough that an agreement comes about every ``seconds`` of
  training: after each agreement, the agreed (slowest rank's) time per iteration
  picks the period, a divisor of the logging interval. Steps of 100 ms with a
  logging interval of 10 agree every 10 iterations (0.1 collectives per
  iteration); steps of a second, every 2; longer ones, every iteration.

Nothing is agreed outside ``train()`` or on one rank, where the values are this
rank's own.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as torch_dist
from mmengine.hooks import LoggerHook

from ..dist import cpu_group


class Agreement:
    """The values every rank agrees on, and when.

    Args:
        interval (int): The logging interval (an agreement at each of its iterations).
        seconds (float): Aim for an agreement about this often. Defaults to 2.0.
    """

    def __init__(self, interval: int, seconds: float = 2.0):
        self.interval = interval
        self.seconds = seconds
        self.period = 1  # every iteration until one agreement has timed them
        self._providers: dict[str, Callable[[], list[float]]] = {}
        self._last: Optional[tuple[int, dict[str, list[float]]]] = None
        self._since: Optional[tuple[int, float]] = None  # (iteration, time) of the last

    def provide(self, name: str, provider: Callable[[], list[float]]) -> None:
        """Contribute ``provider()`` (as many numbers on every rank) to each agreement.

        Hooks provide in ``before_train``: a new ``train()`` starts the timing afresh.
        """
        self._providers[name] = provider
        self.restart()

    def restart(self) -> None:
        """Time afresh and forget the last agreement (a new ``train()``, or a rollback,
        after which iterations are numbered again from an earlier one)."""
        self.period, self._last, self._since = 1, None, None

    def due(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (0-based, finished) agrees: the same on every rank."""
        return iteration == 0 or (iteration + 1) % self.period == 0 or (
            iteration + 1) % self.interval == 0

    def agreed(self, iteration: int) -> dict[str, list[float]]:
        """Every provider's numbers, maximum over ranks, for this iteration (one collective
        the first time it is asked for at an iteration; call it on the same iterations on
        every rank)."""
        if self._last is not None and self._last[0] == iteration:
            return self._last[1]
        names = list(self._providers)
        parts = [self._providers[name]() for name in names]
        now = time.perf_counter()
        per_iteration = 0.0
        if self._since is not None and iteration > self._since[0]:
            per_iteration = (now - self._since[1]) / (iteration - self._since[0])
        flat = torch.tensor([per_iteration, *(x for part in parts for x in part)],
                            dtype=torch.float64)
        if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            torch_dist.all_reduce(flat, op=torch_dist.ReduceOp.MAX, group=cpu_group())
        values = flat.tolist()  # CPU data: no device waits
        self._choose_period(values[0])
        result, at = {}, 1
        for name, part in zip(names, parts):
            result[name] = values[at:at + len(part)]
            at += len(part)
        self._last = (iteration, result)
        self._since = (iteration, time.perf_counter())
        return result

    def _choose_period(self, per_iteration: float) -> None:
        if per_iteration <= 0:
            return
        self.period = max((d for d in range(1, self.interval + 1)
                           if self.interval % d == 0 and d * per_iteration <= self.seconds),
                          default=1)


def logging_interval(runner: Any) -> int:
    """LoggerHook's interval (10 without one): where the log shows agreed figures."""
    loggers = [hook for hook in runner.hooks if isinstance(hook, LoggerHook)]
    return loggers[0].interval if loggers else 10

