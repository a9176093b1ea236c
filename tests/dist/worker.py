"""One rank of a multi-rank test: run the toy config, save what it saw.

Usage (under torchrun): ``worker.py OUT_DIR SCENARIO_JSON [SCENARIO_JSON ...]``.
Each scenario is a JSON dict ``{"name": ..., "mode": "train" | "test",
"cfg": {toy_config kwargs}}``; they run one after another in the same process
group, which keeps the suite's start-up cost to one launch per test module.
Each rank writes ``OUT_DIR/NAME.rankR.pt`` with the gathered final weights,
per-iteration losses and learning rates, metrics and facts about the run.
"""
from __future__ import annotations

import json
import os
import os.path as osp
import sys
from typing import Any

import deepspeed
import torch
from mmengine.config import Config
from mmengine.registry import RUNNERS

import mmengine_deepspeed  # noqa: F401
from tests.helpers import model_state, recorder, toy_config


def _as_test_only(cfg: dict) -> dict:
    """Turn a toy training config into a test-only one (no optimizer at all)."""
    for key in ('train_dataloader', 'train_cfg', 'optim_wrapper', 'param_scheduler'):
        cfg.pop(key, None)
    cfg['test_dataloader'] = cfg.pop('val_dataloader')
    cfg['test_evaluator'] = cfg.pop('val_evaluator')
    cfg['test_cfg'] = cfg.pop('val_cfg')
    return cfg


def run(out_dir: str, scenario: dict) -> None:
    name = scenario['name']
    mode = scenario.get('mode', 'train')
    cfg = toy_config(osp.join(out_dir, name), **scenario.get('cfg', {}))
    if mode == 'test':
        cfg = _as_test_only(cfg)
    cfg.update(runner_type='DeepSpeedRunner', launcher='pytorch')
    runner = RUNNERS.build(Config(cfg))
    result: dict[str, Any] = {}
    if mode == 'test':
        result['test_metrics'] = {k: float(v) for k, v in runner.test().items()}
    else:
        runner.train()
        rec = recorder(runner)
        hub = runner.message_hub
        result.update(
            losses=rec.losses, lrs=rec.lrs, metrics=rec.metrics,
            group_lrs=[float(lr) for lr in runner.optim_wrapper.get_lr()['lr']],
            scalars=sorted(hub.log_scalars),
            grad_norm=float(hub.get_scalar('train/grad_norm').current())
            if 'train/grad_norm' in hub.log_scalars else None)
    engine = runner.engines['model']
    module = runner.model.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        state = model_state(module)
    result.update(
        state=state, world_size=runner.world_size, stage=engine.zero_optimization_stage(),
        param_dtype=str(next(module.parameters()).dtype), global_steps=engine.global_steps,
        has_optimizer=engine.client_optimizer is not None,
        engine_optimizer=type(engine.optimizer).__name__, backend=torch.distributed.get_backend(),
        wrapper=type(runner.model).__name__, module=type(module).__name__)
    torch.save(result, osp.join(out_dir, f'{name}.rank{runner.rank}.pt'))


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for arg in sys.argv[2:]:
        run(out_dir, json.loads(arg))


if __name__ == '__main__':
    main()
