"""One rank of the checkpoint benchmark: time our save and resume against DeepSpeed's save.

Usage (under torchrun): ``checkpoint_worker.py MODEL STAGE OUT_DIR REPEATS``. Rank 0 prints
``RESULT {json}`` with the seconds of each save (ours and DeepSpeed's, interleaved), the
median resume and the checkpoint path.
"""
from __future__ import annotations

import json
import os.path as osp
import shutil
import statistics
import sys
import time
from typing import Callable

import torch.distributed as dist


def main() -> None:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed.demo  # noqa: F401  registers DeepSpeedRunner and TinyGPT
    from benchmarks.common import ds_config
    from benchmarks.overhead_worker import mmengine_cfg

    model, stage, out, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    cfg = mmengine_cfg(model, 1, osp.join(out, 'work'))
    cfg.update(runner_type='DeepSpeedRunner', ds_config=ds_config(stage))
    cfg['ds_config'].pop('bf16')  # fp32 Adam states, as in the memory table
    runner = RUNNERS.build(Config(cfg))
    runner.train()
    engine = runner.strategy.engines()['model']

    def seconds(fn: Callable[[], object]) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    ours = osp.join(out, 'ours.pth')

    def raw_save() -> None:
        # a fresh directory each time, as our save replaces its shards
        if dist.get_rank() == 0:
            shutil.rmtree(osp.join(out, 'raw'), ignore_errors=True)
        dist.barrier()
        engine.save_checkpoint(osp.join(out, 'raw'), tag='raw', save_latest=False)

    # interleaved, ours then DeepSpeed's, so that disk and machine noise hit both
    saves, raw_saves = [], []
    for _ in range(repeats):
        saves.append(seconds(lambda: runner.save_checkpoint(out, 'ours.pth', by_epoch=False)))
        raw_saves.append(seconds(raw_save))
    resume = statistics.median(seconds(lambda: runner.resume(ours))
                               for _ in range(repeats))
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(stage=stage, save_s=saves, raw_save_s=raw_saves,
                                          resume_s=resume, path=ours)), flush=True)


if __name__ == '__main__':
    main()
