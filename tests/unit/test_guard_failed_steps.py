"""guard/failed_steps.py: the policy's config, what one rank sees of failed steps and the
limits, what is left out after a failed step, the exclude_samples key (the runs
themselves: tests/dist/test_nonfinite.py)."""
from __future__ import annotations

import json
import os.path as osp

import pytest

from mmengine_deepspeed.guard.failed_steps import (
    FailedStep,
    FailedStepWatch,
    NonFinitePolicy,
    exclude_samples_of,
    is_loss_key,
)


def test_the_policy_defaults_and_refuses_bad_keys_by_name() -> None:
    assert NonFinitePolicy.of(None) == NonFinitePolicy(policy='skip', max_consecutive=10)
    assert NonFinitePolicy.of(dict(policy='rollback', spike_zscore=6)).spike_zscore == 6
    for bad, message in ((dict(policy='ignore'), 'nonfinite.policy'),
                         (dict(max_consecutiv=3), "unknown keys \\['max_consecutiv'\\]"),
                         (dict(window=0), 'nonfinite.window=0'),
                         (dict(spike_zscore=6), 'needs policy="rollback"'),
                         (dict(policy='rollback', spike_zscore=-1), 'spike_zscore=-1'),
                         (dict(max_rollbacks=-1), 'max_rollbacks')):
        with pytest.raises(ValueError, match=message):
            NonFinitePolicy.of(bad)
    with pytest.raises(TypeError, match='nonfinite must be a dict'):
        NonFinitePolicy.of('skip')


def test_the_samples_left_out_are_the_failing_ranks_batches() -> None:
    step = FailedStep(4, skipped=True, batches={0: [1, 2], 1: [3, 4]})
    assert step.culprits() == [1, 2, 3, 4]  # gradients alone: every rank's batch
    step.losses[1] = {'train/loss': float('nan')}
    assert step.culprits() == [3, 4]
    step.spikes.append(0)
    assert step.culprits() == [1, 2, 3, 4]
    said = step.describe()
    assert said.startswith('iteration 5 (update skipped): rank 1: loss=nan; rank 0: loss spike')
    assert step.record()['losses'] == {'1': {'train/loss': 'nan'}}  # JSON has no NaN


def test_loss_keys_are_mmengines_parse_losses_ones() -> None:
    assert is_loss_key('train/loss') and is_loss_key('train/loss_cls')
    assert is_loss_key('train/generator.loss_gen')
    assert not is_loss_key('train/loss_scale') and not is_loss_key('train/grad_norm')
    assert not is_loss_key('val/loss')


def test_exclude_samples_from_a_list_or_a_file(tmp_path: object) -> None:
    assert exclude_samples_of([3, 1, 3]) == [1, 3]
    path = osp.join(str(tmp_path), 'excluded_samples.json')
    with open(path, 'w') as f:
        json.dump([7, 2], f)
    assert exclude_samples_of(path) == [2, 7]
    with pytest.raises(FileNotFoundError, match='exclude_samples='):
        exclude_samples_of(path + '.missing')
    with pytest.raises(ValueError, match='list of dataset indices'):
        exclude_samples_of([1, -2])


def test_fp16_loss_scaling_skips_are_counted_but_are_not_failed_steps() -> None:
    """fp16 needs CUDA, which this machine lacks: the watch is handed what an fp16
    engine's wrapper publishes. Twenty updates skipped by the loss scaler (finite losses)
    neither fail a step nor reach max_consecutive; a non-finite loss still does."""
    watch = FailedStepWatch(NonFinitePolicy(max_consecutive=3),
                            loss_scaled=['train/skipped_steps'])
    for iteration in range(20):
        watch.observe('train/skipped_steps', iteration, float(iteration + 1))
    assert not watch.seen and watch.limit_reached() is None and watch.skipped == 20
    watch.observe('train/loss', 21, float('inf'))
    assert watch.seen
    assert watch.take() == dict(skips=[], bad={21: {'train/loss': float('inf')}}, spikes=[])
    assert not watch.seen  # taken: the next report starts afresh
    plain = FailedStepWatch(NonFinitePolicy(max_consecutive=3))
    for iteration in range(3):  # fp32/bf16: each skip is a failed step
        plain.observe('train/skipped_steps', iteration, float(iteration + 1))
    assert plain.take()['skips'] == [0, 1, 2]
    assert plain.limit_reached() == '3 consecutive updates skipped (max_consecutive=3)'
    plain.observe('train/skipped_steps', 3, 3.0)  # an applied update ends the streak
    assert plain.limit_reached() is None


def test_reported_skips_count_toward_max_skipped_within_the_window() -> None:
    watch = FailedStepWatch(NonFinitePolicy(max_skipped=3, window=10))
    watch.reported([FailedStep(1, skipped=True), FailedStep(2)], iteration=2)
    watch.reported([FailedStep(5, skipped=True)], iteration=5)
    assert watch.limit_reached() is None
    watch.reported([FailedStep(11, skipped=True)], iteration=11)  # iteration 1 left the window
    assert watch.limit_reached() is None
    watch.reported([FailedStep(12, skipped=True)], iteration=12)
    assert watch.limit_reached() == '3 updates skipped within 10 iterations (max_skipped=3)'
    watch.restart_limits()  # a rollback
    assert watch.limit_reached() is None


def test_a_loss_spike_is_a_failed_step_once_the_window_is_full() -> None:
    """The rollback policy's spike check, on the losses the hub hands the watch."""
    policy = NonFinitePolicy(policy='rollback', spike_zscore=6, spike_window=20)
    early = FailedStepWatch(policy)
    early.observe('train/loss', 0, 50.0)  # the window is not full yet: no verdict
    assert not early.seen
    watch = FailedStepWatch(policy)
    for iteration in range(20):
        watch.observe('train/loss', iteration, 1.0 + 0.01 * ((iteration * 7) % 5))
    watch.observe('train/loss', 20, 1.03)
    watch.observe('train/loss', 21, 5.0)
    watch.observe('train/loss_cls', 22, 9.0)  # the total loss only
    watch.observe('train/loss', 23, 1.02)  # the spike stayed out of the window
    assert watch.take()['spikes'] == [21]
    assert FailedStepWatch.watches('train/loss_cls') and FailedStepWatch.watches(
        'train/gen.skipped_steps') and not FailedStepWatch.watches('train/loss_scale')
