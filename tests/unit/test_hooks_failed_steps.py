"""hooks/failed_steps.py: the policy's config, what is left out after a failed step, the
exclude_samples key (the runs themselves: tests/dist/test_nonfinite.py)."""
from __future__ import annotations

import json
import os.path as osp

import pytest

from mmengine_deepspeed.hooks.failed_steps import (
    FailedStep,
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
