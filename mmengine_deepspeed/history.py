"""MMEngine's ``HistoryBuffer`` with an append that does not copy the history.

``HistoryBuffer.update`` appends with ``np.append``, which copies both arrays (values and
counts) at every update, and a buffer keeps up to a million values: every scalar the
message hub logs (loss, lr, time, data_time, grad norm...) costs time proportional to
the run's length so far: for the 8 keys a training iteration logs, about 1 ms of host time
per iteration by iteration 100 000 and 12 ms by 1 000 000 on 2 Xeon cores
(``benchmarks/history.py``), where a raw training loop pays nothing.
:class:`GrowingHistory` keeps the values in arrays with room to spare (doubled when full),
so an update writes one element; what it holds and every statistic are what
``HistoryBuffer`` would give, dtypes included. The runner's message hub
(``message_hub.py``) keeps its scalars in it, and saves them as plain ``HistoryBuffer``
so that checkpoints load without this package.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Union, cast

import numpy as np
from mmengine.logging import HistoryBuffer
from typing_extensions import override

MIN_CAPACITY = 16
FLOAT64, INT64 = np.dtype(np.float64), np.dtype(np.int64)
INT64_RANGE = range(-2**63, 2**63)


def _widened(array: np.ndarray, value: Union[int, float]) -> np.ndarray:
    """``array``, in the dtype ``np.append(array, value)`` would give (the same array if
    that is its own: float64 takes any int or float, int64 any int in its range)."""
    if array.dtype == FLOAT64 or (array.dtype == INT64 and type(value) is int
                                  and value in INT64_RANGE):
        return array
    dtype = np.result_type(array.dtype, np.asarray(value).dtype)
    return array if dtype == array.dtype else array.astype(dtype)


class GrowingHistory(HistoryBuffer):
    """:class:`mmengine.logging.HistoryBuffer` whose :meth:`update` is O(1) (amortized).

    ``_log_history`` and ``_count_history``, which every statistic of ``HistoryBuffer``
    reads, are views of the filled part of larger arrays; a view handed out earlier
    (``data``) keeps the values it showed, as ``np.append``'s new arrays did.

    Args:
        log_history (Sequence): As ``HistoryBuffer``'s.
        count_history (Sequence): As ``HistoryBuffer``'s.
        max_length (int): As ``HistoryBuffer``'s: older values are dropped beyond it.
    """

    def __init__(self, log_history: Union[Sequence, np.ndarray] = (),
                 count_history: Union[Sequence, np.ndarray] = (), max_length: int = 1000000):
        self._logs = np.array([])
        self._counts = np.array([])
        self._start = self._end = 0
        self._floats = True  # float64 values: any int or float appends as it is
        super().__init__(cast(Sequence, log_history), cast(Sequence, count_history),
                         max_length)  # through the setters

    @classmethod
    def of(cls, history: HistoryBuffer) -> GrowingHistory:
        """A copy of ``history`` (its values, counts, dtypes and ``max_length``)."""
        logs, counts = history.data
        growing = cls(logs, counts, history.max_length)
        growing._grow()  # room for as many again: the next updates copy nothing
        return growing

    def plain(self) -> HistoryBuffer:
        """A ``HistoryBuffer`` holding the same (for checkpoints: no class of ours)."""
        logs, counts = self.data
        return HistoryBuffer(cast(Sequence, logs.copy()), cast(Sequence, counts.copy()),
                             self.max_length)

    @property  # type: ignore[explicit-override]  # an attribute in HistoryBuffer
    def _log_history(self) -> np.ndarray:
        return self._logs[self._start:self._end]

    @_log_history.setter
    def _log_history(self, values: np.ndarray) -> None:
        self._logs = np.asarray(values)
        self._start, self._end = 0, len(self._logs)
        self._floats = self._takes_any_number()

    @property  # type: ignore[explicit-override]  # an attribute in HistoryBuffer
    def _count_history(self) -> np.ndarray:
        return self._counts[self._start:self._end]

    @_count_history.setter
    def _count_history(self, counts: np.ndarray) -> None:
        self._counts = np.asarray(counts)
        self._start, self._end = 0, len(self._counts)
        self._floats = self._takes_any_number()

    def _takes_any_number(self) -> bool:
        """Whether any int or float value, with an int count, appends without a new dtype."""
        return self._logs.dtype == FLOAT64 and self._counts.dtype in (INT64, FLOAT64)

    @override
    def update(self, log_val: Union[int, float], count: int = 1) -> None:
        """Append one value and its count, as ``HistoryBuffer.update`` (same checks, same
        dtype promotion: an int history becomes float at its first float)."""
        if not (self._floats and type(log_val) in (int, float) and type(count) is int):
            if not isinstance(log_val, (int, float)) or not isinstance(count, (int, float)):
                raise TypeError(f'log_val must be int or float but got {type(log_val)}, '
                                f'count must be int but got {type(count)}')
            self._logs = _widened(self._logs, log_val)
            self._counts = _widened(self._counts, count)
            self._floats = self._takes_any_number()
        if self._end == len(self._logs):
            self._grow()
        self._logs[self._end] = log_val
        self._counts[self._end] = count
        self._end += 1
        self._start = max(self._start, self._end - self.max_length)

    @override
    def current(self) -> np.ndarray:
        """The last value, as ``HistoryBuffer.current`` (IterTimerHook reads it every
        iteration), without building the views."""
        if self._end == self._start:
            raise ValueError('HistoryBuffer._log_history is an empty array! '
                             'please call update first')
        last: np.ndarray = self._logs[self._end - 1]  # a numpy scalar, as MMEngine's
        return last

    def _grow(self) -> None:
        """Move the kept values to arrays twice their number (at least MIN_CAPACITY)."""
        kept = self._end - self._start
        capacity = max(MIN_CAPACITY, 2 * kept)
        for name in ('_logs', '_counts'):
            old = getattr(self, name)
            new = np.empty(capacity, dtype=old.dtype)
            new[:kept] = old[self._start:self._end]
            setattr(self, name, new)
        self._start, self._end = 0, kept
