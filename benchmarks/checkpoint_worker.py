"""One rank of the checkpoint benchmark: time our save and resume against DeepSpeed's save.

Usage (under torchrun): ``checkpoint_worker.py MODEL STAGE OUT_DIR REPEATS``. Rank 0 prints
``RESULT {json}`` with median seconds and the checkpoint path.
"""
from __future__ import annotations

import json
import os.path as osp
import shutil
import statistics
import sys
import time

import torch.distributed as dist


def main() -> None:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed.demo  # noqa: F401  registers DeepSpeedRunner and TinyGPT
    from benchmarks.common import ds_config
    from benchmarks.overhead_worker import mmengine_cfg
    from mmengine_deepspeed.checkpoint import io as ckpt_io

    model, stage, out, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    cfg = mmengine_cfg(model, 1, osp.join(out, 'work'))
    cfg.update(runner_type='DeepSpeedRunner', ds_config=ds_config(stage))
    cfg['ds_config'].pop('bf16')  # fp32 Adam states, as in the memory table
    runner = RUNNERS.build(Config(cfg))
    runner.train()
    engine = runner.engines['model']

    def timed(fn: object) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            dist.barrier()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    ours = osp.join(out, 'ours.pth')
    save = timed(lambda: runner.save_checkpoint(out, 'ours.pth', by_epoch=False))
    def raw_save() -> None:
        # a fresh directory each time, as our save replaces its shards
        if dist.get_rank() == 0:
            shutil.rmtree(osp.join(out, 'raw'), ignore_errors=True)
        dist.barrier()
        engine.save_checkpoint(osp.join(out, 'raw'), tag='raw', save_latest=False)

    raw = timed(raw_save)
    resume = timed(lambda: ckpt_io.resume(runner, ours, False))
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(stage=stage, save_s=save, raw_save_s=raw,
                                          resume_s=resume, path=ours)), flush=True)


if __name__ == '__main__':
    main()
