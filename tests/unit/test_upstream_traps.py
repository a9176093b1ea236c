"""MMEngine 0.10.7 traps on DeepSpeed 0.19 that importing our package must avoid."""
from __future__ import annotations

import os
import pickle
import platform
from typing import Any

import pytest
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from mmengine.registry import OPTIM_WRAPPERS, OPTIMIZERS, RUNNERS

import mmengine_deepspeed
from mmengine_deepspeed import DeepSpeedOptimWrapper, DeepSpeedRunner


@pytest.mark.xfail(strict=True, raises=ModuleNotFoundError,
                   reason='MMEngine 0.10.7 imports deepspeed.runtime.fp16.onebit, removed in '
                          'DeepSpeed 0.19; engine/optimizers.py registers them itself')
def test_mmengine_registers_deepspeed_optimizers() -> None:
    """Pins the trap: when MMEngine fixes it, this passes and the strict xfail says so."""
    from mmengine._strategy.deepspeed import register_deepspeed_optimizers

    register_deepspeed_optimizers()


def test_our_registration_makes_deepspeed_optimizers_buildable_by_name() -> None:
    assert OPTIMIZERS.get('DeepSpeedCPUAdam') is DeepSpeedCPUAdam
    assert OPTIMIZERS.get('FusedAdam') is FusedAdam
    assert 'DeepSpeedCPUAdam' in mmengine_deepspeed.register_deepspeed_optimizers()


def test_our_optim_wrapper_replaces_mmengine_same_named_one() -> None:
    """mmengine._strategy registers a DeepSpeedOptimWrapper of its own under the same name."""
    assert OPTIM_WRAPPERS.get('DeepSpeedOptimWrapper') is DeepSpeedOptimWrapper


def test_runner_is_registered() -> None:
    assert RUNNERS.get('DeepSpeedRunner') is DeepSpeedRunner


@pytest.mark.xfail(strict=True, raises=pickle.UnpicklingError,
                   reason="MMEngine 0.10.7's Runner.resume loads with torch's default "
                          'weights_only=True (torch >= 2.6), which refuses its own checkpoints')
def test_mmengine_resumes_its_own_checkpoint(tmp_path: Any) -> None:
    """Pins the trap our resume avoids: MMEngine's checkpoints pickle numpy arrays and
    HistoryBuffers; ours are written in plain types (tests/dist/test_checkpoint.py)."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    from tests.helpers import toy_config

    ckpt = dict(type='CheckpointHook', interval=2, by_epoch=False)
    Runner.from_cfg(Config(toy_config(str(tmp_path), max_iters=2, val=False,
                                      checkpoint=ckpt))).train()
    Runner.from_cfg(Config(toy_config(str(tmp_path), max_iters=4, val=False,
                                      checkpoint=ckpt, resume=True))).train()


def _cpu_flags() -> set[str]:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
        return {flag for line in f if line.startswith('flags') for flag in line.split()[2:]}


@pytest.mark.skipif(not os.path.isfile('/proc/cpuinfo') or platform.machine() != 'x86_64',
                    reason='compares torch with the x86 CPU flags Linux lists')
def test_torch_cpu_bf16_probes_match_the_cpu_flags() -> None:
    """Pins the private torch probes dist.native_bf16() reads against what the CPU says."""
    import torch

    from mmengine_deepspeed.dist import native_bf16

    flags = _cpu_flags()
    assert torch.cpu._is_avx512_bf16_supported() == ('avx512_bf16' in flags)
    assert torch.cpu._is_amx_tile_supported() == ('amx_tile' in flags)
    if not torch.cuda.is_available():
        assert native_bf16() == bool({'avx512_bf16', 'amx_tile'} & flags)
