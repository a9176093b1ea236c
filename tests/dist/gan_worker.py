"""One rank of a GAN test: train the toy GAN, save what it saw.

Usage (under torchrun): ``gan_worker.py OUT_DIR SCENARIO_JSON [SCENARIO_JSON ...]``.
Each scenario is ``{"name": ..., "cfg": {gan_config kwargs}}`` with optional
``"mode"``: ``"train"`` (default), ``"plain"`` (MMEngine's own Runner, the
reference), ``"val"`` (``runner.val()`` without training); and ``"form"``:
``"config"`` (default, the constructor) or ``"objects"`` (the tutorial's
``OptimWrapperDict`` built by hand, with a model instance). Scenarios run one
after another in one process group. Each rank writes ``OUT_DIR/NAME.rankR.pt``.
"""
from __future__ import annotations

import os.path as osp
from typing import Any

import deepspeed
import torch
from mmengine.config import Config
from mmengine.runner import Runner

import mmengine_deepspeed  # noqa: F401
from mmengine_deepspeed import DeepSpeedRunner
from tests.helpers import ema_state, model_state, run_scenarios
from tests.toy_gan import ToyGAN, gan_config, gan_wrappers


def _history(hub: Any, key: str) -> list[float]:
    return [float(v) for v in hub.get_scalar(key).data[0]] if key in hub.log_scalars else []


def run(out_dir: str, scenario: dict[str, Any]) -> None:
    name, mode = scenario['name'], scenario.get('mode', 'train')
    cfg = gan_config(scenario.get('work_dir', osp.join(out_dir, name)), **scenario['cfg'])
    # Runners built in the same second would share MessageHub's history
    # (docs/troubleshooting.md, Known limits).
    cfg.setdefault('experiment_name', name)
    # The plain reference runs in one process (launcher 'none', no DDP wrapper,
    # which would bypass the model's own train_step).
    cfg['launcher'] = 'none' if mode == 'plain' else 'pytorch'
    if scenario.get('form') == 'objects':
        model = ToyGAN()
        cfg.update(model=model, optim_wrapper=gan_wrappers(model))
    if mode == 'plain':
        cfg.pop('ds_config', None)
        runner: Any = Runner(**cfg) if scenario.get('form') == 'objects' else \
            Runner.from_cfg(Config(cfg))
    else:
        runner = DeepSpeedRunner(**cfg) if scenario.get('form') == 'objects' else \
            DeepSpeedRunner.from_cfg(Config(cfg))
    result: dict[str, Any] = dict(name=name)
    if mode == 'val':
        result['metrics'] = {k: float(v) for k, v in runner.val().items()}
    else:
        runner.train()
        hub = runner.message_hub
        result.update(losses=_history(hub, 'train/loss'),
                      lr_g=_history(hub, 'train/generator.lr'),
                      lr_d=_history(hub, 'train/discriminator.lr'),
                      grad_norm_d=_history(hub, 'train/discriminator.grad_norm'),
                      scalars=sorted(hub.log_scalars))
    module = runner.model.module if hasattr(runner.model, 'module') else runner.model
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        result['state'] = model_state(module)
    result['ema'] = ema_state(runner) if mode != 'plain' else None
    result['val_modes'] = list(getattr(module, 'val_modes', []))
    ours = mode != 'plain'  # MMEngine's Runner has no strategy
    engines = runner.strategy.engines() if ours else {}
    result.update(engines={n: type(e.module).__name__ for n, e in engines.items()},
                  engine_modules=runner.strategy.specs.modules() if ours else {},
                  stages={n: e.zero_optimization_stage() for n, e in engines.items()},
                  steps={n: e.global_steps for n, e in engines.items()},
                  dtypes={n: str(next(e.module.parameters()).dtype) for n, e in engines.items()})
    torch.save(result, osp.join(out_dir, f'{name}.rank{runner.rank}.pt'))


if __name__ == '__main__':
    run_scenarios(run)
