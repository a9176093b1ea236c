"""One rank of the plan accuracy benchmark: train a config, report the logged peak memory.

Usage: ``plan_accuracy_worker.py CONFIG WORK_DIR``. Rank 0 prints ``RESULT {json}``
with ``peak_mem_mb``: the largest ``train/peak_mem_mb`` the training log reported
(ThroughputHook's figure, already the maximum over ranks), read from the message hub.
"""
from __future__ import annotations

import json
import sys
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmengine.config import Config
from mmengine.registry import RUNNERS

import mmengine_deepspeed  # noqa: F401


def main() -> None:
    cfg = Config.fromfile(sys.argv[1])
    cfg.work_dir, cfg.launcher = sys.argv[2], 'pytorch'
    runner = RUNNERS.build(cfg)
    runner.train()
    history = runner.message_hub.get_scalar('train/peak_mem_mb').data[0]
    if runner.rank == 0:
        print('RESULT ' + json.dumps(dict(peak_mem_mb=float(max(history)))), flush=True)


if __name__ == '__main__':
    main()
