"""Does ``mmengine-deepspeed plan`` predict what training logs? Predicted against measured.

For three model families at two sizes (``plan_models.py``: the demo GPT, a CNN with
BatchNorm, a transformer with frozen parts; the larger over 50M parameters), fp32
and bf16, ZeRO 0-3 on 2 ranks: ``plan CONFIG --nproc 2 --json`` in a fresh process
(its row for the stage, no offload) against the largest ``train/peak_mem_mb`` the
training log reports for the same config (10 iterations: ZeRO-3's RSS creeps for several,
``plan_accuracy_worker.py``). Beside them, what the other tools would say for the
same model: Accelerate's ``estimate-memory`` ("Training using Adam" for float32: 4x
the fp32 weights, for one process, without activations) and DeepSpeed's
``estimate_zero2/3_model_states_mem_needs`` (model states only, 16-bit parameters
assumed; none for ZeRO-0/1).

    python benchmarks/plan_accuracy.py [--families gpt,cnn,frozen] [--sizes small,large]
                                       [--precisions fp32,bf16] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from os import path as osp
from typing import Any

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import (
    REPO_ROOT,
    deepspeed_estimate_mib,
    device_name,
    device_ranks,
    table,
    torchrun,
)
from benchmarks.plan_models import FAMILIES, config_text

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'plan_accuracy_worker.py')
MIB = 2**20


def plan_json(config: str, nproc: int) -> dict[str, Any]:
    """``mmengine-deepspeed plan CONFIG --nproc N --json`` in a fresh process."""
    proc = subprocess.run([sys.executable, '-m', 'mmengine_deepspeed', 'plan', config,
                           '--nproc', str(nproc), '--json'], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(__import__('os').environ,
                                                           PYTHONPATH=REPO_ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f'plan {config} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}')
    return json.loads(proc.stdout)


def model_sizes(config: str) -> tuple[int, int]:
    """(parameters, largest layer) of a config's model, on the meta device."""
    import torch
    from mmengine.config import Config
    from mmengine.registry import MODELS, init_default_scope
    init_default_scope('mmengine')
    with torch.device('meta'):
        model = MODELS.build(Config.fromfile(config).model)
    return (sum(p.numel() for p in model.parameters()),
            max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()))


def run_case(family: str, size: str, precision: str, stages: list[int], work: str,
             nproc: int) -> list[dict[str, Any]]:
    """Plan once, train once per stage; one result per stage."""
    results = []
    plan = None
    for stage in stages:
        config = osp.join(work, f'{family}_{size}_{precision}_{stage}.py')
        with open(config, 'w') as f:
            f.write(config_text(family, size, stage, precision))
        if plan is None:
            plan = plan_json(config, nproc)
        row = next(r for r in plan['rows'] if r['stage'] == stage
                   and r['offload_optimizer'] == 'none' and r['offload_param'] == 'none')
        measured = torchrun(WORKER, [config, osp.join(work, 'run')], nproc=nproc,
                            timeout=1800)[0]['peak_mem_mb']
        params, largest = model_sizes(config)
        results.append(dict(family=family, size=size, precision=precision, stage=stage,
                            params=params, plan_mib=row['peak_mib'], measured_mib=measured,
                            ratio=row['peak_mib'] / measured,
                            accelerate_mib=4 * 4 * params / MIB,
                            deepspeed_mib=deepspeed_estimate_mib(stage, params, largest, nproc)))
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--families', default=','.join(FAMILIES))
    parser.add_argument('--sizes', default='small,large')
    parser.add_argument('--precisions', default='fp32,bf16')
    parser.add_argument('--stages', default='0,1,2,3')
    parser.add_argument('--smoke', action='store_true', help='one small model, ZeRO-0 and 3')
    args = parser.parse_args()
    families, sizes = args.families.split(','), args.sizes.split(',')
    precisions, stages = args.precisions.split(','), [int(s) for s in args.stages.split(',')]
    if args.smoke:
        families, sizes, precisions, stages = ['gpt'], ['small'], ['fp32'], [0, 3]
    nproc = device_ranks()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for size in sizes:
            for family in families:
                for precision in precisions:
                    results += run_case(family, size, precision, stages, work, nproc)
    print(f'\n{device_name()}, {nproc} ranks; MiB per rank (the largest over ranks)\n')
    print(table(['family', 'size', 'params', 'precision', 'ZeRO', 'plan MiB', 'measured MiB',
                 'plan/measured', 'Accelerate MiB', 'DeepSpeed MiB'],
                [[r['family'], r['size'], f'{r["params"] / 1e6:.1f}M', r['precision'],
                  r['stage'], r['plan_mib'], r['measured_mib'], r['ratio'],
                  r['accelerate_mib'], r['deepspeed_mib'] if r['deepspeed_mib'] else '-']
                 for r in results]))
    ratios = [r['ratio'] for r in results]
    within = sum(0.9 <= x <= 1.15 for x in ratios)
    print(f'\nplan/measured min/max: {min(ratios):.3f} / {max(ratios):.3f}; within the target '
          f'(-10 % .. +15 %): {within} of {len(ratios)}')


if __name__ == '__main__':
    main()
