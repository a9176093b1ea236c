"""A config's layout on fewer ranks (``layout=dict(world_size=N)``) against plain gradient
accumulation with the same micro-batch, samples and optimizer steps: what the virtual ranks
cost (each micro-step under its own random streams and buffers, one iteration for all).

A small BatchNorm + dropout MLP (host-bound on the CPU, where the switches weigh most), k
virtual ranks per rank against ``accumulative_counts=k``; each round one torchrun launch per k
that trains the two modes one after another in the same processes (accumulation, layout,
layout, accumulation: launch-to-launch differences of a shared machine, larger than the
effect, fall on both alike). The ratio is accumulation's time per optimizer step over
the layout's: >= 0.98 means the layout costs at most 2 %; the same ratio of rank 0's CPU time
per step (without the wait for the other rank and a shared machine's stolen time, the
steadier measure of the host's work). Beside it, what the switches of
virtual rank alone cost per optimizer step, timed in this process (the end-to-end ratio of
a few-millisecond step is within a shared machine's noise).

    python benchmarks/layout.py [--rounds 5] [--smoke]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import device_name, device_ranks, spread, table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'layout_worker.py')
MODES = ('accumulation', 'layout')
# a round's runs, in one process: ABBA, so that a drift over the round falls on both alike
ORDER = ('accumulation', 'layout', 'layout', 'accumulation')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    counts: tuple[int, ...] = (2, 4)
    rounds, steps = args.rounds, 300
    if args.smoke:
        rounds, counts, steps = 1, (2,), 5
    ms: dict[tuple[int, str], list[float]] = defaultdict(list)
    cpu_ms: dict[tuple[int, str], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            for k in counts:
                results = torchrun(WORKER, [','.join(ORDER), str(k), str(steps),
                                            osp.join(tmp, f'{round_}_{k}')],
                                   nproc=device_ranks())
                for mode in MODES:  # the round's mean of the mode's runs
                    mine = [r for r in results if r['mode'] == mode]
                    ms[(k, mode)].append(sum(r['ms_per_step'] for r in mine) / len(mine))
                    cpu_ms[(k, mode)].append(
                        sum(r['cpu_ms_per_step'] for r in mine) / len(mine))
    rows = []
    for k in counts:
        ratios = [a / b for a, b in zip(ms[(k, 'accumulation')], ms[(k, 'layout')])]
        cpu_ratios = [a / b for a, b in zip(cpu_ms[(k, 'accumulation')],
                                            cpu_ms[(k, 'layout')])]
        fastest = min(ms[(k, 'accumulation')])
        switches = switches_ms(k)
        rows.append([k, device_ranks(), f'{fastest:.1f}', f'{min(ms[(k, "layout")]):.1f}',
                     spread(ratios), f'{min(cpu_ms[(k, "accumulation")]):.1f}',
                     f'{min(cpu_ms[(k, "layout")]):.1f}', spread(cpu_ratios),
                     f'{switches:.2f} ({100 * switches / fastest:.1f} %)'])
    print(f'{device_name()}, {device_ranks()} rank(s), {rounds} round(s)')
    print(table(['virtual ranks per rank', 'ranks', 'accumulation ms/step (min)',
                 'layout ms/step (min)', 'accumulation/layout min/med/max',
                 'accumulation CPU ms/step (min)', 'layout CPU ms/step (min)',
                 'accumulation/layout CPU time min/med/max',
                 'switches ms/step (of accumulation\'s)'], rows))


def switches_ms(k: int, iterations: int = 2000) -> float:
    """What one iteration's switches of k virtual ranks cost on the benchmark's model, alone
    (a stable figure where the end-to-end ratio is within a noisy machine's spread)."""
    from benchmarks.layout_worker import LayoutBenchModel
    from mmengine_deepspeed.engine.virtual_ranks import VirtualRanks

    virtual = VirtualRanks(k, LayoutBenchModel())
    batches = list(range(k))
    start = time.perf_counter()
    for _ in range(iterations):
        virtual.run_in_turn(batches, lambda batch: None)
    return (time.perf_counter() - start) * 1e3 / iterations


if __name__ == '__main__':
    main()
