"""Model + optimizer(s) + ds_config -> named DeepSpeed engines.

A model with one optimizer gets one engine around the whole model, named
``'model'``. A model with several (an ``OptimWrapperDict``: a GAN's generator
and discriminator) gets one engine per optimizer, around the submodule that
optimizer owns; the model's own ``train_step`` keeps calling its submodules
directly and steps each optim wrapper it is given. Parameters in no optimizer
(an EMA copy of the generator, a frozen encoder) stay plain.

Calling a submodule directly, not through ``engine.forward``, is what makes
several engines work: ``engine.forward`` hooks the engine's backward prologue
onto its outputs, so a generator loss that flows through the discriminator
would start the discriminator engine's backward too (and ZeRO-0 refuses that).
Each optim wrapper starts its own engine's backward from its loss instead
(``optim_wrapper.begin_backward_at``); tests/dist/test_gan.py compares against
MMEngine's plain Runner at every stage.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from mmengine.model import convert_sync_batchnorm, is_model_wrapper, revert_sync_batchnorm
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from ..checkpoint.layout import SINGLE_ENGINE
from ..compat import accumulative_counts
from ..config.model_settings import fit_to_model
from ..config.resolve import MMEngineSide, zero_stage
from ..zero.zero_dim import engine_config, initializable
from .optim_wrapper import DeepSpeedOptimWrapper
from .wrapper import DeepSpeedEngineWrapper, cast_floating

# torch optimizers that update each element from its own gradient and state
# only, and therefore behave the same on ZeRO's flattened partitions. DeepSpeed
# asks for ``zero_allow_untested_optimizer`` for all but Adam(W)/Adagrad; for
# these we set it, for anything else (LARS, LAMB, Shampoo...) the user decides.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.RMSprop, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
)

# Keys of a several-optimizer ``optim_wrapper`` config that are not optimizer names.
WRAPPER_DICT_OPTIONS = ('constructor', 'paramwise_cfg')


def _batch_size(dataloader: Any) -> Optional[int]:
    if isinstance(dataloader, DataLoader):
        return dataloader.batch_size
    if isinstance(dataloader, dict):
        return dataloader.get('batch_size')
    return None


def is_several(optim_wrapper: Any) -> bool:
    """Whether ``optim_wrapper`` (object or config) defines several optimizers."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        return True
    if not isinstance(optim_wrapper, dict) or 'optimizer' in optim_wrapper:
        return False
    named = [v for k, v in optim_wrapper.items() if k not in WRAPPER_DICT_OPTIONS]
    return bool(named) and all(isinstance(v, (dict, OptimWrapper)) for v in named)


def mmengine_sides(train_dataloader: Any, optim_wrapper: Any,
                   param_scheduler: Any) -> dict[str, MMEngineSide]:
    """What the MMEngine config says about batch, accumulation and clipping, per engine.

    Args:
        train_dataloader (DataLoader | dict | None): Runner argument.
        optim_wrapper (OptimWrapper | OptimWrapperDict | dict | None):
            Runner argument; several optimizers give one entry each.
        param_scheduler (Any): Runner argument.

    Returns:
        dict[str, MMEngineSide]: By engine name (``'model'`` for one).
    """
    batch_size = _batch_size(train_dataloader)
    has_scheduler = param_scheduler is not None

    def side(wrapper: Any) -> MMEngineSide:
        if isinstance(wrapper, OptimWrapper):
            clip = wrapper.clip_grad_kwargs
            if clip and getattr(wrapper, 'grad_name', 'grad_norm') == 'grad_value':
                clip = dict(clip, type='value')
            return MMEngineSide(batch_size=batch_size,
                                accumulative_counts=accumulative_counts(wrapper),
                                clip_grad=clip or None,
                                optim_wrapper_type=type(wrapper).__name__,
                                has_optim_wrapper=True, has_param_scheduler=has_scheduler)
        cfg = wrapper or {}
        return MMEngineSide(batch_size=batch_size,
                            accumulative_counts=cfg.get('accumulative_counts'),
                            clip_grad=cfg.get('clip_grad'), optim_wrapper_type=cfg.get('type'),
                            has_optim_wrapper=wrapper is not None,
                            has_param_scheduler=has_scheduler)

    if isinstance(optim_wrapper, dict) and not is_several(optim_wrapper) and optim_wrapper \
            and 'optimizer' not in optim_wrapper and 'constructor' not in optim_wrapper:
        raise ValueError(
            f'optim_wrapper={dict(optim_wrapper)} has no "optimizer" key: MMEngine expects the '
            'optimizer inside it, e.g. optim_wrapper=dict(optimizer=dict(type=\'SGD\', lr=0.2)). '
            'For several optimizers give one such dict per submodule, e.g. '
            "optim_wrapper=dict(constructor='SubmoduleOptimWrapperConstructor', "
            'generator=dict(optimizer=...), discriminator=dict(optimizer=...)).')
    if not is_several(optim_wrapper):
        return {SINGLE_ENGINE: side(optim_wrapper)}
    items = (optim_wrapper.optim_wrappers.items() if isinstance(optim_wrapper, OptimWrapperDict)
             else [(k, v) for k, v in optim_wrapper.items() if k not in WRAPPER_DICT_OPTIONS])
    configs = [k for k, v in items if isinstance(v, dict)]
    if configs and 'constructor' not in optim_wrapper:
        raise ValueError(
            f'optim_wrapper defines several optimizers ({", ".join(configs)}) as configs without '
            "a constructor; add constructor='SubmoduleOptimWrapperConstructor' (one optimizer "
            'per submodule named by each key), or pass built OptimWrapper objects.')
    return {name: side(wrapper) for name, wrapper in items}


def as_plain_wrappers(optim_wrapper: Any) -> Any:
    """``optim_wrapper`` config with each wrapper built as MMEngine's ``OptimWrapper``.

    ``DeepSpeedOptimWrapper`` needs its engine, which exists only after the
    optimizer is built; the runner wraps the built optimizers afterwards.
    """
    if not isinstance(optim_wrapper, dict):
        return optim_wrapper
    if not is_several(optim_wrapper):
        return dict(optim_wrapper, type='OptimWrapper')
    return {k: dict(v, type='OptimWrapper') if k not in WRAPPER_DICT_OPTIONS else v
            for k, v in optim_wrapper.items()}


def named_optimizers(built: Any) -> dict[str, Optimizer]:
    """The optimizers MMEngine built, by engine name."""
    if isinstance(built, OptimWrapperDict):
        return {name: wrapper.optimizer for name, wrapper in built.optim_wrappers.items()}
    return {SINGLE_ENGINE: built.optimizer}


def owned_submodules(model: nn.Module,
                     optimizers: Mapping[str, Optional[Optimizer]]) -> dict[str, str]:
    """The submodule each optimizer's engine is built around, by path in ``model``.

    The key names the submodule when it holds all of the optimizer's
    parameters and none of another's; otherwise the smallest such submodule
    (the shallowest of equal ones) is taken.

    Args:
        model (nn.Module): The user's model.
        optimizers (Mapping[str, Optimizer | None]): The built optimizers
            by name (None: an evaluation engine, always the whole model).

    Returns:
        dict[str, str]: ``{name: submodule path}``; ``{'model': ''}`` for one
        optimizer (an engine around the whole model).
    """
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for key, optimizer in optimizers.items():
        groups = optimizer.param_groups if optimizer is not None else []
        foreign = [p for group in groups for p in group['params'] if id(p) not in names]
        if foreign:
            label = 'optim_wrapper' if key == SINGLE_ENGINE else f'optim_wrapper[{key!r}]'
            shapes = ', '.join(str(list(p.shape)) for p in foreign[:3])
            raise ValueError(
                f'{label} optimizes {len(foreign)} parameters that are not the model\'s (shapes '
                f'{shapes}{", ..." if len(foreign) > 3 else ""}): its optimizer was built on '
                'another instance of the model. Build it on the parameters of the model the '
                'runner trains (runner.model), or give optim_wrapper as a config so that '
                'MMEngine builds it.')
    if list(optimizers) == [SINGLE_ENGINE]:
        return {SINGLE_ENGINE: ''}
    owned: dict[str, set[int]] = {}
    for key, optimizer in optimizers.items():
        groups = optimizer.param_groups if optimizer is not None else []
        ids = {id(p) for group in groups for p in group['params']}
        for other, other_ids in owned.items():
            shared = ids & other_ids
            if shared:
                raise ValueError(
                    f'Parameter {names[next(iter(shared))]!r} (and {len(shared) - 1} more) is in '
                    f'both optim_wrapper[{other!r}] and optim_wrapper[{key!r}]; DeepSpeed builds '
                    'one engine per optimizer, so each parameter must belong to one optimizer. '
                    'Give each optimizer the parameters of its own submodule.')
        owned[key] = ids
    return {key: _owner(model, key, ids, set().union(*(v for k, v in owned.items() if k != key)),
                        names)
            for key, ids in owned.items()}


def _owner(model: nn.Module, key: str, ids: set[int], others: set[int],
           names: dict[int, str]) -> str:
    candidates: list[tuple[int, int, str]] = []
    for path, module in model.named_modules():
        held = {id(p) for p in module.parameters()}
        if path and ids <= held and not held & others:
            candidates.append((len(held), path.count('.'), path))
    if any(path == key for *_, path in candidates):
        return key
    if candidates:
        return min(candidates)[2]
    spread = sorted({names[i].rsplit('.', 1)[0] for i in ids})
    raise ValueError(
        f'optim_wrapper[{key!r}] optimizes parameters of {", ".join(spread[:4])}, and no '
        'submodule holds them all without parameters of another optimizer. DeepSpeed builds one '
        'engine per optimizer around one submodule: give each optimizer the parameters of one '
        'submodule (its key naming it, e.g. "generator"), or merge the optimizers.')


def evaluation_stage(configs: Mapping[str, dict]) -> str:
    """Use ZeRO-0 for an evaluation engine asked for ZeRO-1/2; returns the log line.

    ZeRO-1/2 partition optimizer states and gradients only, and DeepSpeed
    refuses them without an optimizer; the weights are the same at stage 0.
    """
    stage = zero_stage(next(iter(configs.values())))
    for ds_config in configs.values():
        ds_config['zero_optimization']['stage'] = 0
    return (f'No optimizer (val/test only): ZeRO-{stage} has nothing to partition, using '
            'ZeRO-0 for this engine.')


def build_engine(module: nn.Module, optimizer: Optional[Optimizer],
                 ds_config: dict) -> DeepSpeedEngine:
    """``deepspeed.initialize`` around ``module`` with the settings it needs.

    Args:
        module (nn.Module): The whole model or one optimizer's submodule.
        optimizer (Optimizer, optional): Its optimizer; None for an
            evaluation engine.
        ds_config (dict): The resolved config, completed in place with the
            settings that depend on the module.

    Returns:
        DeepSpeedEngine: The engine.
    """
    if optimizer is not None and isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        ds_config.setdefault('zero_allow_untested_optimizer', True)
    fit_to_model(ds_config, module)
    with initializable(module, zero3=zero_stage(ds_config) == 3):
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                          config=engine_config(ds_config, module))
    return engine


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """Cast the floating inputs of ``module`` to ``dtype`` whenever it is called.

    Under bf16/fp16 a GAN's ``train_step`` hands its submodules fp32 noise
    and images; the single-engine path casts in the model wrapper instead.
    """
    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return module.register_forward_pre_hook(hook, with_kwargs=True)



def build_engines(model: nn.Module, optimizers: Mapping[str, Optional[Optimizer]],
                  configs: Mapping[str, dict], cast_dtype: Optional[torch.dtype]
                  ) -> tuple[dict[str, DeepSpeedEngine], dict[str, str], DeepSpeedEngineWrapper]:
    """One engine per optimizer, and the model wrapper MMEngine's loops drive.

    Args:
        model (nn.Module): The user's (bare) model.
        optimizers (Mapping[str, Optimizer | None]): By engine name;
            ``{'model': None}`` builds an evaluation engine.
        configs (Mapping[str, dict]): Each engine's resolved ds_config.
        cast_dtype (torch.dtype, optional): Compute dtype floating inputs
            are cast to (bf16/fp16), or None.

    Returns:
        tuple: The engines by name, their submodule paths, and the wrapper.
    """
    modules = owned_submodules(model, optimizers)
    if len(modules) > 1:
        # Parameters in no optimizer (an EMA copy, frozen parts) join the
        # engines' device; each engine moves its own submodule.
        model.to(get_accelerator().current_device_name())
    engines = {name: build_engine(model.get_submodule(path), optimizers[name], configs[name])
               for name, path in modules.items()}
    first = next(iter(engines.values()))
    if len(engines) == 1:
        return engines, modules, DeepSpeedEngineWrapper(first, cast_dtype)
    if cast_dtype is not None:
        for engine in engines.values():
            cast_inputs(engine.module, cast_dtype)
    return engines, modules, DeepSpeedEngineWrapper(first, cast_dtype, model=model,
                                                    engines=engines)


def wrap_optimizers(engines: Mapping[str, DeepSpeedEngine], optimizers: Mapping[str, Optimizer],
                    configs: Mapping[str, dict], find_unused_parameters: bool,
                    own_train_step: bool) -> Union[DeepSpeedOptimWrapper, OptimWrapperDict]:
    """The optim wrapper(s) the train loop steps with: one per engine.

    Args:
        engines (Mapping[str, DeepSpeedEngine]): From :func:`build_engines`.
        optimizers (Mapping[str, Optimizer]): The optimizers they own.
        configs (Mapping[str, dict]): Each engine's resolved ds_config
            (accumulation and clipping per optimizer).
        find_unused_parameters (bool): See :class:`DeepSpeedOptimWrapper`.
        own_train_step (bool): The model overrides ``train_step`` (its
            losses do not come from ``engine.forward``).

    Returns:
        DeepSpeedOptimWrapper | OptimWrapperDict: One wrapper, or one per
        optimizer by name.
    """
    wrappers = {
        name: DeepSpeedOptimWrapper(
            engines[name], optimizer,
            accumulative_counts=configs[name]['gradient_accumulation_steps'],
            clip_max_norm=float(configs[name]['gradient_clipping']),
            find_unused_parameters=find_unused_parameters,
            name=None if name == SINGLE_ENGINE else name,
            forward_through_engine=len(engines) == 1 and not own_train_step)
        for name, optimizer in optimizers.items()}
    if SINGLE_ENGINE in wrappers:
        return wrappers[SINGLE_ENGINE]
    return OptimWrapperDict(**wrappers)


def left_unwrapped(model: nn.Module, model_wrapper_cfg: Optional[dict], world_size: int,
                   sync_bn: Optional[str], logger: Any) -> tuple[nn.Module, bool]:
    """The model as ``wrap_model`` leaves it: the engine needs the optimizer, built later.

    Args:
        model (nn.Module): The built model.
        model_wrapper_cfg (dict, optional): ``find_unused_parameters`` is
            honoured (ranks may use different parameters in an iteration);
            other DDP options are ignored with a warning.
        world_size (int): The number of ranks.
        sync_bn (str, optional): MMEngine's ``cfg.sync_bn``.
        logger (Any): The runner's logger.

    Returns:
        tuple: The model (SyncBN reverted for a single process, converted
        where ``sync_bn`` asks), and ``find_unused_parameters``.
    """
    if is_model_wrapper(model):
        raise TypeError(
            f'model is already wrapped in {type(model).__name__}; pass the bare model, '
            'DeepSpeedRunner wraps it in a DeepSpeed engine.')
    wrapper_cfg = dict(model_wrapper_cfg or {})
    find_unused = bool(wrapper_cfg.pop('find_unused_parameters', False))
    wrapper_cfg.pop('type', None)
    if wrapper_cfg:
        logger.warning(
            f'model_wrapper_cfg keys {sorted(wrapper_cfg)} are ignored: DeepSpeedRunner wraps '
            'the model in a DeepSpeed engine, configured by ds_config (only '
            'find_unused_parameters is honoured).')
    if world_size == 1:
        return revert_sync_batchnorm(model), find_unused
    return (convert_sync_batchnorm(model, sync_bn) if sync_bn is not None else model,
            find_unused)
