"""Memory against model size: how large a model trains on N ranks, and what zero.Init buys.

For a TinyGPT family (width x depth), per rank (the maximum over ranks), built and trained
by DeepSpeedRunner with fp32 AdamW: the peak while the model is constructed, the peak through
building the engine and training, and what is held in steady training (RSS on CPU,
the allocator on CUDA; see scale_worker.py) for ZeRO-0, ZeRO-3, ZeRO-3 + zero.Init and
ZeRO-3 + zero.Init + CPU offload of optimizer and parameters, and ZeRO-3 + zero.Init with
DeepSpeed's own buffer and limit defaults (``zero3_init_ds_sizes``) where the others have the
runner's, sized to the model. Next to them:
the theory for fp32 Adam's model states, 16 bytes per parameter (16Φ per rank for ZeRO-0,
16Φ/N for ZeRO-3), and DeepSpeed's own ZeRO-3 estimate
(``estimate_zero3_model_states_mem_needs``, what ``..._all_live`` prints, which assumes
16-bit parameters). A run that dies (out of memory) is reported as such. The largest size
whose training peak stays within ``--budget-gib`` per rank is named for each case, and a PNG
plots memory against parameters.

    python benchmarks/scale.py [--sizes 512x16,768x16,1024x16,1280x20] [--budget-gib 8]
                               [--plot benchmarks/scale.png] [--cold] [--smoke]
"""
from __future__ import annotations

import argparse
import sys
from os import path as osp
from typing import Any, Optional

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import deepspeed_estimate_mib, device_ranks, table, torchrun
from benchmarks.scale_worker import CASES

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'scale_worker.py')
MIB = 2**20


def deepspeed_estimate_mb(case: str, params: int, largest: int, world: int) -> Optional[float]:
    """DeepSpeed's ZeRO-3 estimate for one rank (device + its share of the host), MiB."""
    stage, zero_init, offload = CASES[case]
    return deepspeed_estimate_mib(stage, params, largest, world, zero_init=zero_init,
                                  offload=offload)


def theory_mb(case: str, params: int, world: int) -> float:
    """fp32 Adam's model states, 16 bytes per parameter, on one rank."""
    return 16 * params / (world if CASES[case][0] == 3 else 1) / MIB


def measure(sizes: list[tuple[int, int]], cases: list[str], steps: int,
            cold: bool = False) -> list[dict]:
    results: list[dict[str, Any]] = []
    for width, depth in sizes:
        for case in cases:
            try:
                result = torchrun(WORKER, [case, str(width), str(depth), str(steps),
                                           *(['--cold'] if cold else [])],
                                  nproc=device_ranks(), timeout=3600)[0]
            except RuntimeError as e:  # killed (out of memory) or failed
                print(f'{case} {width}x{depth}: did not finish ({str(e).splitlines()[0]})',
                      flush=True)
                results.append(dict(case=case, width=width, depth=depth, failed=True))
                continue
            print(f'{case} {width}x{depth}: {result}', flush=True)
            results.append(result)
    return results


def largest_within(results: list[dict], case: str, budget_mb: float) -> str:
    fitting = [r for r in results if r['case'] == case and not r.get('failed')
               and r['train_mb'] <= budget_mb]
    if not fitting:
        return 'none measured'
    best = max(fitting, key=lambda r: r['params'])
    return f'{best["params"] / 1e6:.0f}M ({best["width"]}x{best["depth"]})'


def plot(results: list[dict], path: str, budget_mb: float) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in CASES:
        done = sorted((r for r in results if r['case'] == case and not r.get('failed')),
                      key=lambda r: r['params'])
        if done:
            ax.plot([r['params'] / 1e6 for r in done], [r['train_mb'] / 1024 for r in done],
                    marker='o', label=f'{case} (training peak)')
            ax.plot([r['params'] / 1e6 for r in done],
                    [r['construct_mb'] / 1024 for r in done], marker='x', linestyle=':',
                    label=f'{case} (construction)')
    ax.axhline(budget_mb / 1024, color='grey', linestyle='--', label='budget per rank')
    ax.set_xlabel('parameters (millions)')
    ax.set_ylabel('GiB per rank')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--sizes', default='512x16,768x16,1024x16,1280x20',
                        help='comma-separated WIDTHxDEPTH')
    parser.add_argument('--cases', default=','.join(CASES))
    parser.add_argument('--steps', type=int, default=2)
    parser.add_argument('--budget-gib', type=float, default=8.0)
    parser.add_argument('--plot', default=osp.join(osp.dirname(osp.abspath(__file__)),
                                                   'scale.png'))
    parser.add_argument('--cold', action='store_true',
                        help="no warm-up runner: each figure is a fresh process's first runner")
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split('x')) for s in args.sizes.split(',')]
    cases, steps, budget_mb = args.cases.split(','), args.steps, args.budget_gib * 1024
    if args.smoke:
        sizes, cases, steps = [(64, 2)], ['zero0', 'zero3_init'], 1
    results = measure(sizes, cases, steps, cold=args.cold)  # type: ignore[arg-type]
    rows = []
    for r in results:
        if r.get('failed'):
            rows.append([r['case'], f'{r["width"]}x{r["depth"]}', '-', 'died', '-', '-', '-', '-'])
            continue
        estimate = deepspeed_estimate_mb(r['case'], r['params'], r['largest_layer'], r['world'])
        rows.append([r['case'], f'{r["width"]}x{r["depth"]}', f'{r["params"] / 1e6:.1f}M',
                     r['construct_mb'], r['train_mb'], r['steady_mb'],
                     theory_mb(r['case'], r['params'], r['world']),
                     '-' if estimate is None else estimate])
    print(table(['case', 'size', 'params', 'construction MiB', 'training peak MiB',
                 'steady MiB', '16Φ(/N) MiB', 'DeepSpeed estimate MiB'], rows))
    print(f'\nLargest measured size whose training peak fits {args.budget_gib:g} GiB per rank '
          f'on {device_ranks()} ranks:')
    for case in cases:
        print(f'- {case}: {largest_within(results, case, budget_mb)}')
    if not args.smoke:
        plot(results, args.plot, budget_mb)
        print(f'\nplot: {args.plot}')


if __name__ == '__main__':
    main()
