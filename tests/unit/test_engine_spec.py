"""engine/spec.py: what MMEngine's config says per engine, and the specs' shared facts."""
from __future__ import annotations

import pytest
import torch
from mmengine.optim import OptimWrapper
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from mmengine_deepspeed.engine.spec import (
    EngineSpecs,
    as_plain_wrappers,
    engine_label,
    is_several,
    mmengine_settings,
)
from tests.toy_gan import ADAM, ToyGAN, gan_wrappers


def _adam(*modules: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for m in modules for p in m.parameters()], lr=0.1)


def test_settings_per_optimizer() -> None:
    sides = mmengine_settings(dict(batch_size=4), gan_wrappers(ToyGAN()), dict(generator=[]))
    assert {n: (s.accumulative_counts, s.clip_grad) for n, s in sides.items()} == {
        'generator': (2, None), 'discriminator': (1, {'max_norm': 1.0})}
    config = dict(constructor='SubmoduleOptimWrapperConstructor',
                  generator=dict(optimizer=ADAM, clip_grad=dict(max_norm=2.0)),
                  discriminator=dict(optimizer=ADAM))
    assert is_several(config)
    sides = mmengine_settings(None, config, None)
    assert sides['generator'].clip_grad == {'max_norm': 2.0}
    assert as_plain_wrappers(config)['discriminator']['type'] == 'OptimWrapper'


def test_several_configs_without_constructor_say_what_to_add() -> None:
    config = dict(generator=dict(optimizer=ADAM), discriminator=dict(optimizer=ADAM))
    with pytest.raises(ValueError, match="constructor='SubmoduleOptimWrapperConstructor'"):
        mmengine_settings(None, config, None)


def test_optimizer_fields_outside_optimizer_are_explained() -> None:
    with pytest.raises(ValueError, match=r'no "optimizer" key.*optimizer=dict\(type=\'SGD\''):
        mmengine_settings(None, dict(type='SGD', lr=0.2), None)


def test_one_built_wrapper_is_one_engine() -> None:
    wrapper = OptimWrapper(_adam(nn.Linear(2, 2)))
    assert list(mmengine_settings(None, wrapper, None)) == ['model']
    assert not is_several(wrapper)


def test_settings_from_config_dicts() -> None:
    side, = mmengine_settings(dict(batch_size=6), dict(type='OptimWrapper', accumulative_counts=2,
                                                    clip_grad=dict(max_norm=3.0),
                                                    optimizer=dict(type='SGD', lr=0.1)),
                           [{}]).values()
    assert (side.batch_size, side.accumulative_counts, side.clip_grad['max_norm'],
            side.optim_wrapper_type, side.has_optim_wrapper,
            side.has_param_scheduler) == (6, 2, 3.0, 'OptimWrapper', True, True)


def test_settings_from_built_objects() -> None:
    from mmengine.optim import OptimWrapper

    model = nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3,
                           clip_grad=dict(type='value', clip_value=1.0))
    side = mmengine_settings(DataLoader(list(range(8)), batch_size=5), wrapper, None)['model']
    assert (side.batch_size, side.accumulative_counts, side.clip_grad['type'],
            side.has_param_scheduler) == (5, 3, 'value', False)


def test_specs_resolve_each_engine_and_share_what_must_agree() -> None:
    wrappers = dict(constructor='SubmoduleOptimWrapperConstructor',
                    generator=dict(optimizer=dict(type='Adam', lr=0.1), accumulative_counts=2),
                    discriminator=dict(optimizer=dict(type='Adam', lr=0.1)))
    specs = EngineSpecs(dict(zero_optimization=dict(stage=2)), None,
                        mmengine_settings(dict(batch_size=4), wrappers, None))
    specs.resolve(world_size=2)
    assert [spec.name for spec in specs] == ['generator', 'discriminator']
    assert specs['generator'].ds_config['gradient_accumulation_steps'] == 2
    assert specs['discriminator'].ds_config['gradient_accumulation_steps'] == 1
    assert specs.zero_stage == 2 and specs.precision == 'fp32'
    assert specs.shared('train_micro_batch_size_per_gpu') == 4
    with pytest.raises(RuntimeError, match='disagree on gradient_accumulation_steps'):
        specs.shared('gradient_accumulation_steps')
    assert specs.several and engine_label('generator') == "optim_wrapper['generator']"
    assert engine_label('model') == 'optim_wrapper'
    specs.for_evaluation()
    assert [spec.name for spec in specs] == ['model'] and not specs.built
    assert not specs.several


def test_batch_size_of_a_loader_with_a_batch_sampler() -> None:
    """MMDetection's AspectRatioBatchSampler: the DataLoader's batch_size is None, the
    batch sampler holds it (the engine's micro batch, throughput and banner use it)."""
    data = list(range(8))
    loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, False))
    side, = mmengine_settings(loader, dict(optimizer=dict(type='SGD', lr=0.1)), None).values()
    assert side.batch_size == 3


def _resolved(ds_config: dict, world_size: int = 2) -> EngineSpecs:
    specs = EngineSpecs.of_run(ds_config, None, dict(batch_size=4),
                               dict(optimizer=dict(type='SGD', lr=0.1)), None)
    specs.resolve(world_size=world_size)
    return specs


def test_finishing_settles_a_copy_once() -> None:
    """The one step after resolution: the resolved config is never edited; what DeepSpeed
    gets is decided by the module, the optimizer and the resume plan, and only once."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    specs = _resolved({'zero_optimization': {'stage': 2}, 'bf16': {'enabled': True}})
    spec = specs['model']
    resolved = spec.ds_config
    spec.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    given = spec.finish(model, universal=True)
    assert 'zero_allow_untested_optimizer' not in resolved and 'checkpoint' not in resolved
    assert spec.ds_config is not resolved and spec.finished
    assert given['zero_allow_untested_optimizer'] is True
    assert given['checkpoint']['load_universal'] is True
    assert given['data_types']['buffer_dtype'] == 'bf16'  # BatchNorm under bf16
    with pytest.raises(RuntimeError, match='already finished'):
        spec.finish(model)
    with pytest.raises(RuntimeError, match='not resolved again'):
        specs.resolve(world_size=4)


def test_an_evaluation_engine_finishes_at_zero_0_without_a_universal_load() -> None:
    from torch import nn

    specs = _resolved({'zero_optimization': {'stage': 1}})
    given = specs['model'].finish(nn.Linear(2, 2), universal=True)
    assert given['zero_optimization']['stage'] == 0 and 'checkpoint' not in given


def test_resolution_runs_once_per_world_size_and_settings() -> None:
    specs = _resolved({'zero_optimization': {'stage': 2}})
    first = specs['model'].ds_config
    specs.resolve(world_size=2)
    assert specs['model'].ds_config is first  # not resolved again
    specs.use_settings({'model': specs['model'].settings})
    specs.resolve(world_size=2)
    assert specs['model'].ds_config is first  # same settings: kept
    specs.use_settings(mmengine_settings(dict(batch_size=8),
                                         dict(optimizer=dict(type='SGD', lr=0.1)), None))
    specs.resolve(world_size=2)
    assert specs['model'].ds_config['train_micro_batch_size_per_gpu'] == 8
