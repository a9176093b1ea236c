"""ds_config resolution: every fill rule and every refusal, message fragments asserted."""
from __future__ import annotations

import json
from typing import Any

import pytest
from mmengine.config import ConfigDict

from mmengine_deepspeed.config.resolve import (
    DsConfigError,
    MMEngineSettings,
    get_value,
    load_ds_config,
    precision,
    resolve_ds_config,
    zero_stage,
)

TRAINING = MMEngineSettings(batch_size=4, has_optim_wrapper=True, has_param_scheduler=True)


def resolve(ds: Any, side: MMEngineSettings = TRAINING, world_size: int | None = 2,
            cuda: bool = False, **kwargs: Any) -> dict:
    return resolve_ds_config(ds, side, world_size=world_size, cuda_available=cuda, **kwargs)


def refused(ds: Any, *fragments: str, side: MMEngineSettings = TRAINING, **kwargs: Any) -> None:
    with pytest.raises(DsConfigError) as info:
        resolve(ds, side, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


# --- filling "auto" and absent values from the MMEngine config -------------

def test_absent_values_are_filled_from_mmengine() -> None:
    side = MMEngineSettings(batch_size=8, accumulative_counts=3, clip_grad={'max_norm': 2.0},
                        has_optim_wrapper=True)
    ds = resolve({'zero_optimization': {'stage': 2}}, side, world_size=4)
    assert ds['train_micro_batch_size_per_gpu'] == 8
    assert ds['gradient_accumulation_steps'] == 3
    assert ds['gradient_clipping'] == 2.0
    assert ds['train_batch_size'] == 8 * 3 * 4


def test_auto_values_are_filled_from_mmengine() -> None:
    side = MMEngineSettings(batch_size=2, accumulative_counts=2, clip_grad={'max_norm': 1},
                        has_optim_wrapper=True)
    ds = resolve({'train_micro_batch_size_per_gpu': 'auto', 'gradient_accumulation_steps': 'auto',
                  'gradient_clipping': 'auto', 'train_batch_size': 'auto'}, side, world_size=2)
    assert (ds['train_micro_batch_size_per_gpu'], ds['gradient_accumulation_steps'],
            ds['gradient_clipping'], ds['train_batch_size']) == (2, 2, 1.0, 8)


def test_defaults_without_accumulation_or_clipping() -> None:
    ds = resolve({}, world_size=1)
    assert ds['gradient_accumulation_steps'] == 1
    assert ds['gradient_clipping'] == 0.0
    assert ds['train_batch_size'] == 4


def test_ds_accumulation_is_used_when_mmengine_is_silent() -> None:
    ds = resolve({'gradient_accumulation_steps': 4})
    assert ds['gradient_accumulation_steps'] == 4
    assert ds['train_batch_size'] == 4 * 4 * 2


def test_matching_explicit_values_are_accepted() -> None:
    side = MMEngineSettings(batch_size=4, accumulative_counts=2, clip_grad={'max_norm': 1.0},
                        has_optim_wrapper=True)
    ds = resolve({'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 2,
                  'gradient_clipping': 1.0, 'train_batch_size': 16}, side, world_size=2)
    assert ds['train_batch_size'] == 16


def test_without_world_size_train_batch_size_is_left_for_later() -> None:
    ds = resolve({'train_batch_size': 999}, world_size=None)
    assert ds['train_batch_size'] == 999
    refused({'train_batch_size': 999}, 'train_batch_size=999', 'world size (2) = 8')


def test_no_training_dataloader_defaults_micro_batch_to_one() -> None:
    ds = resolve({}, MMEngineSettings(), world_size=2)
    assert ds['train_micro_batch_size_per_gpu'] == 1


# --- explicit values that disagree with the MMEngine side -----------------

def test_micro_batch_mismatch_names_both_keys() -> None:
    refused({'train_micro_batch_size_per_gpu': 8}, 'ds_config.train_micro_batch_size_per_gpu=8',
            'train_dataloader.batch_size=4')


def test_accumulation_mismatch_names_both_keys() -> None:
    side = MMEngineSettings(batch_size=4, accumulative_counts=2, has_optim_wrapper=True)
    refused({'gradient_accumulation_steps': 4}, 'ds_config.gradient_accumulation_steps=4',
            'optim_wrapper.accumulative_counts=2', side=side)


def test_clipping_mismatch_names_both_keys() -> None:
    side = MMEngineSettings(batch_size=4, clip_grad={'max_norm': 1.0}, has_optim_wrapper=True)
    refused({'gradient_clipping': 5.0}, 'ds_config.gradient_clipping=5.0',
            'optim_wrapper.clip_grad.max_norm=1.0', side=side)


# --- what MMEngine owns -----------------------------------------------------

def test_optimizer_in_ds_config_is_refused() -> None:
    refused({'optimizer': {'type': 'Adam'}}, 'ds_config.optimizer', 'optim_wrapper.optimizer',
            'Remove "optimizer" from ds_config')


def test_scheduler_in_ds_config_is_refused_with_param_scheduler() -> None:
    refused({'scheduler': {'type': 'WarmupLR'}}, 'ds_config.scheduler', 'param_scheduler',
            'Remove "scheduler"')


def test_scheduler_in_ds_config_is_allowed_without_param_scheduler() -> None:
    side = MMEngineSettings(batch_size=4, has_optim_wrapper=True, has_param_scheduler=False)
    assert 'scheduler' in resolve({'scheduler': {'type': 'WarmupLR'}}, side)


# --- optim_wrapper settings DeepSpeed cannot honour -----------------------

def test_clip_by_value_is_refused() -> None:
    side = MMEngineSettings(clip_grad={'type': 'value', 'clip_value': 1.0}, has_optim_wrapper=True)
    refused({}, "clip_grad.type='value'", 'global norm', side=side)


def test_clip_norm_type_other_than_two_is_refused() -> None:
    side = MMEngineSettings(clip_grad={'max_norm': 1.0, 'norm_type': 1}, has_optim_wrapper=True)
    refused({}, 'norm_type=1', 'L2', side=side)


def test_clip_unknown_arguments_are_refused() -> None:
    side = MMEngineSettings(clip_grad={'max_norm': 1.0, 'error_if_nonfinite': True},
                        has_optim_wrapper=True)
    refused({}, "['error_if_nonfinite']", side=side)


def test_clip_without_positive_max_norm_is_refused() -> None:
    side = MMEngineSettings(clip_grad={'max_norm': 0}, has_optim_wrapper=True)
    refused({}, 'clip_grad.max_norm must be a positive number', side=side)


@pytest.mark.parametrize('wrapper', ['AmpOptimWrapper', 'ApexOptimWrapper'])
def test_amp_optim_wrappers_are_refused(wrapper: str) -> None:
    side = MMEngineSettings(optim_wrapper_type=wrapper, has_optim_wrapper=True)
    refused({}, f"optim_wrapper.type='{wrapper}'", 'bf16=dict(enabled=True)', side=side)


def test_unknown_optim_wrapper_type_is_refused() -> None:
    side = MMEngineSettings(optim_wrapper_type='ZeroRedundancyOptimizer', has_optim_wrapper=True)
    refused({}, "'ZeroRedundancyOptimizer' is not supported", 'OptimWrapper', side=side)


@pytest.mark.parametrize('wrapper', ['OptimWrapper', 'DeepSpeedOptimWrapper', None])
def test_plain_optim_wrappers_are_accepted(wrapper: str | None) -> None:
    resolve({}, MMEngineSettings(optim_wrapper_type=wrapper, has_optim_wrapper=True))


# --- structure and types ------------------------------------------------------

@pytest.mark.parametrize('stage', [-1, 4, '2', 2.0, True])
def test_zero_stage_outside_range_or_type_is_refused(stage: Any) -> None:
    refused({'zero_optimization': {'stage': stage}}, 'zero_optimization.stage must be one of')


@pytest.mark.parametrize('key', ['train_micro_batch_size_per_gpu', 'gradient_accumulation_steps',
                                 'train_batch_size'])
@pytest.mark.parametrize('value', [0, -2, '4', 1.5, True])
def test_batch_keys_must_be_positive_integers(key: str, value: Any) -> None:
    refused({key: value}, f'ds_config.{key} must be a positive integer or "auto"')


@pytest.mark.parametrize('value', [-1.0, 'big', False])
def test_gradient_clipping_type(value: Any) -> None:
    refused({'gradient_clipping': value}, 'ds_config.gradient_clipping must be a non-negative')


@pytest.mark.parametrize('section', ['zero_optimization', 'bf16', 'fp16'])
def test_sections_must_be_dicts(section: str) -> None:
    refused({section: True}, f'ds_config.{section} must be a dict')


def test_enabled_must_be_a_bool() -> None:
    refused({'fp16': {'enabled': 'yes'}}, 'ds_config.fp16.enabled must be true or false')


def test_steps_per_print_type() -> None:
    refused({'steps_per_print': 'often'}, 'ds_config.steps_per_print must be a positive integer')


def test_offload_device_is_checked() -> None:
    refused({'zero_optimization': {'stage': 2, 'offload_optimizer': {'device': 'gpu'}}},
            'offload_optimizer.device must be one of')


def test_offload_param_needs_stage_three() -> None:
    refused({'zero_optimization': {'stage': 2, 'offload_param': {'device': 'cpu'}}},
            'offload_param needs zero_optimization.stage 3')


def test_offload_config_is_accepted() -> None:
    ds = resolve({'zero_optimization': {'stage': 3, 'offload_param': {'device': 'cpu'},
                                        'offload_optimizer': {'device': 'cpu'}}})
    assert zero_stage(ds) == 3


def test_unknown_top_level_key_suggests_the_right_one() -> None:
    refused({'zero_optimisation': {'stage': 2}}, "unknown key 'zero_optimisation'",
            "Did you mean 'zero_optimization'?")


def test_unknown_top_level_key_without_close_match() -> None:
    with pytest.raises(DsConfigError) as info:
        resolve({'xyzzy': 1})
    assert "unknown key 'xyzzy'" in str(info.value)
    assert 'Did you mean' not in str(info.value)


def test_auto_in_a_key_we_cannot_fill_is_refused() -> None:
    refused({'zero_optimization': {'stage': 'auto'}},
            'ds_config.zero_optimization.stage is "auto"', 'train_micro_batch_size_per_gpu')


def test_pipeline_parallel_is_refused() -> None:
    refused({'pipeline': {'stages': 2}}, 'ds_config.pipeline', 'not supported')


# --- precision -------------------------------------------------------------------

def test_fp16_without_cuda_suggests_bf16() -> None:
    refused({'fp16': {'enabled': True}}, 'fp16.enabled is true', 'needs CUDA',
            'bf16=dict(enabled=True)', cuda=False)


def test_fp16_with_cuda_is_accepted() -> None:
    """The CUDA branch, decided by ``cuda_available`` (no GPU needed to test it)."""
    assert precision(resolve({'fp16': {'enabled': True}}, cuda=True)) == 'fp16'


def test_fp16_and_bf16_together_are_refused() -> None:
    refused({'fp16': {'enabled': True}, 'bf16': {'enabled': True}}, 'enable one of them',
            cuda=True)


def test_precision_names() -> None:
    assert precision(resolve({})) == 'fp32'
    assert precision(resolve({'bf16': {'enabled': True}})) == 'bf16'
    assert precision(resolve({'bf16': {'enabled': False}})) == 'fp32'


# --- DeepSpeed's log noise ----------------------------------------------------------

def test_steps_per_print_is_silenced_by_default() -> None:
    assert resolve({})['steps_per_print'] is None


def test_steps_per_print_is_kept_when_set() -> None:
    assert resolve({'steps_per_print': 50})['steps_per_print'] == 50


def test_deepspeeds_throughput_timer_is_off_unless_asked_for() -> None:
    """Its synchronize at every forward and step would make a GPU wait; the engine reads it
    through DeepSpeed's own config class."""
    from deepspeed.utils.config import get_timers_config

    assert not get_timers_config(resolve({})).enabled
    asked = {'timers': {'throughput': {'enabled': True, 'synchronized': False}}}
    config = get_timers_config(resolve(asked))
    assert config.enabled and not config.synchronized
    assert get_timers_config(resolve({'wall_clock_breakdown': True})).enabled


# --- loading -------------------------------------------------------------------

def test_user_dict_is_deep_copied() -> None:
    user = {'zero_optimization': {'stage': 2}}
    ds = resolve(user)
    ds['zero_optimization']['stage'] = 3
    assert user == {'zero_optimization': {'stage': 2}}


def test_configdict_becomes_a_plain_dict() -> None:
    ds = load_ds_config(ConfigDict(zero_optimization=dict(stage=1)))
    assert type(ds) is dict and type(ds['zero_optimization']) is dict


def test_json_path_is_loaded(tmp_path: Any) -> None:
    path = tmp_path / 'ds.json'
    path.write_text(json.dumps({'zero_optimization': {'stage': 3}}))
    assert zero_stage(resolve(str(path))) == 3


def test_json_path_relative_to_the_config_file(tmp_path: Any) -> None:
    (tmp_path / 'ds.json').write_text(json.dumps({'bf16': {'enabled': True}}))
    assert precision(resolve('ds.json', config_dir=str(tmp_path))) == 'bf16'


def test_missing_json_names_the_paths_tried(tmp_path: Any) -> None:
    refused('nope.json', "'nope.json'", str(tmp_path / 'nope.json'), config_dir=str(tmp_path))


def test_invalid_json_names_the_file(tmp_path: Any) -> None:
    path = tmp_path / 'bad.json'
    path.write_text('{"zero_optimization": ')
    refused(str(path), str(path), 'not valid JSON')


def test_json_must_be_an_object(tmp_path: Any) -> None:
    path = tmp_path / 'list.json'
    path.write_text('[1, 2]')
    refused(str(path), 'must hold a JSON object')


def test_directory_instead_of_json_file(tmp_path: Any) -> None:
    refused(str(tmp_path), 'is a directory', 'JSON file')


def test_wrong_source_type() -> None:
    refused(3, 'must be a dict or the path of a JSON file')


def test_none_means_deepspeed_defaults() -> None:
    ds = resolve(None)
    assert zero_stage(ds) == 0 and precision(ds) == 'fp32'


def test_dotted_lookup() -> None:
    ds = {'zero_optimization': {'offload_param': {'device': 'cpu'}}}
    assert get_value(ds, 'zero_optimization.offload_param.device') == 'cpu'
    assert get_value(ds, 'zero_optimization.stage', 7) == 7
    assert get_value(ds, 'zero_optimization.offload_param.device.x') is None


# --- bf16 "auto": bf16 where the hardware computes it natively ----------------

@pytest.mark.parametrize('native', [True, False])
def test_bf16_auto_follows_the_hardware(native: bool) -> None:
    ds = resolve({'bf16': {'enabled': 'auto'}}, native_bf16=native)
    assert ds['bf16']['enabled'] is native
    assert precision(ds) == ('bf16' if native else 'fp32')


def test_bf16_enabled_must_be_a_bool_or_auto() -> None:
    refused({'bf16': {'enabled': 'yes'}}, 'ds_config.bf16.enabled must be true, false or "auto"')
    refused({'fp16': {'enabled': 'auto'}}, 'ds_config.fp16.enabled is "auto"')
