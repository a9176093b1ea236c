"""compat/: the supported versions and the private names we rely on are checked at import."""
from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from mmengine.logging import HistoryBuffer

from mmengine_deepspeed import compat


def test_the_pinned_environment_passes_silently() -> None:
    assert compat.unsupported_versions() == []
    assert compat.missing_private_names() == []
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        compat.check_upstream()


def test_an_unsupported_version_is_named_with_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compat.SUPPORTED, 'deepspeed', ('0.20', '0.21'))
    with pytest.warns(UserWarning, match=r'deepspeed 0\.19\.\d+ \(supported: >=0\.20,<0\.21\)'):
        compat.check_upstream()


def test_a_renamed_private_name_is_reported_with_what_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, 'PRIVATE_NAMES', (
        ('mmengine.hooks', 'CheckpointHook', '_save_renamed', 'the rotation'),
        ('deepspeed.utils.groups', None, '_release_process_group_references', 'worlds')))
    assert compat.missing_private_names() == [
        'mmengine.hooks.CheckpointHook._save_renamed (for the rotation)']
    with pytest.warns(UserWarning, match='_save_renamed'):
        compat.check_upstream()


def test_the_public_history_of_a_buffer_is_what_we_save() -> None:
    """state.hub_state reads HistoryBuffer.data (public), not its private lists."""
    buffer = HistoryBuffer([1.0, 2.0], [1, 1], max_length=5)
    assert [float(v) for v in buffer.data[0]] == [1.0, 2.0]
    assert [float(v) for v in buffer.data[1]] == [1.0, 1.0]


def test_a_hubs_histories_are_the_dict_log_scalars_returns() -> None:
    """message_hub.py appends to known keys through compat.scalar_histories."""
    from mmengine.logging import MessageHub

    hub = MessageHub('scalar_histories_pin')
    hub.update_scalar('train/loss', 1.0)
    assert compat.scalar_histories(hub) is hub.log_scalars
    assert isinstance(compat.scalar_histories(hub)['train/loss'], HistoryBuffer)


def test_storage_key_is_one_per_storage_also_on_meta() -> None:
    """plan counts saved activations once per storage (views share one)."""
    import torch

    for device in ('meta', 'cpu'):
        base = torch.empty(4, 6, device=device)
        other = torch.empty(4, 6, device=device)
        views = (base.view(6, 4), base.t(), base[1:], base.split(2, dim=1)[1])
        assert {compat.storage_key(v) for v in views} == {compat.storage_key(base)}
        assert compat.storage_key(other) != compat.storage_key(base)


def test_an_op_tells_whether_it_writes_its_first_operand() -> None:
    """zero/released_guard.py tells a write into a ZeRO-3 parameter from a read by the op's
    schema; it finds the parameter by storage, which an empty ``.data`` shares with its
    parameter (and not with another empty one), as DeepSpeed's released ones are."""
    import torch

    aten = torch.ops.aten
    assert compat.writes_first_operand(aten.mul_.Tensor)
    assert compat.writes_first_operand(aten.copy_.default)
    assert not compat.writes_first_operand(aten.mul.Tensor)
    assert not compat.writes_first_operand(aten.add.out)  # it writes `out`, a keyword
    released, other = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    released.data, other.data = torch.empty(0), torch.empty(0)
    assert compat.storage_key(released.data) == compat.storage_key(released)
    assert compat.storage_key(other.data) != compat.storage_key(released.data)


def test_a_loss_numbers_the_autograd_nodes_built_before_it() -> None:
    """zero/unused_params.py walks a graph again only when the count of nodes built between
    two losses changed: a skipped branch changes it, a repeated forward does not, and
    operations without gradients (a no_grad block, an input that needs none) count nothing."""
    weight = torch.ones(3, requires_grad=True)
    head = torch.ones(3, requires_grad=True)

    def loss(use_head: bool) -> torch.Tensor:
        with torch.no_grad():
            (weight * 2).sum()
        torch.ones(3).exp()
        out = (weight * 2).relu()
        return ((out * head) if use_head else out).sum()

    numbers = [compat.autograd_sequence_number(loss(use)) for use in (True, True, True, False)]
    spans = [b - a for a, b in zip(numbers, numbers[1:])]  # type: ignore[operator]
    assert spans[0] == spans[1] == 4  # MulBackward, ReluBackward, MulBackward, SumBackward
    assert spans[2] == 3
    assert compat.autograd_sequence_number(torch.ones(2)) is None


def test_an_op_marked_unavailable_is_not_built_by_deepspeeds_backend() -> None:
    """dist.py marks DeepSpeed's CPU shared-memory all-reduce op unavailable before DeepSpeed
    creates its communication backend: the backend then builds nothing (no 30 s JIT build
    that training never uses). Without the mark this machine would build it."""
    import importlib

    import deepspeed.ops

    ds_comm_torch = importlib.import_module('deepspeed.comm.torch')  # not deepspeed.comm.torch

    compatible = deepspeed.ops.__compatible_ops__
    before = compatible['deepspeed_shm_comm']
    try:
        compat.mark_op_unavailable('deepspeed_shm_comm')
        assert deepspeed.ops.__compatible_ops__ is compatible  # kept, not probed again
        assert ds_comm_torch.build_shm_op() is None
    finally:
        compatible['deepspeed_shm_comm'] = before


def test_a_counted_backward_moves_mmengines_accumulation_boundary() -> None:
    """DeepSpeedOptimWrapper.backward counts through compat.count_backward; MMEngine's
    should_update() must see it (boundaries every accumulative_counts backwards)."""
    from mmengine.optim import OptimWrapper

    model = torch.nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    wrapper.initialize_count_status(model, 0, 4)
    compat.count_backward(wrapper)
    assert not wrapper.should_update()
    compat.count_backward(wrapper)
    assert wrapper.should_update()


def test_backward_counts_set_mid_run_move_mmengines_boundaries() -> None:
    """engine/split_retry.py recounts an OptimWrapper's backwards when an iteration becomes
    more micro-steps (compat.backward_counts / set_backward_counts, MMEngine's private
    counts): its boundaries and loss scale must follow, the last window's too."""
    from mmengine.optim import OptimWrapper

    model = torch.nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    wrapper.initialize_count_status(model, 2, 7)
    assert compat.backward_counts(wrapper) == (2, 7)
    compat.set_backward_counts(wrapper, 4, 4, 14)  # each backward now two
    assert compat.backward_counts(wrapper) == (4, 14)
    assert compat.accumulative_counts(wrapper) == 4
    assert [wrapper.should_sync() or compat.count_backward(wrapper) for _ in range(3)] == \
        [None, None, None] and wrapper.should_sync()  # the 4th backward ends the window
    compat.set_backward_counts(wrapper, 4, 12, 14)
    assert wrapper.scale_loss(torch.tensor(2.0)).item() == 1.0  # the short last window: 2


def test_a_fused_optimizer_given_found_inf_leaves_parameters_and_state_unchanged() -> None:
    """engine/nonfinite.py skips a non-finite ZeRO-0 fp32 update on the device through
    ``found_inf``, which torch's fused optimizers honour (``_step_supports_amp_scaling``,
    the flag GradScaler reads); unfused ones do not say so."""
    from torch.optim import SGD, AdamW

    for make in (lambda p: AdamW(p, lr=0.1, fused=True),
                 lambda p: SGD(p, lr=0.1, momentum=0.9, fused=True)):
        model = torch.nn.Linear(3, 2)
        optimizer = make(model.parameters())
        assert compat.found_inf_supported(optimizer)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()  # state exists
        before = ({k: v.clone() for k, v in model.state_dict().items()},
                  copy.deepcopy(optimizer.state_dict()['state']))
        model(torch.ones(1, 3)).sum().backward()
        optimizer.found_inf = torch.tensor(1.0)
        optimizer.step()
        del optimizer.found_inf
        assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
        for index, state in optimizer.state_dict()['state'].items():
            assert all(torch.equal(v, before[1][index][k]) for k, v in state.items()
                       if isinstance(v, torch.Tensor))
    assert not compat.found_inf_supported(SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1))


def test_runner_from_cfg_builds_the_runner_the_config_names(tmp_path: Any) -> None:
    """MMagic's tools/train.py calls ``Runner.from_cfg(cfg)`` whatever the config says: a
    config naming DeepSpeedRunner gets it (it got a plain Runner, silently, before issue
    43); configs without ``runner_type``, or naming MMEngine's own runner, are untouched."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmengine_deepspeed import DeepSpeedRunner
    from tests.helpers import toy_config

    def cfg(name: str, **keys: Any) -> Config:
        return Config(dict(toy_config(str(tmp_path / name), max_iters=1, val=False), **keys))

    routed = Runner.from_cfg(cfg('named', runner_type='DeepSpeedRunner'))
    assert type(routed) is DeepSpeedRunner
    assert type(Runner.from_cfg(cfg('plain'))) is Runner
    assert type(Runner.from_cfg(cfg('runner', runner_type='Runner'))) is Runner
    assert type(DeepSpeedRunner.from_cfg(cfg('direct'))) is DeepSpeedRunner
