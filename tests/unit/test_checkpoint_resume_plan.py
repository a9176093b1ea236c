"""checkpoint/resume_plan.py: the resume plan, one test per kind, from the checkpoint on disk."""
from __future__ import annotations

import logging
import os.path as osp
from typing import Any

import pytest

from mmengine_deepspeed.checkpoint.layout import LAST_CHECKPOINT, CheckpointError
from mmengine_deepspeed.checkpoint.reshard import Sharding
from mmengine_deepspeed.checkpoint.resume_plan import ResumeKind, ResumePlan, resolve_plan
from tests.unit.test_checkpoint_files import make_checkpoint

LOGGER = logging.getLogger('plan-test')
ZERO2_ON_2 = Sharding(world_size=2, zero_stage=2)


def plan(tmp_path: Any, current: Sharding = ZERO2_ON_2, **kwargs: Any) -> ResumePlan:
    return resolve_plan(work_dir=str(tmp_path), current=current, logger=LOGGER,
                        **{'resume': True, 'path': None, **kwargs})


def test_nothing_without_resume_or_load_from(tmp_path: Any) -> None:
    assert plan(tmp_path, resume=False) == ResumePlan(ResumeKind.NONE)


def test_resume_with_an_empty_work_dir_starts_from_scratch(tmp_path: Any,
                                                           caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger='plan-test'):
        assert plan(tmp_path) == ResumePlan(ResumeKind.NONE)
    assert 'no complete checkpoint' in caplog.text


def test_load_from_without_resume_loads_weights(tmp_path: Any) -> None:
    assert plan(tmp_path, resume=False, path='w.pth') == ResumePlan(ResumeKind.WEIGHTS, 'w.pth')


def test_same_layout_resumes_everything(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'iter_4.pth'), world_size=2, zero_stage=2)
    assert plan(tmp_path, path=path) == ResumePlan(ResumeKind.FULL, path)


def test_latest_complete_checkpoint_is_found_and_incomplete_ones_skipped(
        tmp_path: Any, caplog: Any) -> None:
    done = make_checkpoint(str(tmp_path / 'iter_4.pth'), 4, world_size=2, zero_stage=2)
    half = make_checkpoint(str(tmp_path / 'iter_8.pth'), 8, complete=False, world_size=2,
                           zero_stage=2)
    with open(osp.join(tmp_path, LAST_CHECKPOINT), 'w') as f:
        f.write(half)
    with caplog.at_level(logging.WARNING, logger='plan-test'):
        assert plan(tmp_path) == ResumePlan(ResumeKind.FULL, done)
    assert f'Skipping incomplete checkpoint {half}' in caplog.text


def test_a_restarted_job_resumes_the_latest_checkpoint_whatever_the_config_says(
        tmp_path: Any, caplog: Any) -> None:
    """torchrun's --max-restarts: after a restart the latest complete checkpoint is resumed,
    over load_from; with none yet, the config's plan stands."""
    with caplog.at_level(logging.WARNING, logger='plan-test'):
        assert plan(tmp_path, resume=False, path='w.pth', restart=1) == \
            ResumePlan(ResumeKind.WEIGHTS, 'w.pth')
    assert 'Restart 1 of this job: no complete checkpoint' in caplog.text
    done = make_checkpoint(str(tmp_path / 'iter_4.pth'), 4, world_size=2, zero_stage=2)
    with caplog.at_level(logging.WARNING, logger='plan-test'):
        assert plan(tmp_path, resume=False, path='w.pth', restart=2) == \
            ResumePlan(ResumeKind.FULL, done)
    assert f'Restart 2 of this job: resuming from {done}' in caplog.text


def test_another_world_size_reshards_through_a_universal_checkpoint(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'iter_4.pth'), world_size=2, zero_stage=2)
    assert plan(tmp_path, Sharding(1, 2), path=path) == ResumePlan(ResumeKind.UNIVERSAL, path)


def test_zero0_state_is_whole_on_any_world_size(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'iter_4.pth'), world_size=2, zero_stage=0)
    assert plan(tmp_path, Sharding(1, 0), path=path) == ResumePlan(ResumeKind.FULL, path)


def test_weights_only_checkpoint_resumes_without_optimizer_state(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'iter_4.pth'), world_size=2, zero_stage=2,
                           optimizer_state=False)
    assert plan(tmp_path, Sharding(1, 3), path=path) == ResumePlan(ResumeKind.WEIGHTS_ONLY, path)


def test_an_impossible_layout_change_is_refused_when_planning(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'iter_4.pth'), world_size=2, zero_stage=2)
    with pytest.raises(CheckpointError, match='Changing between ZeRO-0 and ZeRO-1/2/3'):
        plan(tmp_path, Sharding(2, 0), path=path)
