"""What stopping and resuming cost: the preemption check per iteration, and the time
from a resumed run's start to its first step, by resume position.

* **Preemption agreement** (2 ranks, the benchmark GPT, ZeRO-2): the run's agreement
  (``strategy/agreement.py``: one all-reduce on a CPU group carrying PreemptionHook's signal
  flags and the peak memory), timed over many calls after training, against the median
  training step of the same run; it runs at most every iteration (steps of 2 s and more)
  and every 10th for steps under 0.2 s.
* **Time to the first resumed step** (1 process, the tiny model, ZeRO-2, a dataset whose
  transform sleeps ``SLEEP_MS`` per sample as decoding and augmenting would): resumed at
  iteration 10 and 10,000 by DeepSpeedRunner's iteration loop (skips at the sampler) and
  by MMEngine's ``IterBasedTrainLoop`` (loads and drops every trained batch). The
  checkpoint is taken after one real step with the loop position set to N: what a resume
  costs depends on the position, not on the weights.

Usage: ``python benchmarks/stop_and_resume.py [--smoke]``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from os import path as osp
from typing import Any, Optional

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch
from mmengine.hooks import Hook
from mmengine.registry import DATASETS, HOOKS, LOOPS
from mmengine.runner import IterBasedTrainLoop

from benchmarks.common import RandomTokens, device_name, device_ranks, table, torchrun

SLEEP_MS = 1.0
BATCH = 2
# One epoch holds every resume point: the figures are loading alone (MMEngine's iterator
# also sleeps 2 s at each epoch end it crosses while fast-forwarding).
DATASET_SIZE = 40_000


@DATASETS.register_module()
class SlowTokens(RandomTokens):
    """RandomTokens whose every sample takes ``sleep_ms`` to produce."""

    def __init__(self, sleep_ms: float = 0.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.sleep_ms = sleep_ms

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1000)
        return super().__getitem__(index)


@LOOPS.register_module()
class MMEngineIterBasedTrainLoop(IterBasedTrainLoop):
    """MMEngine's own loop under another name, which DeepSpeedRunner leaves as it is."""


@HOOKS.register_module()
class PositionHook(Hook):
    """Sets the loop position to ``position - 1`` before the one real step (see above)."""

    def __init__(self, position: int):
        self.position = position

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        runner.train_loop._iter = self.position - 1


@HOOKS.register_module()
class FirstStepClock(Hook):
    """Records when the first training step of the run ends."""

    first_step_end: Optional[float] = None

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        if FirstStepClock.first_step_end is None:
            FirstStepClock.first_step_end = time.monotonic()


def resume_cfg(work_dir: str, name: str, max_iters: int, sleep_ms: float,
               loop: str, hooks: list[dict], **extra: Any) -> dict:
    return dict(
        model=dict(type='BenchTinyMLP', data_preprocessor=dict(type='BaseDataPreprocessor')),
        work_dir=work_dir, experiment_name=name, runner_type='DeepSpeedRunner',
        ds_config={'zero_optimization': {'stage': 2}},
        train_dataloader=dict(batch_size=BATCH, num_workers=0,
                              dataset=dict(type='SlowTokens', size=DATASET_SIZE,
                                           sleep_ms=sleep_ms),
                              sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(type=loop, max_iters=max_iters),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=10**6), checkpoint=dict(
            type='CheckpointHook', interval=10**9, by_epoch=False, save_last=True)),
        custom_hooks=hooks, log_level='WARNING', randomness=dict(seed=0), **extra)


def seconds_to_first_step(position: int, loop: str, tmp: str) -> float:
    """Save a checkpoint at ``position``, then time a resumed run up to its first step."""
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed.demo  # noqa: F401  registers DeepSpeedRunner, BenchTinyMLP
    work = osp.join(tmp, f'{loop}_{position}')
    saver = RUNNERS.build(Config(resume_cfg(work, f'save_{loop}_{position}', position, 0.0,
                                            loop, [dict(type='PositionHook',
                                                        position=position)])))
    saver.train()
    FirstStepClock.first_step_end = None
    resumed = RUNNERS.build(Config(resume_cfg(
        work, f'resume_{loop}_{position}', position + 1, SLEEP_MS, loop,
        [dict(type='FirstStepClock')], resume=True,
        load_from=osp.join(work, f'iter_{position}.pth'))))
    start = time.monotonic()
    resumed.train()
    assert FirstStepClock.first_step_end is not None
    return FirstStepClock.first_step_end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    positions = (10, 100) if args.smoke else (10, 10_000)
    train_iters, agree_calls = (4, 20) if args.smoke else (40, 500)
    with tempfile.TemporaryDirectory() as tmp:
        agreement = torchrun(osp.join('benchmarks', 'stop_and_resume_worker.py'),
                             [str(train_iters), str(agree_calls), osp.join(tmp, 'agree')],
                             nproc=device_ranks())[0]
        print(table(['ranks', 'device', 'median step ms', 'agreement us',
                     'agreement / step (were it every iteration)'],
                    [[agreement['world'], agreement['device'], agreement['step_ms'],
                      agreement['agree_us'],
                      f'{agreement["agree_us"] / 10 / agreement["step_ms"]:.3f} %']]))
        rows = []
        for position in positions:
            ours = seconds_to_first_step(position, 'IterBasedTrainLoop', tmp)
            mmengine = seconds_to_first_step(position, 'MMEngineIterBasedTrainLoop', tmp)
            rows.append([position, ours, mmengine, position * BATCH * SLEEP_MS / 1000])
        print()
        print(table(['resumed at iteration', 'DeepSpeedRunner s to first step',
                     "MMEngine's IterBasedTrainLoop s", 'loading the skipped samples alone s'],
                    rows))
    print(f'\n1 process, batch {BATCH}, {SLEEP_MS} ms per sample; '
          f'{device_name()}; torch {torch.__version__}.')


if __name__ == '__main__':
    main()
