"""guard/monitor.py: the failed steps put together from each rank's view, and reported."""
from __future__ import annotations

import json
import logging
import math
from typing import Any

from mmengine_deepspeed.guard.failed_steps import FailedStep
from mmengine_deepspeed.guard.monitor import (
    STEPS_FILE,
    gather_failed_steps,
    report_failed_steps,
)


def test_one_rank_s_view_becomes_the_failed_steps_with_their_batches() -> None:
    """One process (no process group): its own view; a skipped update with a finite loss
    blames every known batch, a non-finite loss its rank's."""
    mine = dict(skips=[3, 7], bad={7: {'train/loss': math.nan}}, spikes=[])
    steps = gather_failed_steps(mine, 0, lambda it: [it * 10, it * 10 + 1])
    assert [step.iteration for step in steps] == [3, 7]
    assert steps[0].skipped and steps[0].losses == {} and steps[0].batches == {0: [30, 31]}
    assert steps[1].losses == {0: {'train/loss': math.nan}}
    assert steps[1].culprits() == [70, 71]


def test_the_report_is_a_log_line_and_a_jsonl_record_from_rank_0(tmp_path: Any,
                                                                   caplog: Any) -> None:
    step = FailedStep(4)
    step.skipped, step.batches = True, {0: [1, 2]}
    logger = logging.getLogger('guard-monitor-test')
    with caplog.at_level(logging.WARNING, logger='guard-monitor-test'):
        report_failed_steps([step], work_dir=str(tmp_path), rank=0, skipped=1, logger=logger)
        report_failed_steps([step], work_dir=str(tmp_path), rank=1, skipped=1, logger=logger)
    assert caplog.text.count('Steps that were not finite (skipped updates so far: 1') == 2
    assert 'iteration 5 (update skipped)' in caplog.text
    with open(tmp_path / STEPS_FILE) as f:
        records = [json.loads(line) for line in f]
    assert records == [step.record()]  # rank 1 wrote nothing
