"""Checkpoint cost on 2 ranks: save (ours vs DeepSpeed's engine.save_checkpoint), resume,
export (``mmengine-deepspeed convert`` vs DeepSpeed's ``zero_to_fp32.py``, both as
commands), reshard (the universal conversion), sizes on disk.

    python benchmarks/checkpoint_cost.py [--smoke]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import REPO_ROOT, table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'checkpoint_worker.py')


def size_mb(path: str) -> float:
    if osp.isfile(path):
        return osp.getsize(path) / 2**20
    return sum(osp.getsize(osp.join(r, f)) for r, _, fs in os.walk(path) for f in fs) / 2**20


def command_seconds(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    model, repeats = ('tiny', 1) if args.smoke else ('big', 3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (2, 3):
            out = osp.join(tmp, f'z{stage}')
            (r,) = torchrun(WORKER, [model, str(stage), out, str(repeats)])
            ckpt = r['path']
            export = osp.join(out, 'export.pth')
            ours_convert = command_seconds([sys.executable, '-m', 'mmengine_deepspeed', 'convert',
                                            ckpt, export])
            ds_convert = command_seconds([sys.executable, osp.join(ckpt, 'zero_to_fp32.py'), ckpt,
                                          osp.join(out, 'ds_export'), '--tag', 'deepspeed'])
            from mmengine_deepspeed.checkpoint.reshard import _run_ds_to_universal
            start = time.perf_counter()
            _run_ds_to_universal(osp.join(ckpt, 'deepspeed'), osp.join(out, 'universal'))
            reshard = time.perf_counter() - start
            rows.append([f'ZeRO-{stage}', r['save_s'], r['raw_save_s'],
                         r['save_s'] / r['raw_save_s'], r['resume_s'], ours_convert, ds_convert,
                         reshard, size_mb(osp.join(ckpt, 'deepspeed')), size_mb(ckpt),
                         size_mb(export)])
    print(table(['stage', 'save s', 'DeepSpeed save s', 'ratio', 'resume s', 'convert s',
                 'zero_to_fp32 s', 'reshard s', 'shards MiB', 'checkpoint MiB', 'export MiB'],
                rows))
    print(f'\nmodel "{model}", 2 ranks, fp32 AdamW; medians of {repeats}; convert and '
          'zero_to_fp32 timed as commands (imports included); reshard = ds_to_universal.')


if __name__ == '__main__':
    main()
