"""Checkpoint cost on 2 ranks: save (ours vs DeepSpeed's engine.save_checkpoint), resume,
export (ours vs DeepSpeed's zero_to_fp32, in one process and as commands), reshard (the
universal conversion), sizes on disk.

    python benchmarks/checkpoint_cost.py [--smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from os import path as osp
from typing import Callable

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import REPO_ROOT, device_ranks, spread, table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'checkpoint_worker.py')


def size_mb(path: str) -> float:
    if osp.isfile(path):
        return osp.getsize(path) / 2**20
    return sum(osp.getsize(osp.join(r, f)) for r, _, fs in os.walk(path) for f in fs) / 2**20


def command(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=REPO_ROOT))


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def export_seconds(ckpt: str, out: str, repeats: int) -> tuple[float, float]:
    """Medians of ours and DeepSpeed's conversion in this process (imports done), interleaved."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    from mmengine_deepspeed.checkpoint.export import export_checkpoint

    ours, theirs = [], []
    # both print DeepSpeed's progress messages and bars; not part of the table
    with open(os.devnull, 'w') as quiet, contextlib.redirect_stdout(quiet), \
            contextlib.redirect_stderr(quiet):
        for _ in range(repeats):
            ours.append(seconds(lambda: export_checkpoint(ckpt, osp.join(out, 'export.pth'))))
            theirs.append(seconds(lambda: convert_zero_checkpoint_to_fp32_state_dict(
                ckpt, osp.join(out, 'ds_export'), tag='deepspeed')))
    return statistics.median(ours), statistics.median(theirs)


def measure(stage: int, model: str, repeats: int, out: str) -> list:
    """One table row: train, save and resume on the ranks, then convert and reshard here."""
    (r,) = torchrun(WORKER, [model, str(stage), out, str(repeats)], nproc=device_ranks())
    ckpt = r['path']
    export = osp.join(out, 'export.pth')
    ours_convert = seconds(lambda: command([
        sys.executable, '-m', 'mmengine_deepspeed', 'convert', ckpt, export]))
    ds_convert = seconds(lambda: command([
        sys.executable, osp.join(ckpt, 'zero_to_fp32.py'), ckpt, osp.join(out, 'ds_export'),
        '--tag', 'deepspeed']))
    ours_export, ds_export = export_seconds(ckpt, out, repeats)
    from mmengine_deepspeed.checkpoint.reshard import _run_ds_to_universal
    reshard = seconds(lambda: _run_ds_to_universal(osp.join(ckpt, 'deepspeed'),
                                                   osp.join(out, 'universal')))
    ratios = [o / d for o, d in zip(r['save_s'], r['raw_save_s'])]
    return [f'ZeRO-{stage}', statistics.median(r['save_s']), statistics.median(r['raw_save_s']),
            spread(ratios), r['resume_s'], ours_export, ds_export, ours_export / ds_export,
            ours_convert, ds_convert, reshard, size_mb(osp.join(ckpt, 'deepspeed')),
            size_mb(ckpt), size_mb(export)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    model, repeats = ('tiny', 1) if args.smoke else ('big', 5)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(stage, model, repeats, osp.join(tmp, f'z{stage}')) for stage in (2, 3)]
    print(table(['stage', 'save s', 'DeepSpeed save s', 'save ratio min/med/max', 'resume s',
                 'export s', 'zero_to_fp32 s', 'export ratio', 'convert command s',
                 'zero_to_fp32 command s', 'reshard s', 'shards MiB', 'checkpoint MiB',
                 'export MiB'], rows))
    print(f'\nmodel "{model}", fp32 AdamW; {repeats} saves each, ours and DeepSpeed\'s '
          'interleaved; export = export_checkpoint vs convert_zero_checkpoint_to_fp32_state_dict '
          'in one process (medians); the commands include their imports; reshard = '
          'ds_to_universal.')


if __name__ == '__main__':
    main()
