"""hooks/nonfinite.py: what the hook makes of the values the message hub hands it (the
runs themselves: tests/dist/test_nonfinite.py)."""
from __future__ import annotations

from mmengine_deepspeed.hooks.failed_steps import NonFinitePolicy
from mmengine_deepspeed.hooks.nonfinite import NonFiniteHook


def test_fp16_loss_scaling_skips_are_counted_but_are_not_failed_steps() -> None:
    """fp16 needs CUDA, which this machine lacks: the hook's observer is driven by hand
    with what an fp16 engine's wrapper publishes. Twenty updates skipped by the loss
    scaler (finite losses) neither fail a step nor reach max_consecutive; a non-finite loss
    still does."""
    hook = NonFiniteHook(NonFinitePolicy(max_consecutive=3))
    hook._loss_scaled = {'train/skipped_steps'}
    for iteration in range(20):
        hook._observe('train/skipped_steps', iteration, float(iteration + 1))
    assert hook._skips == [] and hook._limit_reached() is None
    assert hook._counts['train/skipped_steps'] == 20.0
    hook._observe('train/loss', 21, float('inf'))
    assert hook._bad == {21: {'train/loss': float('inf')}}
    plain = NonFiniteHook(NonFinitePolicy(max_consecutive=3))
    for iteration in range(3):  # fp32/bf16: each skip is a failed step
        plain._observe('train/skipped_steps', iteration, float(iteration + 1))
    assert plain._skips == [0, 1, 2]
    assert plain._limit_reached() == '3 consecutive updates skipped (max_consecutive=3)'


def test_a_loss_spike_is_a_failed_step_once_the_window_is_full() -> None:
    """The rollback policy's spike check, on the losses the hub hands its observer."""
    hook = NonFiniteHook(NonFinitePolicy(policy='rollback', spike_zscore=6, spike_window=20))
    losses = [1.0 + 0.01 * ((i * 7) % 5) for i in range(20)]
    hook._observe('train/loss', 0, 50.0)  # the window is not full yet: no verdict
    assert hook._spikes == []
    hook._losses.clear()
    for iteration, loss in enumerate(losses):
        hook._observe('train/loss', iteration, loss)
    hook._observe('train/loss', 20, 1.03)
    hook._observe('train/loss', 21, 5.0)
    hook._observe('train/loss_cls', 22, 9.0)  # the total loss only
    assert hook._spikes == [21]
