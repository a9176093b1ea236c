"""message_hub.py: tensor scalars read on the host when the hub is read, all at once."""
from __future__ import annotations

import math
import pickle
from typing import Any, Callable

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub
from torch.overrides import TorchFunctionMode

from mmengine_deepspeed.history import GrowingHistory
from mmengine_deepspeed.message_hub import DeferredMessageHub


class _Reads(TorchFunctionMode):
    """Counts host reads of tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Callable, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in (torch.Tensor.item, torch.Tensor.tolist):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_values_are_read_once_when_the_hub_is_read_with_mmengines_history() -> None:
    deferred = DeferredMessageHub.build('deferred_hub_test')
    plain = MessageHub.get_instance('plain_hub_test')
    # one-element tensors of every shape, and several dtypes, in one read
    losses = [torch.tensor(0.5), torch.tensor([0.25]), torch.tensor([[1.5]])]
    with _Reads() as reads:
        for i, loss in enumerate(losses):
            for hub in (deferred, plain):
                hub.update_scalar('train/loss', loss)
                hub.update_scalar('train/grad_norm', torch.tensor(i, dtype=torch.int64))
                hub.update_scalar('train/aux', loss.to(torch.bfloat16) / 3)
                hub.update_scalar('train/lr', 0.1 * i)  # plain numbers go in at once
        plain_reads = reads.count
        reads.count = 0
        deferred.get_scalar('train/lr')  # as IterTimerHook every iteration: nothing kept
        assert reads.count == 0
        deferred_loss = deferred.get_scalar('train/loss')
        assert reads.count == 1  # one per device, whatever the number and the dtypes
    assert plain_reads == 9
    for key in ('train/loss', 'train/grad_norm', 'train/aux', 'train/lr'):
        assert deferred.get_scalar(key).data[0].tolist() == plain.get_scalar(key).data[0].tolist()
    assert deferred_loss.current() == 1.5
    assert type(deferred.get_scalar('train/grad_norm').current()) is type(
        plain.get_scalar('train/grad_norm').current())


def test_a_keys_history_stays_in_order_and_checkpoints_hold_every_value() -> None:
    hub = DeferredMessageHub.build('deferred_hub_order_test')
    hub.update_scalar('loss', torch.tensor(1.0))
    hub.update_scalar('loss', 2.0)  # a number after a kept tensor: the tensor goes first
    hub.update_scalar('loss', torch.tensor(3.0))
    assert hub.state_dict()['log_scalars']['loss'].data[0].tolist() == [1.0, 2.0, 3.0]
    other = DeferredMessageHub.build('deferred_hub_load_test')
    other.load_state_dict(hub.state_dict())
    assert other.get_scalar('loss').data[0].tolist() == [1.0, 2.0, 3.0]


def test_it_is_mmengines_current_hub_and_refuses_what_mmengine_refuses() -> None:
    """Pins compat.register_message_hub: MMEngine's class-level registry of instances."""
    hub = DeferredMessageHub.build('deferred_hub_current_test')
    assert MessageHub.get_current_instance() is hub
    assert MessageHub.get_instance('deferred_hub_current_test') is hub
    assert DeferredMessageHub.build('deferred_hub_current_test') is hub
    with pytest.raises(AssertionError):
        hub.update_scalar('loss', torch.ones(2))
    with pytest.raises(KeyError, match='loss is not found'):
        hub.get_scalar('loss')


def test_observers_see_each_value_with_the_iteration_it_was_logged_at() -> None:
    """guard/hook.py learns which iteration's loss was not finite, without a read of
    its own: kept tensors when the hub is read, plain numbers at once."""
    hub = DeferredMessageHub.build('observed_hub_test')
    seen: list[tuple[str, int, float]] = []
    hub.observe(lambda key, iteration, value: seen.append((key, iteration, value)))
    for iteration, loss in enumerate((0.5, float('nan'), float('inf'))):
        hub.update_info('iter', iteration)
        hub.update_scalar('train/loss', torch.tensor(loss))
        hub.update_scalar('train/skipped_steps', float(iteration))
    assert [s for s in seen if s[0] == 'train/loss'] == []
    with _Reads() as reads:
        hub.read_pending()
    assert reads.count == 1
    losses = [(i, v) for key, i, v in seen if key == 'train/loss']
    assert losses[0] == (0, 0.5) and losses[1][0] == 1 and math.isnan(losses[1][1])
    assert losses[2] == (2, float('inf'))
    assert [(i, v) for key, i, v in seen if key == 'train/skipped_steps'] == [
        (0, 0.0), (1, 1.0), (2, 2.0)]


def test_an_observer_sees_only_the_keys_it_asked_for() -> None:
    """NonFiniteHook wants losses and skip counts, not the lr and timings MMEngine logs
    every iteration: the others never call it, kept tensors or plain numbers."""
    hub = DeferredMessageHub.build('filtered_hub_test')
    wanted: list[str] = []
    everything: list[str] = []
    hub.observe(lambda key, iteration, value: wanted.append(key), lambda key: 'loss' in key)
    hub.observe(lambda key, iteration, value: everything.append(key))
    for _ in range(2):
        hub.update_scalar('train/loss', torch.tensor(1.0))
        hub.update_scalar('train/lr', 0.1)
        hub.update_scalar('train/time', torch.tensor(0.5))
        hub.update_scalar('train/loss_cls', 2.0)
    hub.read_pending()
    assert sorted(wanted) == ['train/loss', 'train/loss', 'train/loss_cls', 'train/loss_cls']
    assert sorted(everything) == sorted(['train/loss', 'train/lr', 'train/time',
                                         'train/loss_cls'] * 2)
    hub.observe(lambda key, iteration, value: wanted.append('late ' + key),
                lambda key: key == 'train/lr')  # a later observer is asked about known keys
    hub.update_scalar('train/lr', 0.2)
    assert wanted[-1] == 'late train/lr'


def test_histories_grow_in_place_and_are_saved_as_mmengine_s() -> None:
    """Every key's history is a GrowingHistory (no copy of the history per update), the
    same numbers as MessageHub's; a checkpoint's state holds plain HistoryBuffers (it
    loads without this package), which become GrowingHistory again at their next update."""
    hub = DeferredMessageHub.build('growing_hub_test')
    reference = MessageHub('growing_hub_reference')
    for step in range(30):
        for target in (hub, reference):
            target.update_scalar('train/lr', 0.1 * step)
            target.update_scalar('train/loss', torch.tensor(1.0 / (step + 1)))
            target.update_scalar('train/iters', step)  # ints stay ints, as in MMEngine
    for key in ('train/lr', 'train/loss', 'train/iters'):
        history = hub.get_scalar(key)
        assert isinstance(history, GrowingHistory)
        for ours, theirs in zip(history.data, reference.get_scalar(key).data):
            assert ours.dtype == theirs.dtype
            np.testing.assert_array_equal(ours, theirs)
        assert history.mean(10) == reference.get_scalar(key).mean(10)
    state = hub.state_dict()
    assert {type(h) for h in state['log_scalars'].values()} == {HistoryBuffer}
    restored = DeferredMessageHub.build('growing_hub_restored')
    restored.load_state_dict(pickle.loads(pickle.dumps(state)))
    restored.update_scalar('train/lr', 3.0)
    assert isinstance(restored.get_scalar('train/lr'), GrowingHistory)
    assert list(restored.get_scalar('train/lr').data[0][-2:]) == [0.1 * 29, 3.0]


def test_a_known_key_s_update_checks_what_mmengine_checks() -> None:
    """A plain number for a known key is appended without MessageHub.update_scalar; every
    other update still goes through it: another ``resumed`` for the key fails as in
    MMEngine, numpy numbers and tensors are read as MMEngine reads them, a loaded state's
    resumed flags are MMEngine's to check."""
    hub = DeferredMessageHub.build('fast_path_hub_test')
    hub.update_scalar('train/lr', 0.1)
    hub.update_scalar('train/lr', 0.2)
    with pytest.raises(AssertionError, match='resumed'):
        hub.update_scalar('train/lr', 0.3, resumed=False)
    hub.update_scalar('train/lr', np.float64(0.4))
    hub.update_scalar('train/lr', 5)
    assert list(hub.get_scalar('train/lr').data[0]) == [0.1, 0.2, 0.4, 5.0]
    hub.update_scalar('train/eta', 1.0, resumed=False)
    hub.load_state_dict({'log_scalars': {}, 'runtime_info': {},
                         'resumed_keys': {'train/eta': True}})
    with pytest.raises(AssertionError, match='resumed'):
        hub.update_scalar('train/eta', 2.0, resumed=False)  # the loaded flag holds now


def test_a_known_key_s_number_goes_where_the_hub_holds_it_now() -> None:
    """The direct append of a plain number follows what changed since the key was known:
    a history put in its place from outside (``log_scalars[key] = ...``) gets the value,
    an observer registered later sees it with the iteration, a kept tensor of the key
    goes into the history first."""
    hub = DeferredMessageHub.build('fast_path_changes_test')
    hub.update_scalar('train/lr', 0.1)
    hub.log_scalars['train/lr'] = HistoryBuffer([9.0], [1])
    hub.update_scalar('train/lr', 0.2)
    assert list(hub.get_scalar('train/lr').data[0]) == [9.0, 0.2]
    seen: list[tuple[str, int, float]] = []
    hub.observe(lambda key, iteration, value: seen.append((key, iteration, value)))
    hub.update_info('iter', 4)
    hub.update_scalar('train/lr', 0.3)
    hub.update_scalar('train/lr', torch.tensor(0.4, requires_grad=True) * 1)
    hub.update_scalar('train/lr', 0.5)
    assert list(hub.get_scalar('train/lr').data[0]) == pytest.approx([9.0, 0.2, 0.3, 0.4, 0.5])
    assert [(key, it) for key, it, _ in seen] == [('train/lr', 4)] * 3
