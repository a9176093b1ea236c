"""Training speed of DeepSpeedRunner against a hand-written DeepSpeed loop and MMEngine's
FlexibleRunner + DeepSpeedStrategy, on 2 ranks, ZeRO-2 and ZeRO-3.

Each measurement is its own torchrun launch; launches are interleaved (raw, runner,
strategy, raw, ...) so that machine noise spreads over all three. Speed is steady-state
iterations/s after the warm-up; "first iter" is seconds from process start to the end of
the first iteration. Prints a Markdown table of ratios.

    python benchmarks/overhead.py [--rounds 3] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import table, torchrun
from benchmarks.overhead_worker import STRATEGY_PATCHES

MODES = ('raw', 'runner', 'strategy')
WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'overhead_worker.py')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    models = ['tiny'] if args.smoke else ['gpt', 'tiny']
    iters = {'gpt': (10, 40), 'tiny': (20, 200)}
    if args.smoke:
        iters = {'tiny': (2, 3)}
    rounds = 1 if args.smoke else args.rounds
    speeds: dict[tuple, list[float]] = defaultdict(list)
    first: dict[tuple, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for stage in (2, 3):
                for model in models:
                    warmup, n = iters[model]
                    for mode in MODES:
                        (result,) = torchrun(WORKER, [mode, model, str(stage), str(warmup),
                                                      str(n), osp.join(tmp, mode)])
                        speeds[(model, stage, mode)].append(result['it_per_s'])
                        first[(model, stage, mode)].append(result['first_iter_s'])
    rows = []
    for model in models:
        for stage in (2, 3):
            key = (model, stage)
            raw, ours, strat = (speeds[(*key, m)] for m in MODES)
            vs_raw = [o / r for o, r in zip(ours, raw)]
            vs_strat = [o / s for o, s in zip(ours, strat)]
            rows.append([model, f'ZeRO-{stage}', statistics.median(raw), statistics.median(ours),
                         statistics.median(strat),
                         f'{min(vs_raw):.3f} / {statistics.median(vs_raw):.3f} / '
                         f'{max(vs_raw):.3f}',
                         f'{min(vs_strat):.3f} / {statistics.median(vs_strat):.3f} / '
                         f'{max(vs_strat):.3f}',
                         f'{statistics.median(first[(*key, "raw")]):.1f} / '
                         f'{statistics.median(first[(*key, "runner")]):.1f} / '
                         f'{statistics.median(first[(*key, "strategy")]):.1f}'])
    print(table(['model', 'stage', 'raw it/s', 'runner it/s', 'strategy it/s',
                 'runner/raw min/med/max', 'runner/strategy min/med/max',
                 'first iter s raw/runner/strategy'], rows))
    print(f'\n{rounds} round(s), 2 ranks, bf16, AdamW. Patches applied to the strategy run only:')
    for patch in STRATEGY_PATCHES:
        print(f'- {patch}')


if __name__ == '__main__':
    main()
