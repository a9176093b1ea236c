"""The message hub's host time per training iteration, late in a long run.

MMEngine's ``HistoryBuffer.update`` copies the key's whole history (``np.append``), so
every scalar logged costs time in proportion to the iterations run so far; the runner's
hub keeps its histories in :class:`~mmengine_deepspeed.history.GrowingHistory`. For each
history length, both hubs are filled to it, then timed over iterations that log what a
training iteration logs under DeepSpeedRunner (MMEngine's lr, data_time, time and loss;
grad_norm, skipped_steps, samples_per_s, tokens_per_s: 8 keys, the loss and grad norm as
tensors, read at a logging interval of 10), one process, no training.

    python benchmarks/history.py [--smoke]
"""
from __future__ import annotations

import argparse
import sys
import time
from os import path as osp

import torch

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmengine.logging import HistoryBuffer, MessageHub

from benchmarks.common import table
from mmengine_deepspeed.message_hub import DeferredMessageHub

FLOATS = ('train/lr', 'train/data_time', 'train/time', 'train/skipped_steps',
          'train/samples_per_s', 'train/tokens_per_s')
TENSORS = ('train/loss', 'train/grad_norm')
LOG_INTERVAL = 10


def filled(hub: MessageHub, length: int) -> MessageHub:
    """``hub`` with ``length`` values under every key (as if that many iterations ran)."""
    for key in FLOATS + TENSORS:
        hub.log_scalars[key] = HistoryBuffer([0.5] * length, [1] * length)
        hub.update_scalar(key, 0.5)  # the runner's hub takes it over at an update
    return hub


def ms_per_iteration(hub: MessageHub, iterations: int) -> float:
    """Host time of the hub's updates and reads per iteration (the loop's share of it)."""
    loss, norm = torch.tensor(2.0), torch.tensor(1.0)
    start = time.perf_counter()
    for i in range(iterations):
        for key in FLOATS:
            hub.update_scalar(key, 0.5)
        hub.update_scalar(TENSORS[0], loss)
        hub.update_scalar(TENSORS[1], norm)
        hub.get_scalar('train/time')  # MMEngine's IterTimerHook, every iteration
        if (i + 1) % LOG_INTERVAL == 0:
            for key in FLOATS + TENSORS:  # LoggerHook's window means
                hub.get_scalar(key).mean(LOG_INTERVAL)
    return (time.perf_counter() - start) / iterations * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true', help='seconds-long run for CI')
    args = parser.parse_args()
    lengths = (100, 10_000) if args.smoke else (100, 10_000, 100_000, 1_000_000)
    iterations = 20 if args.smoke else 200
    rows = []
    for n, length in enumerate(lengths):
        mmengine = ms_per_iteration(filled(MessageHub(f'mmengine_{n}'), length), iterations)
        ours = ms_per_iteration(filled(DeferredMessageHub.build(f'ours_{n}'), length),
                                iterations)
        rows.append([length, mmengine, ours, mmengine / ours])
    print(table(['iterations so far', "MMEngine's MessageHub ms/iter",
                 "DeepSpeedRunner's hub ms/iter", 'ratio'], rows))


if __name__ == '__main__':
    main()
