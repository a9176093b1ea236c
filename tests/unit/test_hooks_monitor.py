"""hooks/monitor.py: ThroughputHook and the precision notes."""
from __future__ import annotations

from typing import Any

import pytest
from mmengine.logging import MessageHub

from mmengine_deepspeed.config.resolve import MMEngineSettings
from mmengine_deepspeed.engine.spec import EngineSpecs


class _ThroughputRunner:
    """What ThroughputHook reads of a runner, without a process group."""

    def __init__(self, hooks: list) -> None:
        self.hooks = hooks
        self.iter = 0
        self.world_size = 1
        self.engine_specs = EngineSpecs({'train_micro_batch_size_per_gpu': 4}, None,
                                        {'model': MMEngineSettings()})
        self.engine_specs.resolve(world_size=1)
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


def test_emulated_bf16_is_named_with_its_cost_and_the_fix(monkeypatch: Any) -> None:
    """The CPU probe is replaced: this machine's CPU may compute bf16 natively."""
    import mmengine_deepspeed.hooks.monitor as monitor

    monkeypatch.setattr(monitor, 'native_bf16', lambda: False)
    note = monitor.precision_note(True, 'bf16', on_cuda=False)
    assert note is not None and 'emulated' in note and '"auto"' in note and 'slower' in note
    assert 'training in fp32' in str(monitor.precision_note('auto', 'fp32', on_cuda=False))
    assert monitor.precision_note(False, 'fp32', on_cuda=False) is None
    assert monitor.precision_note(True, 'bf16', on_cuda=True) is None
    monkeypatch.setattr(monitor, 'native_bf16', lambda: True)
    assert monitor.precision_note(True, 'bf16', on_cuda=False) is None


@pytest.mark.parametrize('prediction, said', [
    (612.4, '`mmengine-deepspeed plan` predicts 612 MiB for this configuration'),
    (RuntimeError('Cannot copy out of meta tensor'),
     'no plan prediction on the meta device (RuntimeError: Cannot copy out of meta tensor; '
     '`mmengine-deepspeed plan` measures this model with one real step'),
])
def test_the_plan_prediction_is_said_once_next_to_the_first_peak(prediction: Any,
                                                                  said: str) -> None:
    """A prediction that cannot be made is said so, and never stops training."""
    from mmengine_deepspeed.hooks.monitor import ThroughputHook

    lines: list[str] = []
    runner = _ThroughputRunner([])
    runner.logger = type('Logger', (), {'info': staticmethod(lines.append)})()  # type: ignore

    def predicted_peak_mib(batch: Any) -> float:
        assert batch == {'inputs': 1}
        if isinstance(prediction, Exception):
            raise prediction
        return prediction

    runner.predicted_peak_mib = predicted_peak_mib  # type: ignore[attr-defined]
    hook = ThroughputHook()
    hook.before_train(runner)
    for it in range(12):
        runner.iter = it
        hook.before_train_iter(runner, it, {'inputs': 1})
        hook.after_train_iter(runner, it)
    assert len(lines) == 1
    assert lines[0].startswith('peak memory per rank after the first iteration: ')
    assert said in lines[0]
