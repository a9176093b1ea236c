"""history.py: MMEngine's HistoryBuffer without a copy of the history per update."""
from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest
from mmengine.logging import HistoryBuffer

from mmengine_deepspeed.history import GrowingHistory


def _same(ours: HistoryBuffer, theirs: HistoryBuffer) -> None:
    for mine, reference in zip(ours.data, theirs.data):
        assert mine.dtype == reference.dtype
        np.testing.assert_array_equal(mine, reference)
    for window in (None, 1, 3, 10_000):
        for method in ('mean', 'max', 'min'):
            mine, reference = getattr(ours, method)(window), getattr(theirs, method)(window)
            assert type(mine) is type(reference)
            np.testing.assert_equal(mine, reference)  # NaN equals NaN here
    assert type(ours.current()) is type(theirs.current())
    np.testing.assert_equal(ours.current(), theirs.current())


@pytest.mark.parametrize('max_length', [5, 1000000])
@pytest.mark.parametrize('first', [[], [3], [2.5], [True]])
def test_every_update_and_statistic_is_what_history_buffer_gives(
        max_length: int, first: list) -> None:
    """Values, counts, dtypes (an int history turns float at its first float, as with
    np.append), trimming at max_length, statistics over windows: after each update."""
    rng = random.Random(0)
    ours = GrowingHistory(first, [1] * len(first), max_length)
    theirs = HistoryBuffer(first, [1] * len(first), max_length)
    values = [rng.choice([rng.randint(-5, 5), rng.random(), float('nan'), 7, True])
              for _ in range(200)]
    for value in values[:40] if first == [3] else values:  # an int history stays int a while
        count = rng.choice([1, 2, 3])
        ours.update(value, count)
        theirs.update(value, count)
        if len(theirs.data[0]):
            _same(ours, theirs)
    with pytest.raises(TypeError, match='log_val must be int or float'):
        ours.update('1.0')  # type: ignore[arg-type]
    for empty in (GrowingHistory(), HistoryBuffer()):
        with pytest.raises(ValueError, match='empty array'):
            empty.current()


def test_an_update_writes_in_place_and_earlier_views_keep_their_values() -> None:
    """O(1) per update: the arrays are reallocated only when full (doubling), not copied
    per value as np.append does; a view handed out before stays as it was."""
    history = GrowingHistory()
    storages = set()
    for i in range(1000):
        history.update(float(i))
        storages.add(id(history._logs))
    assert len(storages) <= 8  # 16, 32, ..., 1024
    shown, _ = history.data
    before = shown.copy()
    for _ in range(5000):
        history.update(-1.0)
    np.testing.assert_array_equal(shown, before)
    assert history.current() == -1.0 and len(history.data[0]) == 6000


def test_it_copies_pickles_and_converts_both_ways() -> None:
    history = GrowingHistory([1, 2], [1, 1], max_length=3)
    history.update(4.5)
    history.update(6)
    for copied in (copy.deepcopy(history), pickle.loads(pickle.dumps(history)),
                   GrowingHistory.of(history)):
        assert isinstance(copied, GrowingHistory)
        _same(copied, history)
    plain = history.plain()
    assert type(plain) is HistoryBuffer and plain.max_length == 3
    _same(plain, history)
    np.testing.assert_array_equal(plain.data[0], [2.0, 4.5, 6.0])
