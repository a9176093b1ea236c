"""One rank of a multi-rank test: run the toy config, save what it saw.

Usage (under torchrun): ``worker.py OUT_DIR SCENARIO_JSON [SCENARIO_JSON ...]``.
Each scenario is a JSON dict ``{"name": ..., "mode": "train" | "test",
"cfg": {toy_config kwargs}}`` (mode ``"test_reload"`` tests, then loads
``"reload"`` into the built engine with ``runner.load_checkpoint`` and tests
again; mode ``"plain"`` trains with MMEngine's own Runner and DDP with
``find_unused_parameters=True``, the reference for parity) with optional ``"work_dir"`` (default
``OUT_DIR/NAME``), ``"unmark"`` (a checkpoint whose COMPLETE marker rank 0
deletes first, as if its save had been killed) and
``"kill_rank1_at_iter"``
(rank 1 SIGKILLs itself in the middle of the save taken at that iteration:
after DeepSpeed wrote its shards, before the marker). Scenarios run one after
another in the same process group, which keeps the suite's start-up cost to
one launch per test module.
Each rank writes ``OUT_DIR/NAME.rankR.pt`` with the gathered final weights,
per-iteration losses and learning rates, metrics and facts about the run.
"""
from __future__ import annotations

import os
import os.path as osp
import resource
import signal
from typing import Any, Optional

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, RUNNERS

import mmengine_deepspeed  # noqa: F401
import tests.norm_reference  # registers RefLARS, RefLamb
import tests.toy_teacher  # noqa: F401  registers ToyTeacherModel
from mmengine_deepspeed.checkpoint.layout import MARKER_FILE
from mmengine_deepspeed.dist import init_distributed
from mmengine_deepspeed.engine import split_retry
from mmengine_deepspeed.strategy.run import RunStrategy
from tests.helpers import (
    OUT_OF_MEMORY_RAISED,
    ema_state,
    forward_doubles,
    model_state,
    probe_inputs,
    recorder,
    run_scenarios,
    toy_config,
)


def _as_test_only(cfg: dict) -> dict:
    """Turn a toy training config into a test-only one (no optimizer at all)."""
    for key in ('train_dataloader', 'train_cfg', 'optim_wrapper', 'param_scheduler'):
        cfg.pop(key, None)
    cfg['test_dataloader'] = cfg.pop('val_dataloader')
    cfg['test_evaluator'] = cfg.pop('val_evaluator')
    cfg['test_cfg'] = cfg.pop('val_cfg')
    return cfg


def _kill_rank1_during_save_at(iteration: int, runner_box: list) -> None:
    """Make rank 1 die with SIGKILL after DeepSpeed wrote the shards of that save."""
    real = deepspeed.DeepSpeedEngine.save_checkpoint

    def dying_save(engine: Any, *args: Any, **kwargs: Any) -> Any:
        saved = real(engine, *args, **kwargs)
        runner = runner_box[0]
        if runner.rank == 1 and runner.iter + 1 == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    deepspeed.DeepSpeedEngine.save_checkpoint = dying_save  # type: ignore[method-assign]


@HOOKS.register_module()
class FileSizeLimitHook(Hook):
    """From iteration ``at_iter`` on, no file may grow past 4 KiB (RLIMIT_FSIZE): a real
    write failure ("File too large") for the save of that iteration, as a full disk gives.

    Args:
        at_iter (int): The 1-based iteration whose save must fail.
    """

    def __init__(self, at_iter: int):
        self.at_iter = at_iter

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        if runner.iter + 1 == self.at_iter:  # before CheckpointHook (lower priority) saves
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@HOOKS.register_module()
class SignalHook(Hook):
    """Rank ``rank`` sends itself signal ``sig`` as iteration ``at_iter`` (1-based) begins, as a
    scheduler's SIGTERM lands in the middle of training; with ``again_during_save`` a second
    one arrives while the preemption checkpoint is being written. Only before any restart by
    the elastic agent.

    Args:
        at_iter (int): The iteration during which the signal arrives.
        rank (int): The rank that gets it. Defaults to 1.
        sig (str): Its name. Defaults to ``'SIGTERM'``.
        again_during_save (bool): Send it once more from ``before_save_checkpoint``.
            Defaults to False.
    """

    def __init__(self, at_iter: int, rank: int = 1, sig: str = 'SIGTERM',
                 again_during_save: bool = False):
        self.at_iter, self.rank, self.again = at_iter, rank, again_during_save
        self.signal = signal.Signals[sig]
        self.first_attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT') in (None, '0')

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        if self.first_attempt and runner.rank == self.rank and runner.iter + 1 == self.at_iter:
            os.kill(os.getpid(), self.signal)

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        if self.first_attempt and self.again and runner.rank == self.rank \
                and runner.iter + 1 == self.at_iter:
            os.kill(os.getpid(), self.signal)


@HOOKS.register_module()
class GatherBetweenPhasesHook(Hook):
    """Gathers the whole model where users export weights: after training, validation and
    testing (``deepspeed.zero.GatheredParameters`` without a modifier rank, as an export
    hook does); records, per event, how many ZeRO-3 parameters it found held whole (gathered,
    prefetched or in flight) and the gathered parameters' sum."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, float]] = []

    def _gather(self, runner: Any, event: str) -> None:
        module = runner.model.module
        held = sum(getattr(p, 'ds_status', None) not in (None, ZeroParamStatus.NOT_AVAILABLE)
                   for p in module.parameters())
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            total = float(sum(p.double().sum() for p in module.parameters()))
        self.seen.append((event, held, total))

    def after_train(self, runner: Any) -> None:
        self._gather(runner, 'after_train')

    def after_val_epoch(self, runner: Any, metrics: Any = None) -> None:
        self._gather(runner, 'after_val_epoch')

    def after_test_epoch(self, runner: Any, metrics: Any = None) -> None:
        self._gather(runner, 'after_test_epoch')


_PEAK_MODEL = RunStrategy.peak_model


class _Oversized:
    """A test double of plan's peak model: more than one sample never fits."""

    def peak_mib(self, micro_batch: int) -> tuple[float, float]:
        return (1.0 if micro_batch == 1 else 1e12), 0.0


def _prediction_double(kind: Optional[str]) -> None:
    """A test double of plan's prediction on this rank only (a rank whose prediction
    differs: another batch shape, less memory): ``'oversized'``, a micro-batch of more than
    one sample does not fit, so that ``micro_batches='auto'`` is agreed across ranks;
    ``'failing'``, the prediction raises, while the other ranks wait in that agreement;
    None: the real prediction (a previous scenario's double undone)."""

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError('no prediction on rank 1 (a test double)')

    RunStrategy.peak_model = {  # type: ignore[method-assign]
        'oversized': lambda self, *args, **kwargs: _Oversized(), 'failing': failing,
        None: _PEAK_MODEL}[kind]


def run(out_dir: str, scenario: dict) -> None:
    name = scenario['name']
    mode = scenario.get('mode', 'train')
    if 'unmark' in scenario and int(os.environ['RANK']) == 0:
        os.remove(osp.join(scenario['unmark'], MARKER_FILE))
    runner_box: list = []
    if 'kill_rank1_at_iter' in scenario and os.environ.get('TORCHELASTIC_RESTART_COUNT') in (
            None, '0'):  # the first attempt dies; a restart by the elastic agent does not
        _kill_rank1_during_save_at(scenario['kill_rank1_at_iter'], runner_box)
    _prediction_double(scenario.get('prediction_on_rank1') if os.environ['RANK'] == '1'
                       else None)
    forward_doubles(scenario.get('out_of_memory_on_rank1') if os.environ['RANK'] == '1'
                    else None, scenario.get('collective_in_forward', False))
    if 'retry_wait_s' in scenario:
        split_retry.WAIT_S = scenario['retry_wait_s']
    cfg = toy_config(scenario.get('work_dir', osp.join(out_dir, name)), **scenario.get('cfg', {}))
    # Runners built in the same second would share MessageHub's history
    # (docs/troubleshooting.md, Known limits).
    cfg.setdefault('experiment_name', name)
    if mode in ('test', 'test_reload'):
        cfg = _as_test_only(cfg)
    if mode == 'plain':  # MMEngine's Runner with DDP, the reference for DeepSpeedRunner
        init_distributed('pytorch', cfg['env_cfg']['dist_cfg'])  # MMEngine's needs CUDA
        cfg.pop('ds_config', None)
        cfg['model_wrapper_cfg'] = dict(type='MMDistributedDataParallel', device_ids=None,
                                        find_unused_parameters=True)
        if cfg.get('resume'):
            # MMEngine 0.10.7 resumes through torch.load's default, weights_only since
            # torch 2.6, which refuses MMEngine's own checkpoints (the trap DeepSpeedRunner
            # works around); the reference run opts out for its resume only.
            os.environ['TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'] = '1'
    else:
        cfg['runner_type'] = 'DeepSpeedRunner'
    cfg['launcher'] = 'pytorch'
    runner = RUNNERS.build(Config(cfg))
    runner_box.append(runner)
    result: dict[str, Any] = {}
    if mode in ('test', 'test_reload'):
        metrics = runner.test()
        if mode == 'test_reload':  # into the built (evaluation) engine, keys rewritten
            runner.load_checkpoint(scenario['reload'], strict=True,
                                   revise_keys=[(r'^backbone\.', '')])
            metrics = runner.test()
        result['test_metrics'] = {k: float(v) for k, v in metrics.items()}
        runner.model.eval()
        with torch.no_grad():
            result['probe_logits'] = runner.model(probe_inputs()).float().cpu()
    else:
        runner.train()
        rec = recorder(runner)
        hub = runner.message_hub
        result.update(
            losses=rec.losses, lrs=rec.lrs, metrics=rec.metrics,
            compiled_graphs=rec.compiled_graphs,
            group_lrs=[float(lr) for lr in runner.optim_wrapper.get_lr()['lr']],
            scalars=sorted(hub.log_scalars),
            grad_norm=float(hub.get_scalar('train/grad_norm').current())
            if 'train/grad_norm' in hub.log_scalars else None)
    module = runner.model.module
    result['head_used'] = getattr(module, 'head_used', None)
    result['phases'] = [seen for hook in runner.hooks for seen in getattr(hook, 'seen', [])]
    # a submodule read through the wrapper, as through the bare model in one process
    result['fc1_through_wrapper'] = getattr(runner.model, 'fc1', None) is getattr(module, 'fc1', 0)
    if mode == 'plain':
        result.update(state=model_state(module), shapes={k: tuple(v.shape) for k, v in
                                                         module.state_dict().items()})
        torch.save(result, osp.join(out_dir, f'{name}.rank{runner.rank}.pt'))
        os.environ.pop('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', None)
        return
    engine = runner.strategy.engines()['model']
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        state = model_state(module)
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    result.update(
        shapes=shapes,
        state=state, world_size=runner.world_size, stage=engine.zero_optimization_stage(),
        param_dtype=str(next(module.parameters()).dtype), global_steps=engine.global_steps,
        has_optimizer=engine.client_optimizer is not None, ema=ema_state(runner),
        compiled=engine.is_compiled,
        zero_config=runner.strategy.specs.shared('zero_optimization'),
        engine_optimizer=type(engine.optimizer).__name__, backend=torch.distributed.get_backend(),
        accumulation=engine.gradient_accumulation_steps(),
        split=getattr(runner.strategy.virtual_ranks, 'split', None),
        retries=getattr(runner.model, 'split_retry', None) is not None,
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        backward_depth=getattr(engine.optimizer, '_backward_active_depth', None),
        out_of_memory_raised=OUT_OF_MEMORY_RAISED[0],
        wrapper=type(runner.model).__name__, module=type(module).__name__)
    torch.save(result, osp.join(out_dir, f'{name}.rank{runner.rank}.pt'))


if __name__ == '__main__':
    run_scenarios(run)
