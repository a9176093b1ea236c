"""DeepSpeedRunner's own checks (runner.py): bad input refused before any process work."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from mmengine.hooks import CheckpointHook
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import OPTIM_WRAPPERS
from mmengine.runner import Runner

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


def test_hooks_are_registered_as_by_mmengines_runner(tmp_path: Any) -> None:
    """runner.hooks holds what Runner's holds (CheckpointHook as its DeepSpeed-aware
    subclass); the runner's own hooks run beside them, and re-registering MMEngine's
    defaults registers MMEngine's six."""
    cfg = toy_config(str(tmp_path / 'w'), custom_hooks=[dict(type='RecorderHook')],
                     checkpoint=dict(type='CheckpointHook', interval=2))
    ours = DeepSpeedRunner(**cfg, experiment_name='hooks_ours')
    theirs = Runner(**cfg, experiment_name='hooks_theirs')
    assert [type(h).__name__ for h in ours.hooks] == [
        'DeepSpeedCheckpointHook' if isinstance(h, CheckpointHook) else type(h).__name__
        for h in theirs.hooks]
    assert {type(h).__name__ for h in ours.added_hooks} == {
        'ThroughputHook', 'StreamsAfterValidationHook', 'PreemptionHook', 'NonFiniteHook'}
    assert 'Run beside them by DeepSpeedRunner' in ours.get_hooks_info()
    registered = ours.hooks
    registered.clear()
    ours.register_default_hooks()
    assert len(registered) == 6


def test_build_optim_wrapper_is_mmengines_for_any_wrapper(tmp_path: Any) -> None:
    """Called by the user: the config's own OptimWrapper type, and built wrappers in a
    dict (an OptimWrapperDict, on which param schedulers build per optimizer)."""
    runner = DeepSpeedRunner(**toy_config(str(tmp_path / 'w')), experiment_name='factory')
    model = runner.strategy.bare_model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    built = runner.build_optim_wrapper(dict(optimizer=optimizer, type='CountingOptimWrapper',
                                            accumulative_counts=2))
    assert type(built) is CountingOptimWrapper and built.optimizer is optimizer
    several = runner.build_optim_wrapper(dict(
        first=OptimWrapper(torch.optim.SGD(model.fc1.parameters(), lr=0.1)),
        second=OptimWrapper(torch.optim.Adam(model.fc2.parameters(), lr=0.01))))
    assert isinstance(several, OptimWrapperDict) and set(several.keys()) == {'first', 'second'}
    runner.optim_wrapper = several
    schedulers = runner.build_param_scheduler(dict(type='MultiStepLR', milestones=[1]))
    assert set(schedulers) == {'first', 'second'}
    assert schedulers['second'][0].optimizer is several['second']


@OPTIM_WRAPPERS.register_module(force=True)
class CountingOptimWrapper(OptimWrapper):
    """A user's own OptimWrapper type."""


@pytest.mark.parametrize('key,value', [('zero_init', 'no'), ('allow_unsafe_checkpoints', 1)])
def test_a_switch_that_is_not_a_bool_is_refused(tmp_path: Any, key: str, value: Any) -> None:
    """``bool('no')`` is True: a config's ``zero_init='no'`` silently meant the opposite."""
    cfg = toy_config(str(tmp_path / 'never_created'), ds_config={})
    with pytest.raises(ValueError, match=f'{key}={value!r}: give True or False'):
        DeepSpeedRunner(**cfg, cfg=dict(cfg, **{key: value}))
    with pytest.raises(ValueError, match=f'{key}={value!r}'):
        DeepSpeedRunner(**cfg, **{key: value})
    assert not (tmp_path / 'never_created').exists()


@pytest.mark.parametrize('ds_config', [{}, {'activation_checkpointing': {}}])
def test_activation_checkpointing_of_a_missing_module_is_refused_before_training(
        tmp_path: Any, ds_config: dict) -> None:
    """Through MMEngine's torch checkpoint (no DeepSpeed section) and DeepSpeed's: the name
    is refused naming the key, the name and the model's own names, before any engine."""
    cfg = toy_config(str(tmp_path), ds_config=ds_config, val=False)
    runner = DeepSpeedRunner(**cfg, cfg=dict(cfg, activation_checkpointing=['blocks.99']))
    with pytest.raises(ValueError, match=r"activation_checkpointing names 'blocks\.99'.*"
                                         r'ToyModel.*named_modules\(\)'):
        runner.train()
    assert not runner.strategy.specs.built and runner.iter == 0


def test_a_checkpoint_taken_in_train_records_the_whole_config(tmp_path: Any) -> None:
    """``activation_checkpointing`` with DeepSpeed's section, at ZeRO-0 in one process: the
    modules go through DeepSpeed's checkpoint (configuring it needed DeepSpeed's comm, set
    up only by ``deepspeed.initialize`` or ZeRO-3's construction: it failed with 'DeepSpeed
    backend not set'), and a checkpoint saved during ``train()`` records the key, which
    ``train()`` holds back from MMEngine's ``train()`` meanwhile (it recorded the config
    without it)."""
    from mmengine_deepspeed.checkpoint.layout import CLIENT_FILE, META_KEY
    from mmengine_deepspeed.checkpoint.safe_load import safe_load

    cfg = toy_config(str(tmp_path), ds_config={'activation_checkpointing': {}}, val=False,
                     max_iters=2, checkpoint=dict(type='CheckpointHook', interval=2,
                                                  by_epoch=False))
    runner = DeepSpeedRunner(**cfg, cfg=dict(cfg, activation_checkpointing=['fc1']))
    runner.train()
    assert runner.cfg.get('activation_checkpointing') == ['fc1']  # given back after train()
    meta = safe_load(str(tmp_path / 'iter_2.pth' / CLIENT_FILE))[META_KEY]
    assert 'activation_checkpointing' in meta['cfg'] and "'fc1'" in meta['cfg'], meta['cfg']


def test_excluded_samples_past_the_dataset_are_refused_before_the_first_step(
        tmp_path: Any) -> None:
    cfg = toy_config(str(tmp_path), ds_config={}, val=False, dataset_size=32)
    runner = DeepSpeedRunner(**cfg, exclude_samples=[3, 10**9])
    with pytest.raises(ValueError, match=r'exclude_samples names dataset indices \[1000000000\]'
                                         r', past the end of the training dataset \(32 samples'):
        runner.train()
    assert runner.iter == 0


def test_a_custom_train_loop_is_built_as_it_is_and_the_log_says_what_it_goes_without(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mmengine.registry import LOOPS
    from mmengine.runner import IterBasedTrainLoop

    class OwnIterLoop(IterBasedTrainLoop):
        """A user's loop class (not MMEngine's own, which the runner makes resumable)."""

    LOOPS.register_module(module=OwnIterLoop, force=True)
    cfg = toy_config(str(tmp_path), ds_config={}, val=False)
    cfg['train_cfg'] = dict(type='OwnIterLoop', max_iters=2)
    runner = DeepSpeedRunner(**cfg)
    warnings: list[str] = []
    monkeypatch.setattr(runner.logger, 'warning', warnings.append)
    assert type(runner.train_loop) is OwnIterLoop
    assert len(warnings) == 1 and warnings[0].startswith(
        'The train loop OwnIterLoop is not one DeepSpeedRunner resumes exactly')
    assert 'ResumableIterBasedTrainLoop' in warnings[0]


def test_nonfinite_hook_refuses_a_hub_it_cannot_observe(tmp_path: Any) -> None:
    """A runner whose build_message_hub gives MMEngine's own hub would never see a NaN loss."""
    from mmengine.logging import MessageHub

    class PlainHubRunner(DeepSpeedRunner):
        def build_message_hub(self, message_hub: Any = None) -> MessageHub:
            return MessageHub.get_instance(f'plain-{id(self)}')

    runner = PlainHubRunner(**toy_config(str(tmp_path), ds_config={}, val=False))
    with pytest.raises(TypeError, match='The message hub is a MessageHub; NonFiniteHook observes'):
        runner.train()
    assert runner.iter == 0


def test_edits_of_added_hooks_take_effect_at_the_next_call(tmp_path: Any) -> None:
    """docs/differences.md tells users to remove a hook from ``runner.added_hooks``: the
    order the runner keeps between calls followed only ``runner.hooks``."""
    from mmengine.hooks import Hook

    class Counting(Hook):
        calls = 0

        def before_run(self, runner: Any) -> None:
            self.calls += 1

    runner = DeepSpeedRunner(**toy_config(str(tmp_path), ds_config={}, val=False))
    counting = Counting()
    runner.call_hook('before_run')
    runner.added_hooks.append(counting)
    runner.call_hook('before_run')
    runner.added_hooks.remove(counting)
    runner.call_hook('before_run')
    assert counting.calls == 1
