"""A config's layout on fewer ranks (``layout=dict(world_size=N)``) against plain gradient
accumulation with the same micro-batch, samples and optimizer steps: what the virtual ranks
cost (each micro-step under its own random streams and buffers, one iteration for all).

A small BatchNorm + dropout MLP (host-bound on the CPU, where the switches weigh most), k
virtual ranks per rank against ``accumulative_counts=k``; each measurement its own torchrun
launch, the two modes alternating. The ratio is accumulation's time per optimizer step over
the layout's: >= 0.98 means the layout costs at most 2 %.

    python benchmarks/layout.py [--rounds 5] [--smoke]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import device_name, device_ranks, spread, table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'layout_worker.py')
MODES = ('accumulation', 'layout')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    rounds, counts, steps = args.rounds, (2, 4), 40
    if args.smoke:
        rounds, counts, steps = 1, (2,), 5
    ms: dict[tuple[int, str], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for k in counts:
                for mode in MODES:
                    (result,) = torchrun(WORKER, [mode, str(k), str(steps),
                                                  osp.join(tmp, f'{mode}{k}')],
                                         nproc=device_ranks())
                    ms[(k, mode)].append(result['ms_per_step'])
    rows = []
    for k in counts:
        ratios = [a / b for a, b in zip(ms[(k, 'accumulation')], ms[(k, 'layout')])]
        rows.append([k, device_ranks(), f'{min(ms[(k, "accumulation")]):.1f}',
                     f'{min(ms[(k, "layout")]):.1f}', spread(ratios)])
    print(f'{device_name()}, {device_ranks()} rank(s), {rounds} round(s)')
    print(table(['virtual ranks per rank', 'ranks', 'accumulation ms/step (min)',
                 'layout ms/step (min)', 'accumulation/layout min/med/max'], rows))


if __name__ == '__main__':
    main()
