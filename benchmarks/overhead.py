"""Training speed of DeepSpeedRunner against a hand-written DeepSpeed loop and MMEngine's
FlexibleRunner + DeepSpeedStrategy, ZeRO-2 and ZeRO-3, bf16 (the "mlp" model fp32), AdamW.

Each measurement is its own torchrun launch; launches are interleaved (raw, runner,
strategy, raw, ...) so that machine noise spreads over all three. Speed is steady-state
iterations/s after the warm-up; "first iter" is seconds from process start to the end of
the first iteration. Prints a Markdown table of ratios, with tokens/s and model-FLOPs
utilisation (MFU) of the runner.

On CPU: 2 ranks on gloo, models "gpt" and "tiny". On CUDA: one rank per GPU (up to 2) on
NCCL, and the ~125M-parameter "gpt125m" as well; MFU uses the GPU's bf16 peak (a table of
known GPUs, or --peak-tflops).

With --profile, one more launch per mode runs the measured iterations of rank 0 under
cProfile (the tiny model at ZeRO-2, or --profile-case) and prints where each iteration's
time goes, by package. --models picks the models (mlp: ~4.5M parameters in fp32).

With --host-bound, the runner and the raw loop train two host-bound models (TinyGPT of
width 32, 12 and 24 blocks, 2 samples of 16 tokens) at ZeRO 0-3 while py-spy samples rank 0,
on a core of its own (a sampler: cProfile's per-call cost would swamp small Python
functions), and a table splits
the training thread's CPU time per iteration between MMEngine's loop, this package,
DeepSpeed, torch and the model by the innermost Python frame (a frame's release charged to
the function released, see ``overhead_worker.spy_ms``): what this package adds per
iteration, whatever the depth. Needs py-spy (in the dev extra). --host-rounds N launches
each cell N times, interleaved, and shows medians (one cell moves by up to 0.1 ms between
launches: caches, the other rank).

With --compiled, each round also trains the runner with MMEngine's compile=True (each
engine's module through DeepSpeed's engine.compile(), inductor), and a third table puts its
speed and its first iteration (compilation included) next to the eager runner's.

With --unused, each round also trains the runner with find_unused_parameters=True
(ZeRO-2), and a second table puts its speed next to the default runner's, whose
per-iteration check that every rank used the same parameters is timed on its own.

    python benchmarks/overhead.py [--rounds 3] [--models gpt,mlp,tiny] [--profile]
                                  [--profile-case MODEL:STAGE] [--unused] [--compiled]
                                  [--host-bound [--host-rounds N]] [--peak-tflops T]
                                  [--smoke]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from os import path as osp
from typing import Any, Optional

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch

from benchmarks.common import device_ranks, peak_tflops, spread, table, torchrun
from benchmarks.overhead_worker import STRATEGY_PATCHES

MODES = ('raw', 'runner', 'strategy')
WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'overhead_worker.py')
# warm-up, measured
ITERS = {'gpt125m': (5, 30), 'gpt': (10, 80), 'mlp': (10, 60), 'tiny': (20, 200),
         'deep12': (10, 200), 'deep24': (10, 200)}
HOST_BOUND = ('deep12', 'deep24')
# The host-bound table's columns: own time of these profile rows, runner and raw loop.
HOST_ROWS = ('mmengine', 'mmengine_deepspeed', 'deepspeed', 'torch (Python)', 'model')
SMOKE_ITERS = (2, 3)


def mfu(result: dict, peak: Optional[float]) -> Any:
    """Model FLOPs per second over the ranks' peak, or "n/a" without a known peak."""
    if peak is None:
        return 'n/a'
    achieved = result['tokens_per_s'] * result['flops_per_token']
    return f'{achieved / (peak * 1e12 * result["world"]):.1%}'


def run(mode: str, model: str, stage: int, iters: tuple[int, int], work_dir: str,
        profile: bool = False, spy: bool = False) -> dict:
    args = [mode, model, str(stage), *map(str, iters), osp.join(work_dir, mode)]
    args += (['--profile'] if profile else [])
    args += (['--spy', osp.join(work_dir, f'{mode}.spy')] if spy else [])
    (result,) = torchrun(WORKER, args, nproc=device_ranks())
    return result


def medians(runs: dict[str, list[dict]], key: str) -> dict[str, float]:
    """The median of ``key`` over the rounds, per mode."""
    return {m: statistics.median(r[key] for r in runs[m]) for m in MODES}


def speed_table(models: list[str], stages: tuple[int, ...], results: dict[tuple, list[dict]],
                peak: Optional[float]) -> str:
    rows = []
    for model in models:
        for stage in stages:
            runs = {m: results[(model, stage, m)] for m in MODES}
            speed = {m: [r['it_per_s'] for r in runs[m]] for m in MODES}
            median, cpu = medians(runs, 'it_per_s'), medians(runs, 'cpu_ms_per_iter')
            first = medians(runs, 'first_iter_s')
            best = max(runs['runner'], key=lambda r: r['it_per_s'])
            rows.append([
                model, f'ZeRO-{stage}', median['raw'], median['runner'], median['strategy'],
                spread([o / r for o, r in zip(speed['runner'], speed['raw'])]),
                spread([o / s for o, s in zip(speed['runner'], speed['strategy'])]),
                f'{medians(runs, "tokens_per_s")["runner"]:,.0f}', mfu(best, peak),
                ' / '.join(f'{cpu[m]:.1f}' for m in MODES),
                ' / '.join(f'{first[m]:.1f}' for m in MODES)])
    return table(['model', 'stage', 'raw it/s', 'runner it/s', 'strategy it/s',
                  'runner/raw min/med/max', 'runner/strategy min/med/max', 'runner tokens/s',
                  'runner MFU', 'CPU ms/iter raw/runner/strategy',
                  'first iter s raw/runner/strategy'], rows)


def unused_table(models: list[str], results: dict[tuple, list[dict]]) -> str:
    rows = []
    for model in models:
        default, unused = results[(model, 2, 'runner')], results[(model, 2, 'runner_find_unused')]
        speed = statistics.median(r['it_per_s'] for r in default)
        check = statistics.median(r['check_ms'] for r in default)
        rows.append([model, speed, check, f'{check * speed / 10:.2f} %',
                     statistics.median(r['it_per_s'] for r in unused),
                     spread([u['it_per_s'] / d['it_per_s'] for u, d in zip(unused, default)])])
    return table(['model (ZeRO-2)', 'runner it/s', 'check ms/iter', 'check share',
                  'find_unused it/s', 'find_unused/runner min/med/max'], rows)


def compiled_table(models: list[str], stages: tuple[int, ...],
                   results: dict[tuple, list[dict]]) -> str:
    rows = []
    for model in models:
        for stage in stages:
            eager, compiled = (results[(model, stage, m)] for m in ('runner', 'runner_compiled'))
            rows.append([model, f'ZeRO-{stage}',
                         *(statistics.median(r['it_per_s'] for r in runs)
                           for runs in (eager, compiled)),
                         spread([c['it_per_s'] / e['it_per_s'] for c, e in zip(compiled, eager)]),
                         *(statistics.median(r['first_iter_s'] for r in runs)
                           for runs in (eager, compiled))])
    return table(['model', 'stage', 'eager it/s', 'compiled it/s', 'compiled/eager min/med/max',
                  'first iter s eager', 'first iter s compiled'], rows)


def profile_table(profiles: dict[str, dict[str, float]]) -> str:
    packages = sorted({p for prof in profiles.values() for p in prof},
                      key=lambda p: -profiles['runner'].get(p, 0.0))
    rows = [[p, *(profiles[m].get(p, 0.0) for m in MODES)] for p in packages]
    rows.append(['total', *(sum(profiles[m].values()) for m in MODES)])
    return table(['own time, ms per iteration (rank 0, cProfile)', *MODES], rows)


def host_bound_table(profiles: dict[tuple[str, int, str], list[dict[str, float]]]) -> str:
    """Per model and stage, each package's own time per iteration, runner / raw loop: the
    median over the launches (rounds), and this package's range over them."""
    def median(key: tuple[str, int, str], row: Optional[str] = None) -> float:
        return statistics.median(sum(p.values()) if row is None else p.get(row, 0.0)
                                 for p in profiles[key])

    rows = []
    for model, stage in sorted({(m, s) for m, s, _ in profiles}):
        runner, raw = (model, stage, 'runner'), (model, stage, 'raw')
        ours = [p.get('mmengine_deepspeed', 0.0) for p in profiles[runner]]
        rows.append([model, f'ZeRO-{stage}',
                     *(f'{median(runner, row):.3f} / {median(raw, row):.3f}'
                       for row in HOST_ROWS),
                     f'{min(ours):.3f}-{max(ours):.3f}',
                     f'{median(runner):.2f} / {median(raw):.2f}'])
    return table(['model', 'stage', 'MMEngine loop', 'this package', 'DeepSpeed',
                  'torch', 'the model', 'this package, range', 'iteration'], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--profile', action='store_true',
                        help='also profile the tiny model, ZeRO-2, one launch per mode')
    parser.add_argument('--peak-tflops', type=float,
                        help='bf16 peak per device for MFU (default: known GPUs only)')
    parser.add_argument('--unused', action='store_true',
                        help='also measure find_unused_parameters=True (ZeRO-2)')
    parser.add_argument('--compiled', action='store_true',
                        help="also measure the runner with MMEngine's compile=True")
    parser.add_argument('--models', help='comma-separated, from gpt, mlp (fp32), tiny '
                        '(default: gpt,tiny, and gpt125m on CUDA)')
    parser.add_argument('--profile-case', default='tiny:2', metavar='MODEL:STAGE',
                        help='what --profile profiles (default: tiny:2)')
    parser.add_argument('--host-bound', action='store_true',
                        help='also split the host time of host-bound models, ZeRO 0-3')
    parser.add_argument('--host-rounds', type=int, default=1,
                        help='launches per host-bound cell, interleaved (the table shows '
                        'medians; default 1)')
    parser.add_argument('--json', metavar='FILE', help='also write every launch\'s result here')
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    models = args.models.split(',') if args.models else \
        (['gpt125m'] if cuda else []) + ['gpt', 'tiny']
    iters = dict(ITERS)
    rounds, stages = args.rounds, (2, 3)
    if args.smoke:
        models, iters, rounds, stages = ['tiny'], {'tiny': SMOKE_ITERS}, 1, (2,)
    peak = args.peak_tflops
    if peak is None and cuda:
        peak = peak_tflops(torch.cuda.get_device_name())
    results: dict[tuple, list[dict]] = defaultdict(list)
    profiles: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for stage in stages:
                for model in models:
                    for mode in MODES:
                        results[(model, stage, mode)].append(
                            run(mode, model, stage, iters[model], tmp))
                    if args.unused and stage == 2:
                        results[(model, stage, 'runner_find_unused')].append(
                            run('runner_find_unused', model, stage, iters[model], tmp))
                    if args.compiled:
                        results[(model, stage, 'runner_compiled')].append(
                            run('runner_compiled', model, stage, iters[model], tmp))
        if args.profile:
            name, stage_text = args.profile_case.split(':')
            for mode in MODES:
                profiles[mode] = run(mode, name, int(stage_text), iters.get(name, ITERS[name]),
                                     tmp, profile=True)['profile_ms']
        host_bound: dict[tuple[str, int, str], list[dict[str, float]]] = defaultdict(list)
        host_models, host_stages = (HOST_BOUND[:1], (2,)) if args.smoke else (HOST_BOUND,
                                                                              (0, 1, 2, 3))
        for _ in range(args.host_rounds if args.host_bound else 0):
            for model in host_models:
                for stage in host_stages:
                    for mode in ('raw', 'runner'):
                        host_bound[(model, stage, mode)].append(run(
                            mode, model, stage, (2, 20) if args.smoke else ITERS[model], tmp,
                            spy=True)['profile_ms'])
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as f:
            json.dump(dict(speed=[dict(r) for runs in results.values() for r in runs],
                           profile=profiles,
                           host_bound={' '.join(map(str, key)): value
                                       for key, value in host_bound.items()}), f, indent=1)
    if results:
        first = results[(models[0], stages[0], 'raw')][0]
        print(speed_table(models, stages, results, peak))
        against = (f'MFU of the runner\'s fastest round against {peak} TFLOP/s per device' if peak
                   else 'MFU n/a: no bf16 peak known for this device (--peak-tflops sets one)')
        print(f'\n{rounds} round(s), {first["world"]} rank(s) on {first["device"]}, '
              'bf16 (mlp: fp32), AdamW; '
              f'{against}. Patches applied to the strategy run only:')
        for patch in STRATEGY_PATCHES:
            print(f'- {patch}')
    if args.unused:
        print('\n' + unused_table(models, results))
        print('\ncheck: the default runner\'s per-iteration test that all ranks used the same '
              'parameters (a walk of the autograd graph; one all-reduce in the first iteration '
              'only); find_unused: gradients through one node so skipped parameters get zeros.')
    if args.compiled:
        print('\n' + compiled_table(models, stages, results))
        print("\ncompiled: MMEngine's compile=True, applied by DeepSpeedRunner to each engine's "
              'module (engine.compile(), inductor); its first iteration includes compilation.')
    if host_bound:
        print('\n' + host_bound_table(host_bound))
        print("\nCPU ms per iteration of rank 0's training thread, runner / raw loop, shared "
              "out by the package of the innermost Python frame in py-spy's samples of that "
              'thread (1000 per second, measured iterations only, idle samples left out; C '
              "and C++ code is booked to the Python code that called it, so torch's row holds "
              "the kernels; a returning frame's release to that frame's function). Waits in "
              'collectives are not CPU time: "iteration" is the CPU part of an iteration.')
    if profiles:
        print('\n' + profile_table(profiles))
        print('\nOwn time: time in each package\'s functions themselves, callees excluded; '
              'cProfile slows Python code, so compare the columns, not with the table above.')


if __name__ == '__main__':
    main()
