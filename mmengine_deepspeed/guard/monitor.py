"""The failed steps every rank saw, put together and told: the monitor's collective and its
report.

Called by :class:`~.hook.NonFiniteHook` only after the run's agreement said some rank saw a
failed step, so that the gather (a small collective on a CPU group) is never paid on a
healthy iteration.
"""
from __future__ import annotations

import json
import os.path as osp
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as torch_dist

from ..dist import cpu_group
from .failed_steps import FailedStep

STEPS_FILE = 'nonfinite_steps.jsonl'


def gather_failed_steps(mine: dict[str, Any], rank: int,
                        batch_of: Callable[[int], Optional[list[int]]]) -> list[FailedStep]:
    """Every rank's view of the failed iterations, as one list (collective).

    Args:
        mine (dict): This rank's view (``FailedStepWatch.take()``).
        rank (int): This rank.
        batch_of (Callable): The dataset indices of this rank's batch at an iteration
            (None where not known).

    Returns:
        list[FailedStep]: The failed steps, by iteration, with every rank's part.
    """
    iterations = set(mine['skips']) | set(mine['bad']) | set(mine['spikes'])
    mine = dict(mine, rank=rank, batches={it: batch_of(it) for it in iterations})
    views: list[Any] = [mine]
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        views = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(views, mine, group=cpu_group())
    steps: dict[int, FailedStep] = {}
    for view in views:
        for it in view['skips']:
            steps.setdefault(it, FailedStep(it)).skipped = True
        for it, keys in view['bad'].items():
            steps.setdefault(it, FailedStep(it)).losses[view['rank']] = keys
        for it in view['spikes']:
            steps.setdefault(it, FailedStep(it)).spikes.append(view['rank'])
    for view in views:
        for it, step in steps.items():
            # each rank's batch of every failed iteration: gradients alone exclude all
            step.batches[view['rank']] = view['batches'].get(it)
    return [steps[it] for it in sorted(steps)]


def report_failed_steps(steps: list[FailedStep], *, work_dir: str, rank: int, skipped: int,
                        logger: Any) -> None:
    """Append ``steps`` to ``work_dir/nonfinite_steps.jsonl`` (rank 0) and log them."""
    path = osp.join(work_dir, STEPS_FILE)
    if rank == 0:
        with open(path, 'a', encoding='utf-8') as f:
            for step in steps:
                f.write(json.dumps(step.record()) + '\n')
    said = '\n'.join(f'  {step.describe()}' for step in steps)
    logger.warning(f'Steps that were not finite (skipped updates so far: {skipped}; details '
                   f'in {path}):\n{said}')
