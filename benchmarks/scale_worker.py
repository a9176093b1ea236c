"""One rank of the scale benchmark: build a TinyGPT with DeepSpeedRunner, train, report memory.

Usage: ``scale_worker.py CASE WIDTH DEPTH STEPS [--cold]``, CASE one of ``scale.CASES``.
Rank 0 prints ``RESULT {json}`` with the maximum over ranks of:

* ``construct_mb``: peak memory rise while ``DeepSpeedRunner.from_cfg`` builds
  the model (on CPU the peak RSS, VmHWM, reset first; on CUDA the allocator's
  peak), after a warm-up runner around a one-block model has paid for what
  costs the same at any size (process group, DeepSpeed's communication
  buffers, imports); with ``--cold`` there is no warm-up runner: the figure is
  a user's first runner in a fresh process, which also pays those (and cannot
  reuse heap a warm-up runner freed);
* ``train_mb``: the peak rise from the same starting point through building the
  engine and ``STEPS`` training steps;
* ``steady_mb``: what is held after the steps (CPU: RSS after glibc's
  ``malloc_trim``, so memory malloc keeps for reuse is not counted; CUDA: the
  allocated bytes).

fp32 AdamW (DeepSpeed's CPU Adam where the optimizer is offloaded, which the
runner swaps in by itself), batch 1 of 64 tokens. ZeRO-3's buffers and limits
are the runner's, sized to the model (``config/model_settings.py``), except in
``zero3_init_ds_sizes``: DeepSpeed's own defaults, with the reduce bucket sized
to the trainable parameters (what the runner did before it sized the rest).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from mmengine.config import Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmengine_deepspeed.demo  # noqa: F401  registers the runner and TinyGPT
from benchmarks.common import live_rss_kib, reset_peak_rss, status_kib  # registers RandomTokens
from mmengine_deepspeed import DeepSpeedRunner

# name -> (ZeRO stage, zero_init, offload optimizer and parameters to the CPU)
CASES = {'zero0': (0, False, False), 'zero3': (3, False, False),
         'zero3_init': (3, True, False), 'zero3_init_offload': (3, True, True),
         'zero3_init_ds_sizes': (3, True, False)}
# DeepSpeed 0.19's defaults for what the runner sizes to the model (zero3_init_ds_sizes)
DEEPSPEED_SIZES = dict(stage3_prefetch_bucket_size=50_000_000, stage3_max_live_parameters=10**9,
                       stage3_max_reuse_distance=10**9, sub_group_size=10**9)


def reset_peak() -> float:
    """Start a new peak; returns the current figure in MiB."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    return reset_peak_rss() / 1024


def peak() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return status_kib('VmHWM') / 1024


def held() -> float:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**20
    return live_rss_kib() / 1024


def trainable_params(width: int, depth: int) -> int:
    """The TinyGPT's parameter count, from a model built on the meta device."""
    from mmengine.registry import MODELS
    with torch.device('meta'):
        model = MODELS.build(dict(type='TinyGPT', block_size=64, width=width, depth=depth,
                                  heads=max(1, width // 64)))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def config(case: str, width: int, depth: int, steps: int, work_dir: str) -> dict:
    stage, zero_init, offload = CASES[case]
    zero: dict[str, Any] = dict(stage=stage)
    if case == 'zero3_init_ds_sizes':
        zero.update(DEEPSPEED_SIZES, reduce_bucket_size=trainable_params(width, depth))
    if offload:
        zero.update(offload_optimizer={'device': 'cpu'}, offload_param={'device': 'cpu'})
    backend = 'nccl' if torch.cuda.is_available() else 'gloo'
    return dict(
        model=dict(type='TinyGPT', block_size=64, width=width, depth=depth,
                   heads=max(1, width // 64), data_preprocessor=dict(type='BaseDataPreprocessor')),
        work_dir=work_dir,
        train_dataloader=dict(batch_size=1, num_workers=0,
                              dataset=dict(type='RandomTokens', size=64, block_size=64),
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=steps),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-4)),
        ds_config=dict(zero_optimization=zero, steps_per_print=10**9),
        zero_init=zero_init,
        default_hooks=dict(logger=dict(type='LoggerHook', interval=10**6), checkpoint=None),
        log_level='WARNING', randomness=dict(seed=0), launcher='pytorch',
        env_cfg=dict(dist_cfg=dict(backend=backend)))


def main() -> None:
    case, (width, depth, steps) = sys.argv[1], map(int, sys.argv[2:5])
    with tempfile.TemporaryDirectory() as work_dir:
        if '--cold' not in sys.argv[5:]:
            DeepSpeedRunner.from_cfg(Config(config(case, width, 1, steps, work_dir)))
        base = reset_peak()
        runner = DeepSpeedRunner.from_cfg(Config(config(case, width, depth, steps, work_dir)))
        construct = peak() - base
        params = sum(int(getattr(p, 'ds_numel', p.numel())) for p in runner.model.parameters())
        largest = max(sum(int(getattr(p, 'ds_numel', p.numel()))
                          for p in m.parameters(recurse=False)) for m in runner.model.modules())
        runner.train()
        train, steady = peak() - base, held() - base
    value = torch.tensor([construct, train, steady], dtype=torch.float64,
                         device='cuda' if torch.cuda.is_available() else 'cpu')
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(
            case=case, width=width, depth=depth, params=params, largest_layer=largest,
            construct_mb=float(value[0]), train_mb=float(value[1]), steady_mb=float(value[2]),
            world=dist.get_world_size(), cuda=torch.cuda.is_available())), flush=True)


if __name__ == '__main__':
    main()
