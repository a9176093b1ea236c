"""What a user pays on real OpenMMLab configs: each ZeRO stage against ZeRO-0, deterministic or not.

The real-client tier's configs (``tests/openmmlab/configs.py``: MMPretrain ResNet-18,
MMDetection RetinaNet and Faster R-CNN, MMSegmentation SegFormer, MMagic DCGAN; MMPretrain
BYOL and MoCo v3 with ``--configs byol,mocov3``; each the
library's own config plus the three lines), on the tier's generated data made larger, through the
library's own ``tools/train.py`` on 2 CPU ranks, fp32, seed 0, at ZeRO 0-3, with
MMEngine's ``randomness.deterministic`` on and off. Beside ours at ZeRO-1/2, the same run
with DeepSpeed's own defaults (``reduce_bucket_size`` 5e8 given explicitly, which the
runner keeps). For each run: the median time per iteration after the first
``--warmup`` iterations (MMEngine's logged ``time``), the largest logged ``peak_mem_mb``
(the maximum over ranks), and ``plan``'s prediction from the training log. Needs
``.venv-openmmlab`` (``scripts/setup_openmmlab.sh``); run it from there:

    python benchmarks/real_configs.py [--configs resnet_cifar,retinanet,...] [--iters 12]
                                      [--stages 0,1,2,3] [--modes plain,deterministic]
                                      [--json OUT] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import os.path as osp
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Optional

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import REPO_ROOT, device_name, table
from mmengine_deepspeed.config.model_settings import DEEPSPEED_REDUCE_BUCKET
from mmengine_deepspeed.dist import free_port
from tests.openmmlab import data
from tests.openmmlab.configs import CONFIGS

# The tier's data, larger: enough batches for --iters iterations on 2 ranks in one epoch.
DATA = {'mmdet': lambda root, n: data.coco_detection(root, train=n, val=2),
        'mmseg': lambda root, n: data.ade20k_segmentation(root, train=n, val=2),
        'mmpretrain': lambda root, n: data.image_folders(root, per_class=-(-n // 3)),
        'mmagic': lambda root, n: data.image_folders(root, per_class=-(-n // 3))}
# Samples per rank per iteration (the ResNet figures: batch 8).
BATCH = {'resnet_cifar': 8, 'retinanet': 2, 'faster_rcnn': 2, 'segformer': 2, 'dcgan': 2,
         'byol': 8, 'mocov3': 8}


def train_script(library: str) -> str:
    """The library's own ``tools/train.py`` as its package ships it (``.mim``)."""
    import importlib.util
    spec = importlib.util.find_spec(library)
    assert spec is not None and spec.submodule_search_locations, library
    return osp.join(spec.submodule_search_locations[0], '.mim', 'tools', 'train.py')


def run(name: str, root: str, work: str, stage: int, deterministic: bool, defaults: bool,
        iters: int) -> dict[str, Any]:
    """One training run on 2 ranks; its log's figures."""
    library, text, _ = CONFIGS[name]
    config = osp.join(work, f'{name}.py')
    with open(config, 'w') as f:
        f.write(text.replace('{root}', root))
    batch = BATCH[name]
    options = [f'ds_config.zero_optimization.stage={stage}', 'randomness.seed=0',
               f'randomness.deterministic={deterministic}',
               f'train_dataloader.batch_size={batch}', 'train_dataloader.drop_last=True',
               'train_cfg.val_interval=1000',
               'default_hooks.checkpoint.interval=1000', 'default_hooks.logger.interval=1']
    options.append('train_cfg.max_epochs=1' if 'max_epochs' in text else
                   f'train_cfg.max_iters={iters}')
    if defaults:
        options.append(f'ds_config.zero_optimization.reduce_bucket_size={DEEPSPEED_REDUCE_BUCKET}')
    work_dir = osp.join(work, 'run')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2',
           '--master_addr=127.0.0.1', f'--master_port={free_port()}', train_script(library),
           config, '--launcher', 'pytorch', '--work-dir', work_dir, '--cfg-options', *options]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS='1')
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    shutil.rmtree(work_dir, ignore_errors=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f'{name} ZeRO-{stage} failed:\n{log[-4000:]}')
    times = [float(v) for v in re.findall(r'Iter\(train\).*?\btime: ([\d.]+)', log)
             or re.findall(r'Epoch\(train\).*?\btime: ([\d.]+)', log)]
    peaks = [float(v) for v in re.findall(r'peak_mem_mb: ([\d.]+)', log)]
    predicted = re.search(r'`mmengine-deepspeed plan` predicts (\d+) MiB', log)
    return dict(config=name, stage=stage, deterministic=deterministic,
                buckets='DeepSpeed' if defaults else 'ours',
                iterations=len(times), time_s=statistics.median(times[2:] or times),
                peak_mib=max(peaks), plan_mib=float(predicted[1]) if predicted else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--configs',
                        default='resnet_cifar,retinanet,faster_rcnn,segformer,dcgan')
    parser.add_argument('--stages', default='0,1,2,3')
    parser.add_argument('--modes', default='plain,deterministic')
    parser.add_argument('--iters', type=int, default=12)
    parser.add_argument('--json', help='also write the results here')
    parser.add_argument('--smoke', action='store_true', help='ResNet, ZeRO-2, 3 iterations')
    args = parser.parse_args()
    names, stages = args.configs.split(','), [int(s) for s in args.stages.split(',')]
    modes = [mode == 'deterministic' for mode in args.modes.split(',')]
    iters = args.iters
    if args.smoke:
        names, stages, modes, iters = ['resnet_cifar'], [2], [True], 3
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            library = CONFIGS[name][0]
            root = DATA[library](osp.join(work, f'{name}_data'), 2 * BATCH[name] * (iters + 1))
            for deterministic in modes:
                for stage in stages:
                    for defaults in (False, True) if stage in (1, 2) else (False,):
                        results.append(run(name, root, work, stage, deterministic, defaults,
                                           iters))
                        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    print(f'\n{device_name()}, 2 ranks, fp32; per rank; "vs ZeRO-0": the same config and mode\n')
    base: dict[tuple[str, bool], dict[str, Any]] = {
        (r['config'], r['deterministic']): r for r in results
        if r['stage'] == 0}
    rows = []
    for r in results:
        zero0: Optional[dict[str, Any]] = base.get((r['config'], r['deterministic']))
        rows.append([r['config'], r['stage'], 'yes' if r['deterministic'] else 'no',
                     r['buckets'], r['time_s'],
                     r['time_s'] / zero0['time_s'] if zero0 else '-', round(r['peak_mib']),
                     r['peak_mib'] / zero0['peak_mib'] if zero0 else '-',
                     round(r['plan_mib']) if r['plan_mib'] else '-',
                     r['plan_mib'] / r['peak_mib'] if r['plan_mib'] else '-'])
    print(table(['config', 'ZeRO', 'deterministic', 'buckets', 's/iter', 'time vs ZeRO-0',
                 'peak MiB', 'peak vs ZeRO-0', 'plan MiB', 'plan/peak'], rows))


if __name__ == '__main__':
    main()
