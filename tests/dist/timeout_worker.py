"""Rank 1 stops taking part; rank 0 must fail within env_cfg.dist_cfg.timeout.

Usage (under torchrun, 2 ranks): ``timeout_worker.py WORK_DIR TIMEOUT_S``.
Rank 0 prints ``TIMED_OUT_AFTER <seconds>`` when its collective raises.
"""
import sys
import time

import torch
import torch.distributed as dist

from mmengine_deepspeed import DeepSpeedRunner
from tests.helpers import toy_config


def main() -> None:
    work_dir, timeout = sys.argv[1], float(sys.argv[2])
    cfg = toy_config(work_dir, ds_config={'zero_optimization': {'stage': 2}})
    cfg['env_cfg'] = dict(dist_cfg=dict(backend='gloo', timeout=timeout))
    cfg['launcher'] = 'pytorch'
    runner = DeepSpeedRunner(**cfg)
    if runner.rank == 1:
        time.sleep(120)  # alive but silent: the hang a dead NFS or a stuck peer causes
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # gloo raises RuntimeError subclasses
        print(f'TIMED_OUT_AFTER {time.monotonic() - start:.1f} {type(e).__name__}', flush=True)
        sys.exit(3)
    print('COLLECTIVE_RETURNED', flush=True)


if __name__ == '__main__':
    main()
