"""MMEngine 0.10.7 traps on DeepSpeed 0.19 that importing our package must avoid."""
from __future__ import annotations

import pytest
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from mmengine.registry import OPTIM_WRAPPERS, OPTIMIZERS, RUNNERS

import mmengine_deepspeed
from mmengine_deepspeed import DeepSpeedOptimWrapper, DeepSpeedRunner


def test_mmengine_deepspeed_optimizer_registration_is_broken() -> None:
    """Pins the trap: MMEngine's registration imports a module DeepSpeed 0.19 removed."""
    from mmengine._strategy.deepspeed import register_deepspeed_optimizers

    with pytest.raises(ModuleNotFoundError, match=r'deepspeed\.runtime\.fp16\.onebit'):
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
