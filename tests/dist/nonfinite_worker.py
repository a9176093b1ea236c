"""One rank of the non-finite tests: a toy model whose loss is not finite on one rank at
chosen iterations; the run's parameters, log and checkpoints are written for the test.

Usage (under torchrun): ``nonfinite_worker.py OUT_DIR SCENARIO_JSON [...]``; a scenario is
``{"name": ..., "cfg": {toy_config keys}, "bad": {"rank": R, "iters": [...], "value":
"nan" | "inf", "how": "input" | "loss"}}``. ``how='input'`` poisons the rank's batch (its
gradients are not finite); ``'loss'`` adds the value to its loss only (its gradients are).
Or ``"bad": {"samples": [...]}`` with ``dataset_type='CorruptToyDataset'``: those dataset
indices hold NaN inputs (corrupt data, whichever rank and iteration draws them); with
``"model": "gan"``, the toy GAN (two optimizers) on images of which those are NaN.
``"sleep": S`` makes each training forward take S seconds longer.
Each rank writes ``OUT_DIR/NAME.rankR.pt``.
"""
from __future__ import annotations

import os.path as osp
import time
from typing import Any, Optional

import deepspeed
import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.registry import DATASETS, MODELS, RUNNERS

import mmengine_deepspeed  # noqa: F401
from tests.helpers import ToyDataset, ToyModel, model_state, run_scenarios, toy_config
from tests.toy_gan import ToyImageDataset, gan_config

BAD: dict[str, Any] = {}


@MODELS.register_module()
class BadStepToyModel(ToyModel):
    """ToyModel whose loss is not finite on ``BAD['rank']`` at the iterations ``BAD['iters']``
    (counted in its own loss forwards)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.forwards = 0

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        bad = (mode == 'loss' and self.training and self.forwards in BAD.get('iters', ())
               and dist.get_rank() in BAD['ranks'])
        if mode == 'loss' and self.training:
            self.forwards += 1
        if mode == 'loss' and self.training and BAD.get('sleep'):
            time.sleep(BAD['sleep'])  # a slow step: the agreements come between logging ones
        value = float(BAD.get('value', 'nan'))
        if bad and BAD.get('how', 'input') == 'input':
            inputs = inputs * value
        out = super().forward(inputs, labels, mode)
        if bad and BAD.get('how') == 'loss':
            out['loss'] = out['loss'] + value
        return out


def _corrupted(item: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """``item`` with NaN inputs if ``index`` is one of ``BAD['samples']``."""
    if index in BAD.get('samples', ()):
        item['inputs'] = item['inputs'] * float('nan')
    return item


@DATASETS.register_module()
class CorruptToyDataset(ToyDataset):
    """ToyDataset whose samples ``BAD['samples']`` hold NaN inputs."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return _corrupted(super().__getitem__(index), index)


@DATASETS.register_module()
class CorruptToyImageDataset(ToyImageDataset):
    """ToyImageDataset whose images ``BAD['samples']`` are NaN."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return _corrupted(super().__getitem__(index), index)


def _history(scalars: dict, key: str) -> list[float]:
    return [float(v) for v in scalars[key].data[0]] if key in scalars else []


def run(out_dir: str, scenario: dict[str, Any]) -> None:
    name = scenario['name']
    BAD.clear()
    BAD.update(scenario.get('bad', {}))
    BAD.setdefault('ranks', [BAD.get('rank', 1)])
    if scenario.get('model') == 'gan':
        cfg = gan_config(osp.join(out_dir, name), max_iters=16, val=False,
                         **scenario['cfg'])
        cfg['train_dataloader']['dataset']['type'] = 'CorruptToyImageDataset'
    else:
        cfg = toy_config(osp.join(out_dir, name), **dict(
            dict(model=dict(type='BadStepToyModel', with_bn=False), max_iters=16, val=False,
                 param_scheduler=None), **scenario['cfg']))
    cfg['launcher'] = 'pytorch'
    cfg['experiment_name'] = name
    runner = RUNNERS.build(Config(dict(cfg, runner_type='DeepSpeedRunner')))
    result: dict[str, Any] = dict(name=name)
    try:
        runner.train()
    except SystemExit as e:
        result['exit'] = e.code
    hub = runner.message_hub
    scalars = hub.log_scalars
    result['losses'] = _history(scalars, 'train/loss')
    result['grad_norms'] = _history(scalars, 'train/grad_norm')
    result['skipped'] = _history(scalars, 'train/skipped_steps')
    result['skipped_by'] = {key: _history(scalars, f'train/{key}.skipped_steps')
                            for key in ('generator', 'discriminator')}
    module = runner.model.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):  # ZeRO-3: whole
        result['state'] = model_state(module)
    result['log'] = ''
    log_file = getattr(runner.logger.handlers[-1], 'baseFilename', None)
    if dist.get_rank() == 0 and log_file:
        with open(log_file) as f:
            result['log'] = f.read()
    result['excluded'] = runner.message_hub.get_info('excluded_samples')
    torch.save(result, osp.join(out_dir, f'{name}.rank{dist.get_rank()}.pt'))


if __name__ == '__main__':
    run_scenarios(run)
