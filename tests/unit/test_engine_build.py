"""engine/build.py without a process group: how optimizers map to submodules, and the errors."""
from __future__ import annotations

import pytest
import torch
from mmengine.optim import OptimWrapperDict
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

import mmengine_deepspeed  # noqa: F401  registers the constructor
from mmengine_deepspeed.engine.build import left_unwrapped, owned_submodules
from mmengine_deepspeed.engine.spec import named_optimizers
from tests.toy_gan import ADAM, ToyGAN, gan_wrappers


def _adam(*modules: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for m in modules for p in m.parameters()], lr=0.1)


def test_each_key_names_its_submodule() -> None:
    model = ToyGAN()
    optimizers = named_optimizers(gan_wrappers(model))
    assert owned_submodules(model, optimizers) == {'generator': 'generator',
                                                   'discriminator': 'discriminator'}


def test_one_optimizer_is_the_whole_model() -> None:
    model = ToyGAN()
    assert owned_submodules(model, {'model': _adam(model)}) == {'model': ''}


def test_other_keys_take_the_smallest_submodule_holding_the_parameters() -> None:
    model = ToyGAN()
    optimizers = {'g': _adam(model.generator[0], model.generator[3]),
                  'd': _adam(model.discriminator[2])}
    # g: generator also holds its BatchNorm (in no optimizer); d: the last layer alone
    assert owned_submodules(model, optimizers) == {'g': 'generator', 'd': 'discriminator.2'}


def test_a_parameter_in_two_optimizers_is_refused() -> None:
    model = ToyGAN()
    optimizers = {'generator': _adam(model.generator, model.discriminator[0]),
                  'discriminator': _adam(model.discriminator)}
    with pytest.raises(ValueError, match=r"'discriminator\.0\.(weight|bias)'.*in both "
                                         r"optim_wrapper\['generator'\] and "
                                         r"optim_wrapper\['discriminator'\]"):
        owned_submodules(model, optimizers)


def test_an_optimizer_spanning_unrelated_modules_is_refused() -> None:
    model = ToyGAN()
    optimizers = {'a': _adam(model.generator[0], model.discriminator[0]),
                  'b': _adam(model.discriminator[2])}
    with pytest.raises(ValueError, match=r"optim_wrapper\['a'\] optimizes parameters of "
                                         r"discriminator\.0, generator\.0.*one submodule"):
        owned_submodules(model, optimizers)


def test_parameters_of_another_model_instance_are_refused() -> None:
    model = ToyGAN()
    optimizers = {'generator': _adam(ToyGAN().generator),
                  'discriminator': _adam(model.discriminator)}
    with pytest.raises(ValueError, match=r"optimizes 5 parameters that are not the model's"):
        owned_submodules(model, optimizers)


def test_one_optimizer_on_another_model_instance_is_refused_before_deepspeed() -> None:
    """DeepSpeed itself dies on it (KeyError at ZeRO-2, AttributeError 'partition_numel' at
    ZeRO-3) without saying which parameters."""
    model = ToyGAN()
    with pytest.raises(ValueError, match=r"^optim_wrapper optimizes \d+ parameters that are "
                                         r"not the model's \(shapes \[.*runner\.model"):
        owned_submodules(model, {'model': _adam(ToyGAN())})


def test_constructor_builds_one_wrapper_per_submodule_with_its_paramwise_cfg() -> None:
    model = ToyGAN()
    constructor = OPTIM_WRAPPER_CONSTRUCTORS.build(dict(
        type='SubmoduleOptimWrapperConstructor',
        optim_wrapper_cfg=dict(
            generator=dict(optimizer=ADAM, accumulative_counts=2),
            discriminator=dict(optimizer=dict(type='SGD', lr=0.5),
                               paramwise_cfg=dict(bias_lr_mult=0.1)))))
    wrappers = constructor(model)
    assert isinstance(wrappers, OptimWrapperDict)
    gen, disc = wrappers['generator'], wrappers['discriminator']
    assert gen._accumulative_counts == 2
    assert {id(p) for g in gen.optimizer.param_groups for p in g['params']} == \
        {id(p) for p in model.generator.parameters()}
    assert sorted(g['lr'] for g in disc.optimizer.param_groups) == pytest.approx([0.05, 0.05,
                                                                                 0.5, 0.5])


def test_constructor_names_a_missing_submodule() -> None:
    constructor = OPTIM_WRAPPER_CONSTRUCTORS.build(dict(
        type='SubmoduleOptimWrapperConstructor',
        optim_wrapper_cfg=dict(gen=dict(optimizer=ADAM))))
    with pytest.raises(ValueError, match=r"no submodule 'gen' \(its children: "
                                         r"data_preprocessor, generator"):
        constructor(ToyGAN())


def test_sync_batchnorm_on_the_cpu_becomes_batchnorm_with_a_warning() -> None:
    """MMSegmentation's configs use SyncBN; torch's SyncBatchNorm refuses CPU tensors, so
    a multi-rank CPU run gets BatchNorm (each rank's statistics) and is told so."""
    warnings: list[str] = []
    logger = type('Logger', (), {'warning': staticmethod(warnings.append)})()
    model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    model[1].weight.data.fill_(0.5)
    built, find_unused = left_unwrapped(model, None, world_size=2, sync_bn=None, logger=logger)
    norm = built[1]
    assert not isinstance(norm, nn.SyncBatchNorm)
    assert isinstance(norm, nn.modules.batchnorm._BatchNorm)
    assert torch.equal(norm.weight, torch.full((4,), 0.5)) and not find_unused
    assert len(warnings) == 1 and 'SyncBatchNorm needs CUDA' in warnings[0]
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    left_unwrapped(plain, None, world_size=2, sync_bn=None, logger=logger)
    assert len(warnings) == 1  # nothing to say for a model without it
