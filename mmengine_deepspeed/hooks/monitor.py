"""What the logs show beyond MMEngine's: throughput, peak memory, the plan's prediction.

``ThroughputHook`` publishes ``train/samples_per_s`` (and ``train/tokens_per_s``
for models with a ``tokens_per_sample`` attribute) and ``train/peak_mem_mb``
(CUDA allocator peak, or the process's peak RSS on CPU; the maximum over ranks)
to the message hub, so LoggerHook prints them with the loss. DeepSpeedRunner
registers it.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from typing_extensions import override

from ..plan.saved import SavedTensorCounter
from ..process_memory import peak_memory_mb
from ..strategy import agreement_of, strategy_of
from ..strategy.agreement import logging_interval


def _reason(error: Exception) -> str:
    """``Type: first line`` of an error, for a log line."""
    first = str(error).splitlines()[0] if str(error) else ''
    return f'{type(error).__name__}: {first}'.strip(': ')


@HOOKS.register_module()
class ThroughputHook(Hook):
    """Samples (tokens) per second and peak memory, for LoggerHook to print.

    Args:
        interval (int, optional): How often (iterations) the peak memory is
            taken over ranks (the run's :class:`~.agreement.Agreement`, on a
            CPU group: no device waits). None takes LoggerHook's interval, so
            that it runs as often as lines print it, not more (10 without a
            LoggerHook). Defaults to None.
    """

    priority = 'BELOW_NORMAL'

    def __init__(self, interval: Optional[int] = None):
        if interval is not None and interval < 1:
            raise ValueError(f'ThroughputHook interval={interval}: give a positive number of '
                             'iterations, or None to follow LoggerHook.')
        self.interval = interval
        self._reduce_every = interval or 10
        self._last: Optional[float] = None
        self._samples = 0  # per iteration over all ranks, and tokens per sample: before_train
        self._tokens: Optional[int] = None
        # the plan's peak, said once next to the first measured one; for a model the meta
        # device cannot run, from what the first iteration saved for backward
        self._prediction: Optional[str] = None
        self._counting: Optional[tuple[SavedTensorCounter, Any, str]] = None
        self._said = False

    @override
    def before_train(self, runner: Any) -> None:
        self._last = None
        # fixed for the run: read once, not per iteration
        strategy = strategy_of(runner, 'ThroughputHook')
        virtual = strategy.virtual_ranks  # a layout's: each a micro-batch of the iteration
        self._samples = strategy.specs.shared('train_micro_batch_size_per_gpu') \
            * runner.world_size * (virtual.micro_steps if virtual is not None else 1)
        self._tokens = getattr(runner.model.module, 'tokens_per_sample', None)
        if self.interval is None:
            self._reduce_every = logging_interval(runner)
        strategy.agreement.provide('peak_mem_mb', lambda: [peak_memory_mb()])

    @override
    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        if self._prediction is not None or self._counting is not None:
            return
        strategy = strategy_of(runner, 'ThroughputHook')
        try:
            self._prediction = (f'`mmengine-deepspeed plan` predicts '
                                f'{strategy.predicted_peak_mib(data_batch):.0f} MiB')
        except Exception as e:  # a prediction must never stop training
            why = _reason(e)
            if runner.cfg.get('compile'):  # dynamo traces no saved-tensor hooks: not counted
                self._prediction = (f'no plan prediction on the meta device ({why}; with '
                                    '`compile` the first step is not measured; `mmengine-'
                                    'deepspeed plan` measures this model with one real step)')
                return
            counter = SavedTensorCounter(strategy.bare_model)
            context = counter.hooks()
            context.__enter__()  # left in after_train_iter: this iteration is measured
            self._counting = (counter, context, why)

    def _measured_prediction(self, runner: Any, data_batch: Any) -> None:
        """The prediction from what this (first) iteration saved for backward."""
        assert self._counting is not None
        counter, context, why = self._counting
        context.__exit__(None, None, None)
        try:
            peak = strategy_of(runner, 'ThroughputHook').predicted_peak_mib(data_batch,
                                                                            counter.peak)
            self._prediction = (
                f'`mmengine-deepspeed plan` predicts {peak:.0f} MiB (the meta '
                f'device cannot run this model ({why}): its activations measured in this '
                'first iteration)')
        except Exception as e:  # a prediction must never stop training
            self._prediction = f'no plan prediction ({_reason(e)})'

    @override
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        now = time.perf_counter()
        hub = runner.message_hub
        if self._last is not None:
            elapsed = max(now - self._last, 1e-9)
            hub.update_scalar('train/samples_per_s', self._samples / elapsed)
            if self._tokens:
                hub.update_scalar('train/tokens_per_s', self._samples * self._tokens / elapsed)
        self._last = now
        if self._counting is not None and self._prediction is None:
            self._measured_prediction(runner, data_batch)
        iteration = runner.iter  # a property of a property: read once
        if (iteration + 1) % self._reduce_every == 0 or iteration == 0:
            peak = agreement_of(runner, 'ThroughputHook').agreed(iteration)['peak_mem_mb'][0]
            hub.update_scalar('train/peak_mem_mb', peak)
            if self._prediction is not None and not self._said:
                self._said = True
                runner.logger.info(f'peak memory per rank after the first iteration: '
                                   f'{peak:.0f} MiB; {self._prediction} for this '
                                   'configuration (its peak once training settles).')
