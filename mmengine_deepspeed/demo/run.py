"""``mmengine-deepspeed demo``: train, validate, checkpoint, export, plot, sample.

Trains the tiny GPT of ``gpt_zero3.py`` on the standard library's source with
DeepSpeed (ZeRO-3 across 2 processes by default), then, in this process and
without DeepSpeed: exports the consolidated weights, plots the curves, loads
the weights into a plain model and prints a generated sample, next to the
validation loss and the unigram baseline it must beat.
"""
from __future__ import annotations

import os
import os.path as osp
import time
from typing import Any, Optional

from mmengine.config import Config

from .console import captured

CONFIG = osp.join(osp.dirname(osp.abspath(__file__)), 'gpt_zero3.py')
PROMPT = b'def '


def demo_overrides(max_iters: int) -> dict[str, Any]:
    """Config overrides that fit the schedule, validation and checkpoints to ``max_iters``."""
    if max_iters < 2:
        raise ValueError(f'--max-iters {max_iters}: give at least 2.')
    warmup = max(1, min(30, max_iters // 10))
    return {
        'train_cfg.max_iters': max_iters,
        'train_cfg.val_interval': max(1, max_iters // 3),
        'param_scheduler': [
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=warmup),
            dict(type='CosineAnnealingLR', by_epoch=False, begin=warmup, end=max_iters,
                 eta_min=3e-4)],
        'default_hooks.checkpoint.interval': max_iters,
        'default_hooks.logger.interval': max(1, min(25, max_iters // 4)),
        'custom_hooks': [dict(type='DemoProgressHook')],
    }


def train_logged(config: str, work_dir: Optional[str], launcher: str, cfg_options: dict,
                 resume: Optional[str], zero: Optional[int], ds_config: Optional[str],
                 console_log: str) -> str:
    """``training.run_training`` with everything this process prints in ``console_log``;
    rank 0 draws the progress bar on the console instead (module-level: it is pickled)."""
    from ..training import run_training

    with captured(console_log, show_progress=int(os.environ.get('RANK', '0')) == 0):
        return run_training(config, work_dir, launcher, cfg_options, resume, zero, ds_config)


def run_demo(nproc: int = 2, zero: int = 3, max_iters: int = 300,
             work_dir: str = 'work_dirs/demo') -> dict[str, Any]:
    """Run the demo and print what it did.

    Args:
        nproc (int): Training processes. Defaults to 2.
        zero (int): ZeRO stage. Defaults to 3.
        max_iters (int): Training iterations. Defaults to 300.
        work_dir (str): Where everything goes. Defaults to ``work_dirs/demo``.

    Returns:
        dict: Validation loss, baseline, paths, sample and wall time.
    """
    from ..dist import native_bf16
    from ..training import train_config

    start = time.perf_counter()
    console_log = osp.join(work_dir, 'console.log')
    precision = ('bf16' if native_bf16() else
                 'fp32 (this CPU has no native bf16: AVX512-BF16 or AMX)')
    print(f'mmengine-deepspeed demo: a tiny GPT on the Python standard library, {max_iters} '
          f'iterations, ZeRO-{zero}, {nproc} processes, {precision}; full logs in '
          f'{console_log}', flush=True)
    train_config(CONFIG, nproc=nproc, work_dir=work_dir, cfg_options=demo_overrides(max_iters),
                 zero=zero, entrypoint=train_logged, extra=(console_log,))
    trained = time.perf_counter() - start
    with captured(console_log, show_progress=False) as console:
        summary = _after_training(work_dir)
        verdict = 'learned' if summary['val_loss'] < summary['baseline'] else \
            'NOT below the baseline'
        summary.update(train_seconds=trained, total_seconds=time.perf_counter() - start)
        console.write('\n'.join([
            '',
            f'mmengine-deepspeed demo: {max_iters} iterations, ZeRO-{zero}, {nproc} processes, '
            f'{trained:.0f} s of training',
            f'  validation loss {summary["val_loss"]:.3f} nats/byte; unigram baseline '
            f'{summary["baseline"]:.3f} ({verdict})',
            f'  checkpoint : {summary["checkpoint"]}',
            f'  weights    : {summary["weights"]}  (plain MMEngine load_checkpoint, no DeepSpeed)',
            f'  curves     : {summary["curves"]}',
            '  sample     :',
            '    ' + (PROMPT.decode() + summary['sample']).replace('\n', '\n    '),
            '']))
    return summary


def _after_training(work_dir: str) -> dict[str, Any]:
    """Export, plot and sample without DeepSpeed, in this process."""
    from mmengine.runner import load_checkpoint

    from ..checkpoint.export import export_checkpoint
    from ..checkpoint.layout import find_latest_complete
    from ..plot import plot_run, read_scalars
    from .data import unigram_baseline
    from .model import TinyGPT

    checkpoint, _ = find_latest_complete(work_dir)
    if checkpoint is None:
        raise RuntimeError(f'training finished without a complete checkpoint in {work_dir}')
    checkpoint = osp.join(work_dir, osp.relpath(checkpoint, work_dir))  # as the others: under
    # work_dir as the user gave it
    weights = export_checkpoint(checkpoint, osp.join(work_dir, 'demo_gpt.pth'))
    curves = plot_run(work_dir, osp.join(work_dir, 'loss_curve.png'))
    val = read_scalars(work_dir)['val/nll']
    model_cfg = dict(Config.fromfile(CONFIG).model)
    model_cfg.pop('type')
    model_cfg.pop('data_preprocessor', None)
    model = TinyGPT(**model_cfg)
    load_checkpoint(model, weights, map_location='cpu', strict=True, logger='silent')
    model.eval()
    return dict(val_loss=val[max(val)], baseline=unigram_baseline(), checkpoint=checkpoint,
                weights=weights, curves=curves, sample=model.generate(PROMPT, 200).decode(
                    'utf-8', errors='replace'))
