"""One rank of the overhead benchmark: train N iterations one way, report the speed.

Usage (under torchrun): ``overhead_worker.py MODE MODEL STAGE WARMUP ITERS``, MODE one of
``raw`` (a hand-written DeepSpeed loop), ``runner`` (DeepSpeedRunner) and ``strategy``
(MMEngine's FlexibleRunner + DeepSpeedStrategy, with the patches listed in
``STRATEGY_PATCHES`` applied here only). Rank 0 prints ``RESULT {json}``.
"""
from __future__ import annotations

import time

PROCESS_START = time.time()

import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402

STRATEGY_PATCHES = (
    'what importing mmengine_deepspeed (for the shared TinyGPT class) registered is undone: '
    "DeepSpeed's optimizers (so MMEngine's own registration runs) and MMEngine's "
    'DeepSpeedOptimWrapper is registered again over ours',
    'a stub deepspeed.runtime.fp16.onebit module (removed in DeepSpeed 0.19, imported by '
    "MMEngine's optimizer registration)",
    'the process group is created before FlexibleRunner (MMEngine init_dist calls '
    'torch.cuda.set_device on CPU)',
)


class Clock(Hook):
    """Records the end time of every training iteration."""

    priority = 'LOWEST'

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        self.stamps.append(time.time())


def model_and_data(model_name: str) -> tuple[dict, dict]:
    from benchmarks.common import BATCH, MODELS_CFG

    model = dict(MODELS_CFG[model_name], data_preprocessor=dict(type='BaseDataPreprocessor'))
    loader = dict(batch_size=BATCH[model_name], num_workers=0,
                  dataset=dict(type='RandomTokens', size=4096, block_size=64),
                  sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
                  collate_fn=dict(type='default_collate'))
    return model, loader


def mmengine_cfg(model_name: str, iters: int, work_dir: str) -> dict:
    model, loader = model_and_data(model_name)
    return dict(
        model=model, work_dir=work_dir, train_dataloader=loader,
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=10**6), checkpoint=None),
        log_level='WARNING', randomness=dict(seed=0), launcher='pytorch',
        env_cfg=dict(dist_cfg=dict(backend='gloo')))


def run_raw(model_name: str, stage: int, iters: int) -> list[float]:
    import deepspeed
    from mmengine.registry import DATASETS, MODELS
    from torch.utils.data import DataLoader, DistributedSampler

    import mmengine_deepspeed.demo  # noqa: F401  the TinyGPT class
    from benchmarks.common import ds_config
    from mmengine_deepspeed.dist import init_distributed
    init_distributed('pytorch', dict(backend='gloo'))
    model_cfg, loader_cfg = model_and_data(model_name)
    torch.manual_seed(0)
    model = MODELS.build(model_cfg)
    dataset = DATASETS.build(loader_cfg['dataset'])
    loader = DataLoader(dataset, batch_size=loader_cfg['batch_size'],
                        sampler=DistributedSampler(dataset, shuffle=True, seed=0))
    config = dict(ds_config(stage), train_micro_batch_size_per_gpu=loader_cfg['batch_size'],
                  gradient_accumulation_steps=1, steps_per_print=None,
                  zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    stamps = []
    batches = iter(loader)
    engine.train()
    for _ in range(iters):
        batch = next(batches)
        loss = engine(batch['inputs'], batch['targets'], mode='loss')['loss']
        engine.backward(loss)
        engine.step()
        stamps.append(time.time())
    return stamps


def run_runner(model_name: str, stage: int, iters: int, work_dir: str) -> list[float]:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed.demo  # noqa: F401  registers DeepSpeedRunner and TinyGPT
    from benchmarks.common import ds_config

    cfg = mmengine_cfg(model_name, iters, work_dir)
    cfg.update(runner_type='DeepSpeedRunner', ds_config=ds_config(stage))
    runner = RUNNERS.build(Config(cfg))
    clock = Clock()
    runner.register_hook(clock)
    runner.train()
    return clock.stamps


def run_strategy(model_name: str, stage: int, iters: int, work_dir: str) -> list[float]:
    onebit = types.ModuleType('deepspeed.runtime.fp16.onebit')
    for name in ('OnebitAdam', 'OnebitLamb', 'ZeroOneAdam'):
        setattr(onebit, name, type(name, (torch.optim.Optimizer,), {}))
    sys.modules['deepspeed.runtime.fp16.onebit'] = onebit
    from mmengine._strategy.deepspeed import DeepSpeedOptimWrapper as MMEngineDeepSpeedOptimWrapper
    from mmengine.registry import OPTIM_WRAPPERS, OPTIMIZERS
    from mmengine.runner._flexible_runner import FlexibleRunner

    import mmengine_deepspeed.demo  # noqa: F401  the TinyGPT class
    from benchmarks.common import ds_config
    from mmengine_deepspeed.optimizers import DEEPSPEED_OPTIMIZERS

    for cls in DEEPSPEED_OPTIMIZERS:
        OPTIMIZERS._module_dict.pop(cls.__name__, None)
    OPTIM_WRAPPERS.register_module(module=MMEngineDeepSpeedOptimWrapper, force=True)
    dist.init_process_group('gloo')
    cfg = mmengine_cfg(model_name, iters, work_dir)
    config = ds_config(stage)
    cfg['strategy'] = dict(type='DeepSpeedStrategy', zero_optimization=config['zero_optimization'],
                           bf16=config['bf16'], train_micro_batch_size_per_gpu=8)
    cfg['optim_wrapper'] = dict(type='DeepSpeedOptimWrapper',
                                optimizer=dict(type='AdamW', lr=1e-3))
    cfg.pop('env_cfg')
    runner = FlexibleRunner(**cfg)
    clock = Clock()
    runner.register_hook(clock)
    runner.train()
    return clock.stamps


def main() -> None:
    # The same for all three modes: DeepSpeed 0.19's per-step FutureWarnings
    # from torch.distributed would otherwise be printed (and timed) each step.
    for message in ('all_gather_into_tensor', 'reduce_scatter_tensor'):
        warnings.filterwarnings('ignore', message=f'.*{message}` is deprecated',
                                category=FutureWarning)
    mode, model_name, stage, warmup, iters = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    work_dir = sys.argv[6]
    total = warmup + iters
    if mode == 'raw':
        stamps = run_raw(model_name, stage, total)
    elif mode == 'runner':
        stamps = run_runner(model_name, stage, total, work_dir)
    else:
        stamps = run_strategy(model_name, stage, total, work_dir)
    if dist.get_rank() == 0:
        measured = stamps[warmup:]
        speed = (len(measured) - 1) / (measured[-1] - measured[0])
        print('RESULT ' + json.dumps(dict(mode=mode, model=model_name, stage=stage,
                                          it_per_s=speed,
                                          first_iter_s=stamps[0] - PROCESS_START)), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # a clean exit (gloo can abort on teardown otherwise)


if __name__ == '__main__':
    main()
