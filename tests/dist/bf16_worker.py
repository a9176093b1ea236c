"""One process: a config asking for bf16 "auto" on a CPU without native bf16.

This machine's CPU may well have AVX512-BF16 or AMX, so the probe is replaced
(hardware missing): ``dist.native_bf16`` answers False. Prints the resolved
precision and the parameters' dtype; the log holds the one line about it.
Usage: ``bf16_worker.py WORK_DIR``.
"""
import sys

import torch
from mmengine.config import Config

import mmengine_deepspeed.dist
import mmengine_deepspeed.engine.spec
import mmengine_deepspeed.hooks.monitor
from mmengine_deepspeed import DeepSpeedRunner
from tests.helpers import toy_config


def no_native_bf16() -> bool:
    return False


def main() -> None:
    for module in (mmengine_deepspeed.dist, mmengine_deepspeed.engine.spec,
                   mmengine_deepspeed.hooks.monitor):
        module.native_bf16 = no_native_bf16  # type: ignore[attr-defined]
    cfg = toy_config(sys.argv[1], max_iters=2, val=False, log_level='INFO',
                     ds_config={'zero_optimization': {'stage': 2}, 'bf16': {'enabled': 'auto'}})
    runner = DeepSpeedRunner.from_cfg(Config(cfg))
    runner.train()
    dtype = next(runner.model.module.parameters()).dtype
    print(f'PRECISION {runner.strategy.specs.precision} {str(dtype).replace("torch.", "")}',
          flush=True)
    assert dtype == torch.float32


if __name__ == '__main__':
    main()
