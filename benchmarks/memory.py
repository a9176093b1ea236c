"""Per-rank memory by ZeRO stage (and ZeRO-3 + CPU offload), fp32 Adam, raw DeepSpeed.

Model states of fp32 Adam take 16 bytes per parameter (weights, gradients, two moments):
16Φ on every rank without ZeRO, 16Φ/N with ZeRO-3. Prints, per stage, the peak and
steady memory (RSS on CPU, the allocator on CUDA), the live tensor bytes, each against
ZeRO-0 and against 16Φ/N. On CUDA it uses one rank per GPU, up to 2.

    python benchmarks/memory.py [--width 1024 --depth 4 --bucket 5000000] [--smoke]
"""
from __future__ import annotations

import argparse
import sys
from os import path as osp

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from benchmarks.common import device_ranks, table, torchrun

WORKER = osp.join(osp.dirname(osp.abspath(__file__)), 'memory_worker.py')
# (stage, CPU offload, ranks); None ranks: as many as the machine gives (2 on CPU).
# ZeRO-3 on one rank shows the 1/N scaling against ZeRO-3 on N.
CASES = ((0, 0, None), (1, 0, None), (2, 0, None), (3, 0, None), (3, 1, None), (3, 0, 1))


def expected_bytes(stage: int, params: int, world: int, bucket: int) -> float:
    """What DeepSpeed 0.19 keeps between steps with fp32 Adam, in bytes.

    Gradients are freed after each step except ZeRO-3's flat partition buffer;
    ZeRO-1/2/3 keep an fp32 master copy of their partition beside the weights
    (ZeRO-1/2 full weights, ZeRO-3 a partition); ZeRO-3 also allocates its
    whole reduce bucket.
    """
    if stage == 0:
        return 12.0 * params  # weights 4, Adam moments 8
    if stage in (1, 2):
        return 4.0 * params + 12.0 * params / world  # + partitioned master 4, moments 8
    return 20.0 * params / world + 4.0 * bucket  # weights, master, grads 4 each, moments 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--width', type=int, default=1024)
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--bucket', type=int, default=5_000_000,
                        help='reduce/allgather/prefetch bucket size in elements, all stages')
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    width, depth, cases = (args.width, args.depth, CASES)
    if args.smoke:
        width, depth, cases = 64, 1, ((0, 0, None), (3, 0, None))
    results = [torchrun(WORKER, [str(s), str(o), str(width), str(depth), str(args.steps),
                                 str(args.bucket)], nproc=n or device_ranks())[0]
               for s, o, n in cases]
    base = results[0]
    rows = []
    for r in results:
        theory = 16 * r['params'] / r['world'] / 2**20
        expected = expected_bytes(r['stage'], r['params'], r['world'], args.bucket) / 2**20
        name = f'ZeRO-{r["stage"]}' + (' + CPU offload' if r['offload'] else '')
        rows.append([name, r['world'], r['peak_mb'], r['peak_mb'] / base['peak_mb'],
                     r['steady_mb'], r['steady_mb'] / base['steady_mb'], r['tensor_mb'],
                     r['tensor_mb'] / base['tensor_mb'], theory, r['tensor_mb'] / theory,
                     expected, r['tensor_mb'] / expected])
    print(table(['stage', 'ranks', 'peak MiB', 'peak vs ZeRO-0', 'steady MiB',
                 'steady vs ZeRO-0', 'tensors MiB', 'tensors vs ZeRO-0', '16Φ/N MiB',
                 'tensors vs 16Φ/N', 'DeepSpeed layout MiB', 'tensors vs layout'], rows))
    where = ('CUDA allocator peak / current' if base['cuda']
             else 'peak RSS / RSS after malloc_trim, minus the RSS before the model')
    print(f'\nΦ = {base["params"]:,} parameters, fp32 Adam, batch 1 x 64 '
          f'tokens, {args.steps} steps, buckets of {args.bucket:,} elements; peak / steady: '
          f'{where}; tensors: live tensor storage after the steps.')


if __name__ == '__main__':
    main()
