"""One rank of the preemption-agreement benchmark: train the benchmark GPT (ZeRO-2) with
PreemptionHook, then time the run's agreement (``strategy/agreement.py``) alone.

Usage (under torchrun): ``stop_and_resume_worker.py TRAIN_ITERS AGREE_CALLS WORK_DIR``.
Rank 0 prints ``RESULT {json}``: the median step (ms), the mean agreement (us), world size
and device.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import RUNNERS

import mmengine_deepspeed.demo  # noqa: F401  registers DeepSpeedRunner and TinyGPT
from benchmarks.common import device_name, ds_config
from benchmarks.overhead_worker import mmengine_cfg


class StepClock(Hook):
    """The wall time of every training iteration."""

    def __init__(self) -> None:
        self.ends: list[float] = [time.perf_counter()]

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        self.ends.append(time.perf_counter())


def main() -> None:
    iters, calls, work_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cfg = mmengine_cfg('gpt', iters, work_dir)
    cfg.update(runner_type='DeepSpeedRunner', ds_config=ds_config(2, model='gpt'))
    runner = RUNNERS.build(Config(cfg))
    clock = StepClock()
    runner.register_hook(clock)
    runner.train()
    steps = [b - a for a, b in zip(clock.ends[2:], clock.ends[3:])]  # after warm-up
    agreement = runner.strategy.agreement  # what PreemptionHook (and ThroughputHook) agree through
    dist.barrier()
    start = time.perf_counter()
    for call in range(calls):
        agreement.agreed(runner.iter + 1 + call)  # one collective each: a new iteration
    agree = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
    if runner.rank == 0:
        print('RESULT ' + json.dumps(dict(
            step_ms=statistics.median(steps) * 1000, agree_us=float(agree) * 1e6,
            world=runner.world_size, device=device_name())), flush=True)


if __name__ == '__main__':
    main()
