"""The demo's validation metric: one number per validation, in the console, MMEngine's log
and scalars.json alike."""
from __future__ import annotations

import re

from mmengine.runner import LogProcessor

from mmengine_deepspeed.demo import ValLoss
from mmengine_deepspeed.plot import is_loss


def test_the_validation_metric_escapes_mmengines_smoothing() -> None:
    """MMEngine's LogProcessor averages keys matching its mean_pattern over its window, for
    validation metrics too: a metric named 'loss' was logged as the mean of the last
    validations (2.183) while the console showed this one's (2.013)."""
    pattern = LogProcessor().mean_pattern
    assert re.search(pattern, 'loss') is not None  # why the metric is not called so
    metrics = ValLoss().compute_metrics([2.0, 3.0])
    assert metrics == {'nll': 2.5}
    assert all(re.search(pattern, key) is None for key in metrics)
    assert is_loss('val/nll') and is_loss('loss') and not is_loss('val/accuracy')
