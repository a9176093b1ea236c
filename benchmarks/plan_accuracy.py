"""Does ``mmengine-deepspeed plan`` predict what training logs? Predicted against measured.

For three model families in several shapes (``plan_models.py``: the demo GPT, a CNN
with BatchNorm, a transformer with frozen parts; up to 203M parameters), fp32 and
bf16, ZeRO 0-3 on 2 ranks: ``plan CONFIG --nproc 2 --json`` in a fresh process
(its row for the stage, no offload) against the largest ``train/peak_mem_mb`` the
training log reports for the same config (10 iterations: ZeRO-3's RSS creeps for several,
``plan_accuracy_worker.py``). Beside them, what the other tools would say for the
same model: Accelerate's ``estimate-memory`` ("Training using Adam" for float32: 4x
the fp32 weights, for one process, without activations) and DeepSpeed's
``estimate_zero2/3_model_states_mem_needs`` (model states only, 16-bit parameters
assumed; none for ZeRO-0/1).

The CPU heap coefficients of ``plan/memory.py`` are fitted to
``plan_models.FITTED`` (``--fit`` prints them); ``plan_models.HELD_OUT`` takes no
part in the fit, and its error is reported on its own line. Training is the slow half: each
measured peak is kept in ``--measured`` (JSON, by case) and a case is trained only
when it has none there (``--remeasure``: all again), so that a change to the
planner is checked against the same measurements by planning again only
(``--replan``: no training at all).

    python benchmarks/plan_accuracy.py [--cases fitted,held_out] [--precisions fp32,bf16]
                                       [--stages 0,1,2,3] [--replan | --remeasure]
                                       [--fit] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from os import path as osp
from typing import Any, Optional

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import (
    REPO_ROOT,
    deepspeed_estimate_mib,
    device_name,
    device_ranks,
    table,
    torchrun,
)
from benchmarks.plan_models import FITTED, HELD_OUT, config_text
from mmengine_deepspeed.plan.memory import CPU_RUNTIME_MIB, cpu_heap_kept

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'plan_accuracy_worker.py')
MIB = 2**20
MEASURED = osp.join(osp.dirname(osp.abspath(__file__)), 'plan_accuracy_measured.json')


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
             nproc: int, measured: dict[str, float], mode: str) -> list[dict[str, Any]]:
    """Plan once, train once per stage (unless ``measured`` has it); one result per stage.

    ``mode``: ``'measure'`` trains what ``measured`` lacks, ``'remeasure'`` every case,
    ``'replan'`` none (cases without a measurement are left out).
    """
    results = []
    plan = None
    for stage in stages:
        key = f'{family}/{size}/{precision}/{stage}/{nproc}'
        if mode == 'replan' and key not in measured:
            continue
        config = osp.join(work, f'{family}_{size}_{precision}_{stage}.py')
        with open(config, 'w') as f:
            f.write(config_text(family, size, stage, precision))
        if plan is None:
            plan = plan_json(config, nproc)
        row = next(r for r in plan['rows'] if r['stage'] == stage
                   and r['offload_optimizer'] == 'none' and r['offload_param'] == 'none')
        if key not in measured or mode == 'remeasure':
            measured[key] = torchrun(WORKER, [config, osp.join(work, 'run')], nproc=nproc,
                                     timeout=1800)[0]['peak_mem_mb']
        params, largest = model_sizes(config)
        results.append(dict(family=family, size=size, precision=precision, stage=stage,
                            params=params, act_mib=plan['activations']['mib'],
                            plan_mib=row['peak_mib'], measured_mib=measured[key],
                            ratio=row['peak_mib'] / measured[key],
                            accelerate_mib=4 * 4 * params / MIB,
                            deepspeed_mib=deepspeed_estimate_mib(stage, params, largest, nproc)))
        print(json.dumps(results[-1]), flush=True)
    return results


def summary(name: str, results: list[dict[str, Any]]) -> str:
    """One line: the ratios' range and how many are within the target band."""
    ratios = [r['ratio'] for r in results]
    if not ratios:
        return f'{name}: no cases'
    within = sum(0.9 <= x <= 1.15 for x in ratios)
    return (f'{name}: plan/measured min/max {min(ratios):.3f} / {max(ratios):.3f}; within the '
            f'target (-10 % .. +15 %): {within} of {len(ratios)}; more than 10 % under: '
            f'{sum(x < 0.9 for x in ratios)}')


def fit(results: list[dict[str, Any]], stage: int, floor: float = 0.95) -> tuple[float, ...]:
    """The CPU heap's coefficients for ``stage`` (``plan/memory.py``): (MiB of runtime,
    kept per byte of the fp32 model, kept per byte of activations) that make the worst
    prediction over ``results`` closest to its measured peak (the largest ``|ln(plan /
    measured)|`` the smallest), with none more than ``1 - floor`` under: the target band
    is -10 % .. +15 %, so over- and under-prediction count alike, and the floor keeps a
    margin for the run-to-run and machine-to-machine spread of small runs' RSS."""
    cases = []
    for r in results:
        if r['stage'] != stage:
            continue
        model, acts = 4 * r['params'], r['act_mib'] * MIB
        now = (cpu_heap_kept(stage, model, acts) / MIB + CPU_RUNTIME_MIB[stage])
        cases.append((r['plan_mib'] - now, model / MIB, r['act_mib'], r['measured_mib']))
    best: Optional[tuple[float, ...]] = None
    for runtime in range(0, 301, 10):
        for a in (x / 20 for x in range(0, 101)):
            for b in (x / 20 for x in range(0, 61)):
                ratios = [(base + runtime + a * m + b * act) / peak
                          for base, m, act, peak in cases]
                if not ratios or min(ratios) < floor:
                    continue
                worst = max(abs(math.log(ratio)) for ratio in ratios)
                if best is None or worst < best[0]:
                    best = (worst, runtime, a, b)
    if best is None:
        raise ValueError(f'no coefficients within the grid keep ZeRO-{stage} above {floor}')
    return best[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--cases', default='fitted,held_out')
    parser.add_argument('--precisions', default='fp32,bf16')
    parser.add_argument('--stages', default='0,1,2,3')
    parser.add_argument('--measured', default=MEASURED, help='JSON of measured peaks by case')
    parser.add_argument('--replan', action='store_true',
                        help='plan again against the cached peaks only (no training)')
    parser.add_argument('--remeasure', action='store_true',
                        help='train every case again, cached or not')
    parser.add_argument('--smoke', action='store_true', help='one small model, ZeRO-0 and 3')
    parser.add_argument('--fit', action='store_true',
                        help='print the CPU heap coefficients fitted to the "fitted" cases')
    args = parser.parse_args()
    sets = dict(fitted=FITTED, held_out=HELD_OUT)
    cases = {name: sets[name] for name in args.cases.split(',')}
    precisions, stages = args.precisions.split(','), [int(s) for s in args.stages.split(',')]
    if args.smoke:
        cases, precisions, stages = dict(fitted=[('gpt', 'small')]), ['fp32'], [0, 3]
    measured: dict[str, float] = {}
    if osp.exists(args.measured) and not args.smoke:  # the smoke run trains, end to end
        with open(args.measured) as f:
            measured = json.load(f)
    mode = 'replan' if args.replan else 'remeasure' if args.remeasure else 'measure'
    nproc = device_ranks()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as work:
        for name, pairs in cases.items():
            for family, size in pairs:
                for precision in precisions:
                    results[name] += run_case(family, size, precision, stages, work, nproc,
                                              measured, mode)
                    if not args.smoke:
                        with open(args.measured, 'w') as f:
                            json.dump(measured, f, indent=1, sort_keys=True)
    print(f'\n{device_name()}, {nproc} ranks; MiB per rank (the largest over ranks)\n')
    print(table(['set', 'family', 'size', 'params', 'precision', 'ZeRO', 'plan MiB',
                 'measured MiB', 'plan/measured', 'Accelerate MiB', 'DeepSpeed MiB'],
                [[name, r['family'], r['size'], f'{r["params"] / 1e6:.1f}M', r['precision'],
                  r['stage'], r['plan_mib'], r['measured_mib'], r['ratio'],
                  r['accelerate_mib'], r['deepspeed_mib'] if r['deepspeed_mib'] else '-']
                 for name, rows in results.items() for r in rows]))
    print()
    for name, rows in results.items():
        print(summary(name, rows))
    if args.fit:
        for stage in stages:
            runtime, a, b = fit(results['fitted'], stage)
            print(f'ZeRO-{stage}: CPU_RUNTIME_MIB {runtime}, CPU_HEAP_KEPT ({a}, {b})')


if __name__ == '__main__':
    main()
