"""Peak per-rank memory by ZeRO stage (and ZeRO-3 + CPU offload), 2 ranks, fp32 Adam.

Model states of fp32 Adam take 16 bytes per parameter (weights, gradients, two moments):
16Φ on every rank without ZeRO, 16Φ/N with ZeRO-3. Prints measured MiB, the ratio to
ZeRO-0 and the ratio to 16Φ/N.

    python benchmarks/memory.py [--width 1024 --depth 4] [--smoke]
"""
from __future__ import annotations

import argparse
import sys
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'memory_worker.py')
CASES = ((0, 0), (1, 0), (2, 0), (3, 0), (3, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--width', type=int, default=1024)
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    width, depth, cases = (args.width, args.depth, CASES)
    if args.smoke:
        width, depth, cases = 64, 1, ((0, 0), (3, 0))
    results = [torchrun(WORKER, [str(s), str(o), str(width), str(depth), str(args.steps)])[0]
               for s, o in cases]
    rows = []
    for r in results:
        theory = 16 * r['params'] / r['world'] / 2**20
        name = f'ZeRO-{r["stage"]}' + (' + CPU offload' if r['offload'] else '')
        rows.append([name, r['peak_mb'], r['peak_mb'] / results[0]['peak_mb'], r['steady_mb'],
                     r['steady_mb'] / results[0]['steady_mb'], theory, r['steady_mb'] / theory])
    params = results[0]['params']
    print(table(['stage', 'peak MiB', 'peak vs ZeRO-0', 'after steps MiB',
                 'after steps vs ZeRO-0', '16Φ/N MiB', 'after steps vs 16Φ/N'], rows))
    where = 'CUDA allocator peak' if results[0]['cuda'] else 'peak RSS minus RSS before the model'
    print(f'\nΦ = {params:,} parameters, 2 ranks, fp32 Adam, batch 1 x 64 tokens; {where}.')


if __name__ == '__main__':
    main()
