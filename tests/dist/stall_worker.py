"""One rank of the stall count: what in a steady-state iteration would make a GPU wait.

Usage (under torchrun): ``stall_worker.py OUT_DIR SCENARIO_JSON [...]``; a scenario is
``{"name": ..., "model": "toy" | "gan", "cfg": {config keys}}``. The run trains 40
iterations with LoggerHook's interval 10 and counts, over iterations 10-39 (after the
first iterations' one-time checks), per iteration:

* ``sync``: calls of the accelerator's ``synchronize`` (DeepSpeed's accelerator and
  ``torch.cuda`` / ``torch.cpu``);
* ``read``: host reads of tensor values, through a ``TorchFunctionMode`` over ``item``,
  ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu``, ``numpy``
  (on a CPU tensor these cost nothing; on a GPU each drains the queue);
* ``collective``: ``torch.distributed`` collectives (what ``deepspeed.comm`` and
  MMEngine's ``mmengine.dist`` call through).

Each is attributed to whoever issued it: the innermost frame outside torch, by path:
``ours`` (mmengine_deepspeed), ``mmengine``, ``deepspeed``, or ``user`` (the test's
model). Each rank writes ``OUT_DIR/NAME.rankR.json``: counts per iteration by kind and
issuer, and each ``ours``/``mmengine`` call site with its count.
"""
from __future__ import annotations

import collections
import json
import os
import os.path as osp
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, RUNNERS
from torch.overrides import TorchFunctionMode

import mmengine_deepspeed  # noqa: F401
import tests.toy_gan  # noqa: F401  registers ToyGAN
from tests.helpers import forward_doubles, run_scenarios, toy_config
from tests.toy_gan import gan_config

ITERS, FIRST, INTERVAL = 40, 10, 10
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_into_tensor', 'all_gather_object',
               'reduce_scatter', 'reduce_scatter_tensor', 'broadcast', 'broadcast_object_list',
               'all_to_all', 'all_to_all_single', 'barrier', 'reduce', 'gather', 'scatter',
               'monitored_barrier')
PLACES = (('/mmengine_deepspeed/', 'ours'), ('/site-packages/deepspeed/', 'deepspeed'),
          ('/site-packages/mmengine/', 'mmengine'))
SKIP = ('/torch/', __file__, '/contextlib.py', '/functools.py')


def issuer() -> tuple[str, str]:
    """(who, file:line) of the innermost frame outside torch and this counter."""
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in SKIP):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return 'user', '?'
    name = frame.f_code.co_filename
    who = next((label for part, label in PLACES if part in name), 'user')
    return who, f'{name.split("/site-packages/")[-1].split("/work/main/")[-1]}:{frame.f_lineno}'


class StallCounter(TorchFunctionMode):
    """Counts, while on, the three kinds of stall by issuer and call site."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.counts: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()

    def count(self, kind: str) -> None:
        if self.on:
            who, site = issuer()
            self.counts[kind, who] += 1
            if who in ('ours', 'mmengine'):
                self.sites[kind, site] += 1

    def __torch_function__(self, func: Callable, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in READS:
            self.count('read')
        return func(*args, **(kwargs or {}))

    def install(self) -> None:
        """Wrap the synchronize and collective functions (for the whole process)."""
        targets = [(get_accelerator(), 'synchronize', 'sync'), (torch.cuda, 'synchronize', 'sync'),
                   (torch.cpu, 'synchronize', 'sync')]
        targets += [(dist, name, 'collective') for name in COLLECTIVES if hasattr(dist, name)]
        for owner, name, kind in targets:
            real = getattr(owner, name)

            def counted(*args: Any, _real: Any = real, _kind: str = kind, **kwargs: Any) -> Any:
                self.count(_kind)
                return _real(*args, **kwargs)

            setattr(owner, name, counted)


COUNTER = StallCounter()


@HOOKS.register_module()
class StallCountHook(Hook):
    """Counts inside the loop's ``run_iter`` (the iteration's hooks and step, not the
    data loading) of the counted iterations."""

    def before_train(self, runner: Any) -> None:
        run_iter = runner.train_loop.run_iter

        def counted(*args: Any, **kwargs: Any) -> Any:
            COUNTER.on = FIRST <= runner.iter < ITERS
            with COUNTER:
                try:
                    return run_iter(*args, **kwargs)
                finally:
                    COUNTER.on = False

        runner.train_loop.run_iter = counted


def run(out_dir: str, scenario: dict) -> None:
    name = scenario['name']
    make = gan_config if scenario.get('model') == 'gan' else toy_config
    cfg = make(osp.join(out_dir, name), max_iters=ITERS, val=False, **scenario.get('cfg', {}))
    cfg['default_hooks'] = dict(cfg.get('default_hooks') or {},
                                logger=dict(type='LoggerHook', interval=INTERVAL))
    cfg['custom_hooks'] = [*cfg.get('custom_hooks', []), dict(type='StallCountHook')]
    cfg.update(runner_type='DeepSpeedRunner', launcher='pytorch', experiment_name=name)
    forward_doubles(scenario.get('out_of_memory_on_rank1') if os.environ['RANK'] == '1'
                    else None, False)
    runner = RUNNERS.build(Config(cfg))
    COUNTER.counts.clear()
    COUNTER.sites.clear()
    runner.train()
    iterations = ITERS - FIRST
    counts, sites = COUNTER.counts.items(), COUNTER.sites.items()
    result = dict(per_iteration={f'{kind}/{who}': n / iterations for (kind, who), n in counts},
                  sites={f'{kind} {site}': n / iterations for (kind, site), n in sites},
                  split=getattr(runner.strategy.virtual_ranks, 'split', None))
    with open(osp.join(out_dir, f'{name}.rank{runner.rank}.json'), 'w') as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == '__main__':
    COUNTER.install()
    run_scenarios(run)
