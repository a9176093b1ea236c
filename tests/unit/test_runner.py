"""DeepSpeedRunner's own checks (runner.py): bad input refused before any process work."""
from __future__ import annotations

from typing import Any

import pytest

from mmengine_deepspeed import DeepSpeedRunner, DsConfigError
from tests.helpers import toy_config


def test_bad_ds_config_fails_before_any_process_work(tmp_path: Any) -> None:
    from mmengine_deepspeed import dist

    work_dir = tmp_path / 'never_created'
    cfg = toy_config(str(work_dir), ds_config={'zero_optimisation': {'stage': 3}})
    worlds = dist._worlds_created[0]  # other tests of this process may have made one
    with pytest.raises(DsConfigError, match="Did you mean 'zero_optimization'"):
        DeepSpeedRunner(**cfg)
    assert not work_dir.exists()
    assert dist._worlds_created[0] == worlds  # no process group was created


def test_runner_reads_ds_config_from_cfg(tmp_path: Any) -> None:
    """``from_cfg`` passes ``cfg``; the runner takes ``cfg.ds_config`` from there."""
    cfg = toy_config(str(tmp_path / 'w'), ds_config={'bf17': {'enabled': True}})
    ds_config = cfg.pop('ds_config')
    with pytest.raises(DsConfigError, match="unknown key 'bf17'"):
        DeepSpeedRunner(**cfg, cfg=dict(cfg, ds_config=ds_config))


def test_amp_optim_wrapper_is_refused_early(tmp_path: Any) -> None:
    cfg = toy_config(str(tmp_path / 'w'), ds_config={})
    cfg['optim_wrapper']['type'] = 'AmpOptimWrapper'
    with pytest.raises(DsConfigError, match='bf16=dict'):
        DeepSpeedRunner(**cfg)


def test_train_cfg_with_type_and_by_epoch_is_refused_as_mmengine_does(tmp_path: Any) -> None:
    runner = DeepSpeedRunner(**toy_config(str(tmp_path)))
    with pytest.raises(RuntimeError, match='Only one of `type` or `by_epoch`'):
        runner.build_train_loop(dict(type='EpochBasedTrainLoop', by_epoch=True, max_epochs=1))


def test_runners_of_the_same_second_get_their_own_logger_and_message_hub(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """MMEngine names an experiment after its start second: two runners of that second
    shared one MessageHub (history, best score) and one logger (whose duplicate filter then
    swallowed the second run's warnings)."""
    import time

    monkeypatch.setattr(time, 'strftime', lambda *args: '20261204_120000')
    first = DeepSpeedRunner(**toy_config(str(tmp_path / 'a'), experiment_name='sweep'))
    second = DeepSpeedRunner(**toy_config(str(tmp_path / 'b'), experiment_name='sweep'))
    assert first.experiment_name == 'sweep_20261204_120000'
    assert second.experiment_name == 'sweep_20261204_120000_2'
    assert first.message_hub is not second.message_hub
    assert first.logger is not second.logger
