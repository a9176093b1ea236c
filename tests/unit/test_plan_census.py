"""plan/census.py: the model counted on the meta device, engines and optimizer states."""
from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope

import tests.toy_gan
import tests.toy_teacher  # noqa: F401  registers ToyTeacherModel
from mmengine_deepspeed.plan.census import census, import_scope, meta_model, optimizer_states
from tests.helpers import toy_config
from tests.toy_gan import gan_config


def _cfg(**optimizer: object) -> Config:
    cfg = Config(toy_config('/tmp/unused'))
    if optimizer:
        cfg.optim_wrapper = dict(optimizer=optimizer)
    return cfg


def test_the_model_is_built_on_meta_and_frozen_parameters_are_not_trained() -> None:
    cfg = _cfg(type='AdamW', lr=1e-3)
    model = meta_model(cfg)
    assert {p.device.type for p in model.parameters()} == {'meta'}
    (engine,) = census(cfg, model)
    whole = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 0
    assert (engine.name, engine.path, engine.params, engine.frozen) == ('model', '', whole, frozen)
    assert engine.trainable == whole - frozen
    assert engine.largest_layer == max(sum(p.numel() for p in m.parameters(recurse=False))
                                       for m in model.modules())
    assert engine.dtypes == {'float32': whole}


@pytest.mark.parametrize('optimizer, states', [
    (dict(type='SGD', lr=0.1), 0),
    (dict(type='SGD', lr=0.1, momentum=0.9), 1),
    (dict(type='AdamW', lr=1e-3), 2),
    (dict(type='Adam', lr=1e-3, amsgrad=True), 3),
    (dict(type='Adagrad', lr=1e-2), 1),
])
def test_optimizer_states_are_counted_by_one_real_step(optimizer: dict, states: int) -> None:
    cfg = _cfg(**optimizer)
    (engine,) = census(cfg, meta_model(cfg))
    assert (engine.optimizer, engine.states, engine.states_note) == \
        (optimizer['type'], states, None)


def test_an_optimizer_that_cannot_step_here_is_assumed_by_name_with_a_note() -> None:
    class FusedLambLike(torch.optim.Optimizer):
        def __init__(self, params: object, lr: float = 1e-3):
            super().__init__(params, dict(lr=lr))

        def step(self, closure: object = None) -> None:
            raise RuntimeError('needs its CUDA kernel')

    states, note = optimizer_states(FusedLambLike([torch.zeros(2, requires_grad=True)]))
    assert states == 2 and note is not None and 'FusedLambLike' in note


def test_several_optimizers_are_one_engine_each_around_their_submodule() -> None:
    cfg = Config(gan_config('/tmp/unused'))
    model = meta_model(cfg)
    engines = {e.name: e for e in census(cfg, model)}
    assert set(engines) == {'generator', 'discriminator'}
    for name, engine in engines.items():
        module = getattr(model, name)
        assert engine.path == name
        assert engine.params == engine.trainable == sum(p.numel() for p in module.parameters())
        assert engine.states == 2


def test_a_scope_s_models_and_datasets_are_imported_before_the_fixed_cost_is_read(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library registers its models where its registry's ``locations`` say; building from
    its scope imports them (MMDetection's: ~110 MiB). The runner reads the RSS the training
    log's prediction starts from after import_scope, so they are in it, as in plan's."""
    package = tmp_path / 'scopelib'
    (package / 'models').mkdir(parents=True)
    (package / '__init__.py').write_text('')
    (package / 'registry.py').write_text(
        'from mmengine.registry import MODELS as ROOT, Registry\n'
        "MODELS = Registry('model', parent=ROOT, scope='scopelib', "
        "locations=['scopelib.models'])\n")
    (package / 'models' / '__init__.py').write_text('IMPORTED = True\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for scope in (None, 'mmengine', 'not_an_installed_package', 'mmengine_deepspeed'):
        import_scope(scope)  # nothing to import, no warning
    assert 'scopelib.models' not in sys.modules
    import_scope('scopelib')
    assert sys.modules['scopelib.models'].IMPORTED
    assert DefaultScope.get_current_instance() is None or (
        DefaultScope.get_current_instance().scope_name != 'scopelib')


def test_an_averaged_model_updated_in_the_step_is_counted() -> None:
    """BYOL's target: ZeRO-3 gathers it and its source whole for each update."""
    cfg = Config(toy_config('/tmp/unused', model=dict(type='ToyTeacherModel')))
    model = meta_model(cfg)
    (engine,) = census(cfg, model)
    assert engine.averaged == sum(p.numel() for p in model.teacher.parameters()) > 0
    (plain,) = census(Config(toy_config('/tmp/unused')), meta_model(Config(toy_config('/tmp/x'))))
    assert plain.averaged == 0
