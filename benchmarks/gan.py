"""GAN training speed: DeepSpeedRunner (one engine per optimizer) against a hand-written
two-engine DeepSpeed loop on the same model, ZeRO-2 and ZeRO-3, fp32, Adam.

Each measurement is its own torchrun launch; raw and runner launches alternate so that
machine noise spreads over both. Speed is steady-state iterations/s after the warm-up (one
iteration = a discriminator step and a generator step).

With --profile, one more launch per mode and stage runs rank 0's measured iterations under
cProfile and prints each package's own time per iteration.

    python benchmarks/gan.py [--rounds 5] [--profile] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import device_ranks, spread, table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'gan_worker.py')
MODES = ('raw', 'runner')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--profile', action='store_true', help='also profile each mode')
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    rounds, stages, iters = args.rounds, (2, 3), (10, 60)
    if args.smoke:
        rounds, stages, iters = 1, (2,), (2, 3)
    speeds: dict[tuple[int, str], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for stage in stages:
                for mode in MODES:
                    (result,) = torchrun(WORKER, [mode, str(stage), *map(str, iters),
                                                  osp.join(tmp, mode)], nproc=device_ranks())
                    speeds[(stage, mode)].append(result['it_per_s'])
        profiles = {(stage, mode): torchrun(WORKER, [mode, str(stage), *map(str, iters),
                                                     osp.join(tmp, mode), '--profile'],
                                            nproc=device_ranks())[0]['profile_ms']
                    for stage in stages for mode in MODES} if args.profile else {}
    rows = [[f'ZeRO-{stage}', statistics.median(speeds[(stage, 'raw')]),
             statistics.median(speeds[(stage, 'runner')]),
             spread([o / r for o, r in zip(speeds[(stage, 'runner')], speeds[(stage, 'raw')])])]
            for stage in stages]
    print(table(['stage', 'raw it/s', 'runner it/s', 'runner/raw min/med/max'], rows))
    print(f'\n{rounds} round(s), {device_ranks()} rank(s), fp32, Adam, batch 32 per rank; '
          'one iteration = a discriminator and a generator step.')
    if profiles:
        packages = sorted({p for prof in profiles.values() for p in prof},
                          key=lambda p: -profiles[(stages[0], 'runner')].get(p, 0.0))
        print('\n' + table(
            ['own time, ms per iteration (rank 0, cProfile)',
             *(f'{mode} ZeRO-{stage}' for stage in stages for mode in MODES)],
            [[p, *(profiles[(stage, mode)].get(p, 0.0) for stage in stages for mode in MODES)]
             for p in packages]))


if __name__ == '__main__':
    main()
