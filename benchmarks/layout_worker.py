"""One timed run of ``benchmarks/layout.py``: a small BatchNorm + dropout MLP on random data,
trained by DeepSpeedRunner either with ``layout`` (k virtual ranks per rank, one iteration
each k micro-batches) or with plain accumulation (``accumulative_counts=k``, one micro-batch
an iteration), the same samples and optimizer steps; prints ``RESULT {...}`` on rank 0
for each run.

    torchrun --nproc_per_node 2 benchmarks/layout_worker.py MODE[,MODE...] K STEPS WORK_DIR

(MODE: layout or accumulation; several run one after another in the one process.)
"""
from __future__ import annotations

import json
import os
import sys
import time
from os import path as osp
from typing import Any, Optional

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, HOOKS, MODELS, RUNNERS
from torch import nn
from torch.utils.data import Dataset

import mmengine_deepspeed  # noqa: F401  registers DeepSpeedRunner

BATCH, WIDTH, WARMUP = 8, 256, 3


@DATASETS.register_module()
class LayoutBenchData(Dataset):
    """Random features and labels."""

    def __init__(self, size: int = 4096):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, WIDTH, generator=generator)
        self.y = torch.randint(0, 10, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return dict(inputs=self.x[index], labels=self.y[index])


@MODELS.register_module()
class LayoutBenchModel(BaseModel):
    """Four Linear + BatchNorm + dropout blocks: buffers and random numbers in every step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Dropout(0.1))
            for _ in range(4)])
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.head(self.blocks(inputs))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, labels))
        return logits


@HOOKS.register_module()
class LayoutBenchTimer(Hook):
    """Wall time and this process's CPU time of the iterations after the warm-up. The CPU
    time leaves out what the wall time also holds: waiting for the other rank in the
    gradient all-reduce (gloo blocks, it does not spin) and a shared machine's stolen time,
    so it is the steadier measure of what the host does per step."""

    def __init__(self) -> None:
        self.start: Optional[tuple[float, float]] = None
        self.seconds = self.cpu_seconds = 0.0

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        if runner.iter == self.warmup(runner):
            self.start = (time.perf_counter(), time.process_time())

    def after_train(self, runner: Any) -> None:
        assert self.start is not None
        self.seconds = time.perf_counter() - self.start[0]
        self.cpu_seconds = time.process_time() - self.start[1]

    @staticmethod
    def warmup(runner: Any) -> int:
        return int(runner.cfg.get('timed_from', WARMUP))


def train(mode: str, k: int, steps: int, work_dir: str, name: str) -> dict:
    """One timed run: ``mode`` with k virtual ranks per rank (or accumulation over k)."""
    world = int(os.environ.get('WORLD_SIZE', 1))
    layout = mode == 'layout'
    iterations = steps if layout else steps * k
    cfg = Config(dict(
        model=dict(type='LayoutBenchModel'), work_dir=work_dir, launcher='pytorch',
        runner_type='DeepSpeedRunner', experiment_name=name,
        train_dataloader=dict(batch_size=BATCH, num_workers=0,
                              dataset=dict(type='LayoutBenchData'),
                              sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=iterations, val_interval=iterations + 1),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01, momentum=0.9),
                           **({} if layout else {'accumulative_counts': k})),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=50), checkpoint=None),
        custom_hooks=[dict(type='LayoutBenchTimer')],
        randomness=dict(seed=0), log_level='WARNING',
        env_cfg=dict(dist_cfg=dict(backend='gloo')),
        timed_from=WARMUP if layout else WARMUP * k,
        **({'layout': dict(world_size=k * world)} if layout else {})))
    runner = RUNNERS.build(cfg)
    runner.train()
    timer = next(h for h in runner.hooks if isinstance(h, LayoutBenchTimer))
    timed_steps = steps - WARMUP
    return dict(mode=mode, k=k, rank=runner.rank,
                ms_per_step=timer.seconds / timed_steps * 1000,
                cpu_ms_per_step=timer.cpu_seconds / timed_steps * 1000)


def main() -> None:
    """Each mode of the comma-separated list in turn, in this one process (a shared
    machine's launch-to-launch differences then fall on both modes alike)."""
    modes, k, steps, work_dir = sys.argv[1].split(','), int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    for index, mode in enumerate(modes):
        result = train(mode, k, steps, osp.join(work_dir, f'{index}_{mode}'),
                       f'layout_bench_{mode}_{index}')
        if result.pop('rank') == 0:
            print('RESULT ' + json.dumps(result), flush=True)


if __name__ == '__main__':
    main()
