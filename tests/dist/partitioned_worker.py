"""One rank of a partitioned-construction test: build, train, save what it saw.

Usage (under torchrun): ``partitioned_worker.py OUT_DIR SCENARIO_JSON [...]``.
Each scenario is ``{"name": ..., "cfg": {toy_config kwargs}}`` with an
optional ``"mode"``:

* ``"train"`` (default): build a ``DeepSpeedRunner``, train, and save whether
  the model was partitioned when built, the gathered weights just before the
  first iteration (after ``init_weights`` and ``load_from``), the trained
  weights, the EMA weights, the optimizer DeepSpeed steps and how often
  DeepSpeed's activation ``checkpoint`` ran;
* ``"memory"``: only build the runner and save this rank's peak RSS rise
  while it was built, against the model's fp32 size (after a warm-up runner:
  see ``_warm_up``).

Each rank writes ``OUT_DIR/NAME.rankR.pt``.
"""
from __future__ import annotations

import os
import os.path as osp
from typing import Any

import deepspeed
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

import mmengine_deepspeed  # noqa: F401
import tests.toy_layered  # noqa: F401  registers LayeredModel
from benchmarks.common import reset_peak_rss, status_kib
from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.zero.gather import is_partitioned
from tests.helpers import ema_state, model_state, run_scenarios, toy_config


def _warm_up(cfg: dict) -> None:
    """Build a runner around a one-block model first: the process group, DeepSpeed's
    communication buffers, MMEngine's environment report and imports cost the
    same whatever the model's size, and are not what is measured."""
    small = dict(cfg, model=dict(cfg['model'], depth=1))
    DeepSpeedRunner.from_cfg(Config(small))


def _gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return model_state(model)


@HOOKS.register_module()
class InitStateHook(Hook):
    """Keeps the gathered weights as the first iteration finds them."""

    def before_train(self, runner: Any) -> None:
        runner.init_state = _gathered_state(runner.model.module)


class CheckpointCalls:
    """Counts calls of ``deepspeed.checkpointing.checkpoint`` (and makes them)."""

    def __init__(self) -> None:
        self.calls = 0
        self._checkpoint = deepspeed.checkpointing.checkpoint
        deepspeed.checkpointing.checkpoint = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._checkpoint(*args, **kwargs)


def run(out_dir: str, scenario: dict[str, Any]) -> None:
    name, mode = scenario['name'], scenario.get('mode', 'train')
    rank = int(os.environ['RANK'])
    cfg = toy_config(osp.join(out_dir, name), **scenario['cfg'])
    cfg['launcher'] = 'pytorch'
    result: dict[str, Any] = dict(name=name)
    if mode == 'memory':
        _warm_up(cfg)
        before = reset_peak_rss()
        runner = DeepSpeedRunner.from_cfg(Config(cfg))
        result.update(rise_kib=status_kib('VmHWM') - before,
                      model_kib=sum(int(getattr(p, 'ds_numel', p.numel())) * 4
                                    for p in runner.model.parameters()) / 1024,
                      partitioned=is_partitioned(runner.model))
    else:
        calls = CheckpointCalls()
        runner = DeepSpeedRunner.from_cfg(Config(cfg))
        result['partitioned'] = is_partitioned(runner.model)
        runner.train()
        module = runner.model.module
        result.update(init_state=runner.init_state, state=_gathered_state(module),
                      params=[n for n, _ in module.named_parameters()],
                      ema=ema_state(runner), checkpoint_calls=calls.calls,
                      optimizer=type(runner.strategy.engines()['model'].basic_optimizer).__name__)
        if hasattr(module, 'plain_tensors'):
            result['plain'] = module.plain_tensors()
        deepspeed.checkpointing.checkpoint = calls._checkpoint
    torch.save(result, osp.join(out_dir, f'{name}.rank{rank}.pt'))


if __name__ == '__main__':
    run_scenarios(run)
