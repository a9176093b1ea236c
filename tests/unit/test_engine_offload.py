"""engine/offload.py: the optimizer swap for ZeRO-Offload and the NVMe check."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch import nn

from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.engine.offload import check_nvme, cpu_optimizer
from tests.helpers import toy_config

OFFLOAD = {'zero_optimization': {'stage': 2, 'offload_optimizer': {'device': 'cpu'}}}


def two_groups(kind: type, **kwargs: Any) -> torch.optim.Optimizer:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if kind is not torch.optim.SGD:
        kwargs.update(betas=(0.8, 0.9), eps=1e-6)
    return kind([{'params': model[0].parameters(), 'lr': 0.01, 'weight_decay': 0.0},
                 {'params': model[1].parameters()}], lr=0.1, weight_decay=0.05, **kwargs)


@pytest.mark.parametrize('kind', [torch.optim.Adam, torch.optim.AdamW])
def test_offload_swaps_adam_for_cpu_adam_with_the_same_groups(kind: type) -> None:
    optimizer = two_groups(kind)
    swapped, note = cpu_optimizer(optimizer, OFFLOAD)
    assert isinstance(swapped, DeepSpeedCPUAdam) and note is not None and kind.__name__ in note
    assert swapped.adam_w_mode == (kind is torch.optim.AdamW)
    for mine, theirs in zip(swapped.param_groups, optimizer.param_groups):
        assert [id(p) for p in mine['params']] == [id(p) for p in theirs['params']]
        for key in ('lr', 'weight_decay', 'betas', 'eps'):
            assert mine[key] == theirs[key], key
    assert swapped.param_groups[0]['lr'] == 0.01 and swapped.param_groups[1]['lr'] == 0.1


@pytest.mark.parametrize('ds_config', [
    {'zero_optimization': {'stage': 2}},  # nothing offloaded
    dict(OFFLOAD, zero_force_ds_cpu_optimizer=False),  # the user steps it as it is
])
def test_optimizer_is_kept_without_offload_or_when_forced_off(ds_config: dict) -> None:
    optimizer = two_groups(torch.optim.SGD)
    assert cpu_optimizer(optimizer, ds_config) == (optimizer, None)


@pytest.mark.parametrize('optimizer', [
    lambda: two_groups(torch.optim.SGD), lambda: two_groups(torch.optim.AdamW, amsgrad=True)])
def test_offload_refuses_what_cpu_adam_cannot_replace(optimizer: Any) -> None:
    with pytest.raises(ValueError, match=r'DeepSpeedCPUAdam.*zero_force_ds_cpu_optimizer'):
        cpu_optimizer(optimizer(), OFFLOAD)


def test_nvme_offload_is_checked_when_the_runner_is_created(tmp_path: Any) -> None:
    """Real check of DeepSpeed's async_io op on this machine: without libaio the runner
    refuses to start and names what to install; with it, nothing is said."""
    nvme = {'zero_optimization': {'stage': 3, 'offload_param': {'device': 'nvme',
                                                                'nvme_path': str(tmp_path)}}}
    builder = get_accelerator().create_op_builder('AsyncIOBuilder')
    if builder is not None and builder.is_compatible():
        check_nvme(nvme)
        return
    with pytest.raises(RuntimeError, match='libaio'):
        DeepSpeedRunner(**toy_config(str(tmp_path), ds_config=nvme))
