"""A MessageHub that reads tensor values on the host only when the hub is read.

MMEngine's ``RuntimeInfoHook`` hands every iteration's losses to the message hub
as tensors, and ``MessageHub.update_scalar`` reads each one on the host
(``.item()``): on a GPU, every iteration would wait there until its kernels have
run, and the CPU could not queue the next step ahead. :class:`DeferredMessageHub`
keeps such values (detached) and reads all of them in one transfer when anything
reads the hub: LoggerHook at its interval, ``get_scalar``, ``log_scalars``, a
checkpoint's ``state_dict``. The history, and so every figure the log shows, is
what MMEngine's hub would hold. The runner builds it (:func:`deferred_message_hub`)
and makes it MMEngine's current hub (``MessageHub.get_current_instance()`` returns
it), under an experiment name no earlier runner in the process has taken.

Whoever needs every value as it becomes a number, with the iteration it was logged
at (``guard/hook.py``: a loss that was not finite on this rank), registers an
observer (:meth:`DeferredMessageHub.observe`) instead of reading the tensors itself,
with the keys it wants: which observers a key goes to is decided once per key.

Its histories are :class:`~.history.GrowingHistory`: MMEngine's ``HistoryBuffer``
copies its whole history at every update (1 ms per iteration by iteration 100 000).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional, Union

import torch
from mmengine.logging import HistoryBuffer, MessageHub, MMLogger
from typing_extensions import override

from .compat import register_message_hub, scalar_histories, set_experiment_name
from .history import GrowingHistory

# Read anyway after this many values: a run whose hub nobody reads keeps no more.
MAX_PENDING = 10_000

# (key, iteration it was logged at, value): called for each scalar as it becomes a number.
Observer = Callable[[str, int, float], None]
KeyFilter = Callable[[str], bool]


class DeferredMessageHub(MessageHub):
    """:class:`mmengine.logging.MessageHub`, whose one-element tensor scalars are read
    on the host when the hub is read, all at once, instead of at each update.

    Args:
        name (str): The hub's name (MMEngine's ``ManagerMixin``).
        **kwargs: The arguments of :class:`mmengine.logging.MessageHub`.
    """

    def __init__(self, name: str, **kwargs: Any):
        super().__init__(name, **kwargs)
        self._pending: list[tuple[str, torch.Tensor, int, bool, int]] = []
        self._pending_keys: set[str] = set()
        self._observers: list[tuple[Observer, KeyFilter]] = []
        self._observers_of: dict[str, tuple[Observer, ...]] = {}  # by key, decided once
        # keys whose history is a GrowingHistory, with the `resumed` they were logged with and
        # their observers: a plain number for such a key is appended directly (see
        # update_scalar); forgotten when a state is loaded or an observer registers
        self._appendable: dict[str, tuple[GrowingHistory, bool, tuple[Observer, ...]]] = {}
        self._histories = scalar_histories(self)
        self._runtime = self.runtime_info

    def observe(self, observer: Observer, keys: KeyFilter = lambda key: True) -> None:
        """Call ``observer(key, iteration, value)`` for every scalar whose key ``keys``
        accepts from now on, as it becomes a number on the host (when the hub is read,
        for a tensor)."""
        self._observers.append((observer, keys))
        self._observers_of.clear()
        self._appendable.clear()

    def _observers_for(self, key: str) -> tuple[Observer, ...]:
        observers = self._observers_of.get(key)
        if observers is None:
            observers = tuple(observer for observer, keys in self._observers if keys(key))
            self._observers_of[key] = observers
        return observers

    @classmethod
    def build(cls, name: str, **kwargs: Any) -> DeferredMessageHub:
        """The hub named ``name`` (one per name, as ``get_instance``), made MMEngine's
        current message hub."""
        hub = cls.get_instance(name, **kwargs)
        register_message_hub(name, hub)
        return hub

    @override
    def update_scalar(self, key: str, value: Any, count: int = 1, resumed: bool = True) -> None:
        """MMEngine's update, with a one-element tensor kept (detached) until the hub is
        read, and a plain number appended directly where MMEngine's update would only
        append it (:meth:`_update_history`)."""
        if isinstance(value, torch.Tensor) and value.numel() == 1 and isinstance(count, int):
            self._pending.append((key, value.detach() if value.requires_grad else value, count,
                                  resumed, int(self._runtime.get('iter', -1))))
            self._pending_keys.add(key)
            if len(self._pending) >= MAX_PENDING:
                self.read_pending()
            return
        if key in self._pending_keys:  # a key's history stays in order
            self.read_pending()
        observers = self._update_history(key, value, count, resumed)
        if observers and isinstance(value, (int, float)):
            for observer in observers:
                observer(key, int(self._runtime.get('iter', -1)), float(value))

    def _update_history(self, key: str, value: Any, count: int,
                        resumed: bool) -> tuple[Observer, ...]:
        """MMEngine's update, into a :class:`~.history.GrowingHistory` (MMEngine makes a
        ``HistoryBuffer`` for a new key; one loaded from a checkpoint is one too); a plain
        number is appended directly where the key's history is one logged with the same
        ``resumed`` (several values per iteration).

        Returns:
            tuple: The key's observers.
        """
        known = self._appendable.get(key)
        if known is not None and known[1] is resumed and self._histories.get(key) is known[0] \
                and type(value) in (int, float) and type(count) is int:
            known[0].update(value, count)
            return known[2]
        super().update_scalar(key, value, count, resumed)
        history = self._histories[key]
        if type(history) is HistoryBuffer:
            history = self._histories[key] = GrowingHistory.of(history)
        observers = self._observers_for(key)
        if type(history) is GrowingHistory:
            self._appendable[key] = (history, resumed, observers)
        return observers

    def read_pending(self) -> None:
        """Put the kept tensor values into the history: one host read per device (as
        float64, exact for every float and for integers up to 2**53)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._pending_keys.clear()
        # stacked per dtype and number of dimensions (one-element tensors with as many
        # dimensions have one shape): one stack per group, not an op per value. Few
        # distinct ops matter as much: each costs tens of us where the step left torch's
        # code cold. One group is read as it is (tolist is exact for every dtype); several
        # are cast to float64 to be read together.
        groups: dict[torch.device, dict[tuple[torch.dtype, int], list[int]]] = {}
        for index, entry in enumerate(pending):
            tensor = entry[1]
            groups.setdefault(tensor.device, {}).setdefault(
                (tensor.dtype, tensor.dim()), []).append(index)
        values: list[Union[int, float]] = [0] * len(pending)
        for by_kind in groups.values():
            stacks = [torch.stack([pending[i][1] for i in indices]) for indices in
                      by_kind.values()]
            read = stacks[0] if len(stacks) == 1 else torch.cat(
                [stack.reshape(-1).to(torch.float64) for stack in stacks])
            numbers = iter((read.reshape(-1) if read.dim() > 1 else read).tolist())
            for (dtype, _), indices in by_kind.items():
                for i, number in zip(indices, numbers):
                    values[i] = number if dtype.is_floating_point else int(number)
        for (key, _, count, resumed, iteration), number in zip(pending, values):
            for observer in self._update_history(key, number, count, resumed):
                observer(key, iteration, float(number))

    @property
    @override
    def log_scalars(self) -> OrderedDict:
        self.read_pending()
        return super().log_scalars

    @override
    def get_scalar(self, key: str) -> HistoryBuffer:
        """The key's history; kept values are read only if some are this key's (MMEngine's
        IterTimerHook reads ``train/time`` every iteration)."""
        if key in self._pending_keys:
            self.read_pending()
        history = self._histories.get(key)
        if history is None:
            raise KeyError(f'{key} is not found in Messagehub.log_buffers: instance name is: '
                           f'{self.instance_name}')
        return history

    @override
    def state_dict(self) -> dict:
        """MMEngine's, its histories as plain ``HistoryBuffer`` (a checkpoint loads
        without this package)."""
        self.read_pending()
        state = super().state_dict()
        state['log_scalars'] = OrderedDict(
            (key, history.plain() if isinstance(history, GrowingHistory) else history)
            for key, history in state['log_scalars'].items())
        return state

    @override
    def load_state_dict(self, state_dict: Union[MessageHub, dict]) -> None:
        self.read_pending()
        self._appendable.clear()  # loaded histories and resumed keys: MMEngine's update checks
        super().load_state_dict(state_dict)
        self._histories = scalar_histories(self)  # a MessageHub's state replaces both dicts
        self._runtime = self.runtime_info


def take_unused_experiment_name(runner: Any) -> None:
    """Give ``runner`` an experiment name no earlier runner in this process has taken,
    before its logger and message hub take it.

    Names end with the start second, so runners built in one process within that
    second shared MMEngine's logger and MessageHub (histories, best scores, warnings). A
    suffix (``_2``...) keeps them apart; every rank builds the same runners, so every
    rank picks the same name.
    """
    base, count = runner.experiment_name, 1
    while MMLogger.check_instance_created(runner.experiment_name) \
            or MessageHub.check_instance_created(runner.experiment_name):
        count += 1
        set_experiment_name(runner, f'{base}_{count}')


def deferred_message_hub(message_hub: Optional[dict], experiment_name: str) -> MessageHub:
    """``Runner.build_message_hub``'s result as a :class:`DeferredMessageHub` (no wait per
    iteration), MMEngine's current hub."""
    if message_hub is not None and not isinstance(message_hub, dict):
        raise TypeError(f'message_hub should be dict or None, but got {message_hub}')
    kwargs = dict(message_hub or {})
    return DeferredMessageHub.build(kwargs.pop('name', experiment_name), **kwargs)
