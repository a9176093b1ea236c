"""One rank of a Runner-contract test: several runners in one process, as scripts,
notebooks and sweeps build them.

Usage (under torchrun): ``contract_worker.py OUT_DIR SCENARIO_JSON [...]``. Each scenario
``{"name": ..., "cfg": {toy_config kwargs}}`` trains a ``DeepSpeedRunner`` and validates;
``"destroy": true`` then calls ``torch.distributed.destroy_process_group()``, and
``"rebuild": true`` calls ``build_optim_wrapper`` once more after training (MMEngine's
factory), ``"factory": true`` calls it three times before training and trains with the last,
and
``"deepcopy": true`` deep-copies ``runner.model`` and runs the copy. Before training,
``"resume_first": PATH`` calls ``runner.resume(PATH)`` and ``"load_or_resume_first": true``
``runner.load_or_resume()``; ``"val_only": true`` validates without training.
``"ema_by_hand": true`` drives the EMA hook's ``before_run`` / ``before_val_epoch`` /
``after_val_epoch`` by hand before anything (the averaged weights set to 0.5), keeping the
model's weights before, during and after the swap.
``"save_first": FILENAME`` calls ``runner.save_checkpoint`` before anything else (the
model's weights then are kept as ``first_state``), and ``"save_after": {FILENAME:
save_optimizer}`` after validating. Each rank writes ``OUT_DIR/NAME.rankR.pt`` (final
weights, val metrics, losses and learning rates, the error).
"""
from __future__ import annotations

import copy
import os
import os.path as osp
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from mmengine.config import Config

import mmengine_deepspeed  # noqa: F401
import tests.toy_layered  # noqa: F401  registers LayeredModel
from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.hooks.ema import DeepSpeedEMAHook
from tests.helpers import model_state, probe_inputs, recorder, run_scenarios, toy_config


def run(out_dir: str, scenario: dict[str, Any]) -> None:
    name = scenario['name']
    cfg = toy_config(osp.join(out_dir, name), **scenario['cfg'])
    cfg['launcher'] = 'pytorch'
    # Runners built in the same second would share MessageHub and the logger
    # (docs/troubleshooting.md, Known limits), whose duplicate-warning filter would swallow
    # a second run's warning.
    cfg.setdefault('experiment_name', name)
    runner = DeepSpeedRunner.from_cfg(Config(cfg))
    result: dict[str, Any] = {}
    if 'save_first' in scenario:  # before train() or val(): no engine yet
        runner.save_checkpoint(runner.work_dir, scenario['save_first'], by_epoch=False)
        with deepspeed.zero.GatheredParameters(list(runner.strategy.bare_model.parameters())):
            result['first_state'] = model_state(runner.strategy.bare_model)
    if scenario.get('ema_by_hand'):  # EMAHook's steps called by hand, before any engine
        hook = next(h for h in runner.hooks if isinstance(h, DeepSpeedEMAHook))
        bare = runner.strategy.bare_model
        with deepspeed.zero.GatheredParameters(list(bare.parameters())):
            result['before'] = model_state(bare)
        hook.before_run(runner)
        with torch.no_grad():
            for param in hook.ema_model.module.parameters():
                param.fill_(0.5)
        hook.before_val_epoch(runner)
        with deepspeed.zero.GatheredParameters(list(bare.parameters())):
            result['swapped_in'] = model_state(bare)
        result['ema_swapped_in'] = model_state(hook.ema_model.module)
        hook.after_val_epoch(runner)
        with deepspeed.zero.GatheredParameters(list(bare.parameters())):
            result['swapped_back'] = model_state(bare)
        result['ema_swapped_back'] = model_state(hook.ema_model.module)
        result['parameter_names'] = [n for n, _ in bare.named_parameters()]
    if 'resume_first' in scenario:  # runner.resume(path) before train()
        runner.resume(scenario['resume_first'])
    if scenario.get('load_or_resume_first'):
        runner.load_or_resume()
    if scenario.get('factory'):  # build_optim_wrapper three times, then train with the last
        first = runner.build_optim_wrapper(dict(optimizer=dict(type='SGD', lr=0.5)))
        again = runner.build_optim_wrapper(first)
        last = runner.build_optim_wrapper(dict(optimizer=dict(type='AdamW', lr=0.01)))
        result.update(factory_types=[type(w).__name__ for w in (first, again, last)],
                      factory_same=again is first,
                      engines_before_train=len(runner.strategy.engines()))
        runner.optim_wrapper = last
    if not scenario.get('val_only'):
        runner.train()
        engine = next(iter(runner.strategy.engines().values()))
        result['client_optimizer'] = type(engine.client_optimizer).__name__
        result.update(losses=recorder(runner).losses, lrs=recorder(runner).lrs)
    result['metrics'] = dict(runner.val())
    for filename, save_optimizer in scenario.get('save_after', {}).items():
        runner.save_checkpoint(runner.work_dir, filename, save_optimizer=save_optimizer,
                               by_epoch=False)
    module = runner.model.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        result['state'] = model_state(module)
    if scenario.get('deepcopy'):
        copied = copy.deepcopy(runner.model)
        runner.model.eval()
        copied.eval()
        with torch.no_grad():
            result.update(
                copy_state=model_state(copied), copy_type=type(copied).__name__,
                copy_hooks=sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                               for m in copied.modules()),
                copy_out=copied(probe_inputs()), model_out=runner.model(probe_inputs()))
    if scenario.get('rebuild'):  # MMEngine's factory after training: a plain wrapper
        built = runner.build_optim_wrapper(cfg['optim_wrapper'])
        result.update(rebuilt=type(built).__name__,
                      still=type(runner.optim_wrapper).__name__,
                      engines_after_rebuild=len(runner.strategy.engines()))
    torch.save(result, osp.join(out_dir, f'{name}.rank{os.environ["RANK"]}.pt'))
    if scenario.get('destroy'):
        dist.destroy_process_group()


if __name__ == '__main__':
    run_scenarios(run)
