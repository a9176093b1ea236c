"""hooks/monitor.py: ThroughputHook and the precision notes."""
from __future__ import annotations

from typing import Any

import pytest
from mmengine.logging import MessageHub

from mmengine_deepspeed.config.resolve import MMEngineSettings
from mmengine_deepspeed.engine.spec import EngineSpecs
from mmengine_deepspeed.strategy import RunStrategy


class _Strategy(RunStrategy):
    """The runner's strategy, its user's model and its prediction set by a test."""

    bare_model: Any = None  # type: ignore[assignment]


class _ThroughputRunner:
    """What ThroughputHook reads of a runner, without a process group."""

    def __init__(self, hooks: list) -> None:
        self.hooks = hooks
        self.iter = 0
        self.world_size = 1
        specs = EngineSpecs({'train_micro_batch_size_per_gpu': 4}, None,
                            {'model': MMEngineSettings()})
        specs.resolve(world_size=1)
        self.strategy = _Strategy(self, specs,  # type: ignore[arg-type]
                                  allow_unsafe_checkpoints=False, zero_init=True)
        self.model = type('Wrapped', (), {'module': type('M', (), {'tokens_per_sample': 16})()})()
        self.message_hub = MessageHub.get_instance('throughput_hook_test')


@pytest.mark.parametrize(('hooks', 'interval', 'reduced_at'), [
    ([], None, [0, 9, 19]),
    (['logger5'], None, [0, 4, 9, 14, 19]),
    (['logger5'], 7, [0, 6, 13]),
])
def test_throughput_hook_measures_peak_memory_when_logged(hooks: list, interval: Any,
                                                          reduced_at: list) -> None:
    """The peak memory (an all-reduce on several ranks) is measured only on the
    iterations whose log line prints it: LoggerHook's interval unless given."""
    from mmengine.hooks import LoggerHook

    from mmengine_deepspeed.hooks.monitor import ThroughputHook

    runner = _ThroughputRunner([LoggerHook(interval=5) for _ in hooks])
    hook = ThroughputHook(interval=interval)
    hook.before_train(runner)
    measured = []
    for it in range(20):
        runner.iter = it
        before = runner.message_hub.log_scalars.get('train/peak_mem_mb')
        count = before.data[1].sum() if before is not None else 0
        hook.after_train_iter(runner, it)
        after = runner.message_hub.log_scalars['train/peak_mem_mb'].data[1].sum()
        if after > count:
            measured.append(it)
    assert measured == reduced_at
    assert runner.message_hub.get_scalar('train/tokens_per_s').current() > 0
    with pytest.raises(ValueError, match='interval=0'):
        ThroughputHook(interval=0)


def _said_after(runner: Any, iterations: int = 12, step: Any = None) -> list[str]:
    """What ThroughputHook logs over ``iterations``; ``step`` runs between its hooks."""
    from mmengine_deepspeed.hooks.monitor import ThroughputHook

    lines: list[str] = []
    runner.logger = type('Logger', (), {'info': staticmethod(lines.append)})()
    hook = ThroughputHook()
    hook.before_train(runner)
    for it in range(iterations):
        runner.iter = it
        hook.before_train_iter(runner, it, {'inputs': 1})
        if step is not None:
            step()
        hook.after_train_iter(runner, it, {'inputs': 1})
    return lines


def test_the_plan_prediction_is_said_once_next_to_the_first_peak() -> None:
    runner = _ThroughputRunner([])
    runner.strategy.predicted_peak_mib = lambda batch: 612.4  # type: ignore[method-assign]
    lines = _said_after(runner)
    assert len(lines) == 1
    assert lines[0].startswith('peak memory per rank after the first iteration: ')
    assert '`mmengine-deepspeed plan` predicts 612 MiB for this configuration' in lines[0]


def test_a_model_the_meta_device_cannot_run_is_predicted_from_its_first_step() -> None:
    """The first iteration's saved tensors are counted (parameters left out) and handed to
    the prediction; later iterations are not counted; a failure never stops training."""
    import torch
    from mmengine.config import Config

    model = torch.nn.Linear(8, 16)
    runner = _ThroughputRunner([])
    runner.cfg, runner.strategy.bare_model = Config(), model  # type: ignore[attr-defined]
    calls: list[Any] = []

    def predicted_peak_mib(batch: Any, saved: Any = None) -> float:
        assert batch == {'inputs': 1}
        calls.append(saved)
        if saved is None:
            raise RuntimeError('Tensor.item() cannot be called on meta tensors')
        return 700.0

    def step() -> None:
        torch.relu(model(torch.ones(4, 8))).sum().backward()

    runner.strategy.predicted_peak_mib = predicted_peak_mib  # type: ignore[method-assign]
    lines = _said_after(runner, step=step)
    # addmm saves the input (4x8 fp32), relu its output (4x16 fp32); the weight is a parameter
    assert calls == [None, (4 * 8 * 4 + 4 * 16 * 4, 0)]
    assert len(lines) == 1 and 'predicts 700 MiB (the meta device cannot run this model ' \
        '(RuntimeError: Tensor.item() cannot be called on meta tensors): its activations ' \
        'measured in this first iteration)' in lines[0]
    # the prediction failing again is said, and training goes on
    runner.strategy.predicted_peak_mib = lambda batch, saved=None: 1 / 0  # type: ignore[method-assign]
    lines = _said_after(runner, step=step)
    assert len(lines) == 1 and 'no plan prediction (ZeroDivisionError: division by zero)' \
        in lines[0]


def test_a_compiled_model_is_not_counted() -> None:
    """Dynamo would have to trace the counting hooks: the log says why there is no figure."""
    from mmengine.config import Config

    runner = _ThroughputRunner([])
    runner.cfg = Config(dict(compile=True))  # type: ignore[attr-defined]

    def predicted_peak_mib(batch: Any, saved: Any = None) -> float:
        raise RuntimeError('Cannot copy out of meta tensor')

    runner.strategy.predicted_peak_mib = predicted_peak_mib  # type: ignore[method-assign]
    lines = _said_after(runner)
    assert len(lines) == 1 and 'no plan prediction on the meta device (RuntimeError: Cannot ' \
        'copy out of meta tensor; with `compile` the first step is not measured' in lines[0]
