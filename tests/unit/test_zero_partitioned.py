"""zero/partitioned.py: when a model is built partitioned, and shapes of partitioned
parameters answered without gathering."""
from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.zero.gather import GatherOnUse
from mmengine_deepspeed.zero.partitioned import build_advice
from tests.helpers import ToyModel, toy_config


def test_when_the_model_is_built_whole_and_why() -> None:
    assert build_advice({'type': 'ToyModel'}, 3, zero_init=True, several=False) is None
    assert 'pass its config' in build_advice(ToyModel(), 3, zero_init=True, several=False)
    assert 'Several optimizers' in build_advice({'type': 'ToyModel'}, 3, True, several=True)
    assert build_advice(ToyModel(), 3, zero_init=False, several=False) is None
    assert build_advice(ToyModel(), 2, True, False) is None


def test_zero_init_switch_reads_the_config(tmp_path: Any) -> None:
    cfg = toy_config(str(tmp_path), zero_init=False)
    assert DeepSpeedRunner(**{k: v for k, v in cfg.items() if k != 'zero_init'},
                           cfg=cfg).strategy.zero_init is False
    assert DeepSpeedRunner(**toy_config(str(tmp_path / 'b'))).strategy.zero_init is True


def test_shape_of_a_partitioned_parameter_is_answered_without_gathering() -> None:
    """MMEngine logs parameter shapes on rank 0 only: a gather there would hang."""
    param = nn.Parameter(torch.empty(0))
    param.ds_id, param.ds_numel, param.ds_shape = 0, 12, torch.Size([3, 4])
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    mode = GatherOnUse(budget=12)
    with mode:
        assert param.shape == torch.Size([3, 4]) and param.size(1) == 4
        assert param.dim() == 2 and param.numel() == 12 and param.dtype == torch.float32
    assert mode.peak_numel == 0  # nothing was gathered
