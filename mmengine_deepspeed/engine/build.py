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

from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from mmengine.model import convert_sync_batchnorm, is_model_wrapper, revert_sync_batchnorm
from mmengine.optim import OptimWrapperDict
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ..compat import clipped_global_grad_norm
from ..config.resolve import DTYPES, zero_stage
from ..dist import cuda_available
from ..zero.in_step import update_on_whole_tensors
from ..zero.unused_params import untrace_parameterless_modules, zero3_unsupported
from ..zero.zero_dim import initializable
from .banner import banner, precision_note
from .norm_optimizers import PartitionedNormStep, check_for_zero, norm_math
from .offload import cpu_optimizer
from .optim_wrapper import DeepSpeedOptimWrapper
from .spec import ELEMENTWISE_OPTIMIZERS, SINGLE_ENGINE, EngineSpec, EngineSpecs, engine_label
from .wrapper import DeepSpeedEngineWrapper, cast_floating

# The dtype floating inputs are cast to, by precision.


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
            label = engine_label(key)
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


def build_engine(module: nn.Module, optimizer: Optional[Optimizer],
                 ds_config: dict) -> DeepSpeedEngine:
    """``deepspeed.initialize`` around ``module`` with the settings it needs.

    Args:
        module (nn.Module): The whole model or one optimizer's submodule.
        optimizer (Optimizer, optional): Its optimizer; None for an
            evaluation engine.
        ds_config (dict): The finished config (``EngineSpec.finish``).

    Returns:
        DeepSpeedEngine: The engine.
    """
    zero3 = zero_stage(ds_config) == 3
    with initializable(module, zero3=zero3):
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
    untrace_parameterless_modules(engine)
    if zero3 and optimizer is not None:
        update_on_whole_tensors(engine)
    return engine


def partitioned_norms(spec: EngineSpec) -> None:
    """A norm-reading optimizer (LARS, LAMB) steps each parameter with its whole norms on
    the partitions DeepSpeed hands it (``engine/norm_optimizers.py``)."""
    math_name = norm_math(spec.optimizer)
    if math_name is None:
        return
    stage = zero_stage(spec.ds_config)
    if stage == 3 and (spec.ds_config.get('fp16') or {}).get('enabled'):
        raise ValueError(
            f'{type(spec.optimizer).__name__} reads each parameter\'s norm, which ZeRO-3 in '
            'fp16 would take from loss-scaled gradients; at ZeRO-3 it is stepped per '
            'parameter in fp32 and bf16. Use bf16=dict(enabled=True) (or '
            'zero_optimization.stage=2).')
    PartitionedNormStep(
        spec.optimizer, math_name, stage,  # type: ignore[arg-type]
        lambda: clipped_global_grad_norm(spec.engine)
    ).install()


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """Cast the floating inputs of ``module`` to ``dtype`` whenever it is called.

    Under bf16/fp16 a GAN's ``train_step`` hands its submodules fp32 noise
    and images; the single-engine path casts in the model wrapper instead.
    """
    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return module.register_forward_pre_hook(hook, with_kwargs=True)



def build_engines(specs: EngineSpecs, model: nn.Module,
                  optimizers: Mapping[str, Optional[Optimizer]], *, world_size: int,
                  find_unused_parameters: bool, logger: Any,
                  before_partitioning: Callable[[EngineSpecs], None], universal: bool = False
                  ) -> tuple[DeepSpeedEngineWrapper, bool]:
    """Everything between MMEngine's optimizers and the model wrapper its loops drive.

    In this order: each engine's ds_config for this world size; ZeRO-3's
    refusal of ``find_unused_parameters``; DeepSpeed's CPU Adam where ZeRO
    offloads the optimizer; the submodule each optimizer owns;
    ``before_partitioning``; per engine its finished ds_config
    (``EngineSpec.finish``) and ``deepspeed.initialize``; the banner and the
    precision note.

    Args:
        specs (EngineSpecs): The runner's engines, completed in place.
        model (nn.Module): The user's (bare) model.
        optimizers (Mapping[str, Optimizer | None]): MMEngine's optimizers
            by engine name; ``{'model': None}`` builds an evaluation engine.
        world_size (int): The number of ranks.
        find_unused_parameters (bool): ``model_wrapper_cfg``'s option.
        logger (Any): The runner's logger.
        before_partitioning (Callable[[EngineSpecs], None]): The runner's
            steps that need the model whole (``load_from``, the EMA template,
            a universal checkpoint's conversion).
        universal (bool): The training engines load a universal checkpoint.
            Defaults to False.

    Returns:
        tuple: The model wrapper, and ``find_unused_parameters`` as it
        stands (off for ZeRO-3 training, which cannot honour it).
    """
    training = any(optimizer is not None for optimizer in optimizers.values())
    if not training:
        specs.for_evaluation()
    specs.resolve(world_size)
    unsupported = zero3_unsupported(specs.zero_stage)
    if find_unused_parameters and training and unsupported is not None:
        logger.warning(unsupported)
        find_unused_parameters = False
    if not training and specs.zero_stage in (1, 2):
        logger.info(f'No optimizer (val/test only): ZeRO-{specs.zero_stage} has nothing to '
                    'partition, using ZeRO-0 for this engine.')
    for spec in specs:
        spec.optimizer = optimizers.get(spec.name)
        if spec.optimizer is not None:
            spec.optimizer, note = cpu_optimizer(spec.optimizer, spec.ds_config)
            if note is not None:
                logger.info(note)
            partitioned_norms(spec)
            if not isinstance(spec.optimizer, ELEMENTWISE_OPTIMIZERS):
                note = check_for_zero(spec.optimizer, zero_stage(spec.ds_config),
                                      bool(spec.ds_config.get('zero_allow_untested_optimizer')))
                if note is not None:
                    logger.warning(note)
    for name, path in owned_submodules(model, {s.name: s.optimizer for s in specs}).items():
        specs[name].path = path
    before_partitioning(specs)
    several = specs.several
    if several:
        # Parameters in no optimizer (an EMA copy, frozen parts) join the
        # engines' device; each engine moves its own submodule.
        model.to(get_accelerator().current_device_name())
    for spec in specs:
        module = model.get_submodule(spec.path)
        spec.engine = build_engine(module, spec.optimizer,
                                   spec.finish(module, universal=universal))
        logger.info(banner(spec.ds_config, world_size, spec.engine.module, training,
                           name=spec.name if several else None))
    cast_dtype = None if specs.precision == 'fp32' else DTYPES[specs.precision]
    if several:
        for spec in specs:
            if cast_dtype is not None:
                cast_inputs(spec.engine.module, cast_dtype)  # type: ignore[union-attr]
        logger.info('One DeepSpeed engine per optimizer: ' + ', '.join(
            f'{name} -> model.{path}' for name, path in specs.modules().items()))
    note = precision_note(specs.bf16_requested(), specs.precision, cuda_available())
    if note is not None:
        logger.warning(note)
    return (DeepSpeedEngineWrapper(specs.engines(), cast_dtype, model=model if several else None),
            find_unused_parameters)


def wrap_optimizers(specs: EngineSpecs, find_unused_parameters: bool,
                    own_train_step: bool,
                    micro_steps: int = 1) -> Union[DeepSpeedOptimWrapper, OptimWrapperDict]:
    """The optim wrapper(s) the train loop steps with: one per engine.

    Args:
        specs (EngineSpecs): Built by :func:`build_engines` with optimizers
            (accumulation and clipping from each engine's ds_config).
        find_unused_parameters (bool): See :class:`DeepSpeedOptimWrapper`.
        own_train_step (bool): The model overrides ``train_step`` (its
            losses do not come from ``engine.forward``).
        micro_steps (int): Backwards per iteration (a layout's virtual ranks on this
            rank). Defaults to 1.

    Returns:
        DeepSpeedOptimWrapper | OptimWrapperDict: One wrapper, or one per
        optimizer by name.
    """
    wrappers = {
        spec.name: DeepSpeedOptimWrapper(
            spec.engine, spec.optimizer,
            accumulative_counts=spec.ds_config['gradient_accumulation_steps'],
            clip_max_norm=float(spec.ds_config['gradient_clipping']),
            find_unused_parameters=find_unused_parameters,
            name=spec.name if specs.several else None,
            forward_through_engine=not specs.several and not own_train_step,
            micro_steps=micro_steps)
        for spec in specs if spec.optimizer is not None}
    return OptimWrapperDict(**wrappers) if specs.several else wrappers[SINGLE_ENGINE]


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
        tuple: The model (SyncBN reverted for a single process and on the CPU,
        converted where ``sync_bn`` asks on CUDA), and ``find_unused_parameters``.
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
    if not cuda_available():  # torch's SyncBatchNorm refuses CPU tensors
        if sync_bn is not None or any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
            logger.warning('SyncBatchNorm needs CUDA: on this CPU run its layers are BatchNorm '
                           '(each rank normalises with its own batch statistics, as with '
                           'sync_bn unset).')
        return revert_sync_batchnorm(model), find_unused
    return (convert_sync_batchnorm(model, sync_bn) if sync_bn is not None else model,
            find_unused)
