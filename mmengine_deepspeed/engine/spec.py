"""One object per DeepSpeed engine: what it is built from, and the engine once built.

A model with one optimizer is a list of one engine, named ``'model'``; a model
with several optimizers (an ``OptimWrapperDict``) has one per optimizer, named
by its key. Each :class:`EngineSpec` holds that engine's MMEngine settings
(batch, accumulation, clipping), its resolved ds_config, the submodule it is
built around, the optimizer it steps and the engine; :class:`EngineSpecs`
holds them in order, with the facts that hold for every engine (ZeRO stage,
precision, micro-batch) asked of all of them, never of "the first".
"""
from __future__ import annotations

import copy
import os.path as osp
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from deepspeed import DeepSpeedEngine
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from ..compat import accumulative_counts
from ..config.checks import get_value
from ..config.model_settings import fit_to_model
from ..config.resolve import (
    DsConfigSource,
    MMEngineSettings,
    bf16_request,
    precision,
    resolve_ds_config,
    zero_stage,
)
from ..dist import cuda_available, native_bf16
from ..zero.zero_dim import engine_config
from .norm_optimizers import norm_math

# torch optimizers that update each element from its own gradient and state
# only, and therefore behave the same on ZeRO's flattened partitions. DeepSpeed
# asks for ``zero_allow_untested_optimizer`` for all but Adam(W)/Adagrad; for
# these we set it, for LARS and LAMB too (engine/norm_optimizers.py steps them per
# parameter), shape-reading ones are refused, for anything else the user decides.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.RMSprop, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
)

# The name of the one engine of a single-optimizer model (and its checkpoint tag's).
SINGLE_ENGINE = 'model'


def engine_label(name: str) -> str:
    """How the user's config names engine ``name`` (in messages)."""
    return 'optim_wrapper' if name == SINGLE_ENGINE else f'optim_wrapper[{name!r}]'


def named_wrappers(optim_wrapper: Any) -> dict[str, Any]:
    """Optim wrappers by engine name: ``{'model': wrapper}`` for one, an
    ``OptimWrapperDict``'s by its keys."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        return dict(optim_wrapper.optim_wrappers)
    return {SINGLE_ENGINE: optim_wrapper}


@dataclass
class EngineSpec:
    """One DeepSpeed engine.

    Args:
        name (str): ``'model'``, or the optimizer's key in ``optim_wrapper``.
        settings (MMEngineSettings): What MMEngine's config says for it.
        ds_config (dict): Its resolved ds_config (empty until resolved).
        path (str): The submodule it is built around (``''``: the model).
        optimizer (Optimizer, optional): The optimizer it steps (DeepSpeed's
            CPU Adam where ZeRO offloads); None for an evaluation engine.
        engine (DeepSpeedEngine, optional): Once built.
    """

    name: str
    settings: MMEngineSettings
    ds_config: dict = field(default_factory=dict)
    path: str = ''
    optimizer: Optional[Optimizer] = None
    engine: Optional[DeepSpeedEngine] = None
    finished: bool = False

    def finish(self, module: nn.Module, *, universal: bool = False) -> dict:
        """Settle the ds_config once the module and the optimizer are known (the one step
        after resolution; nothing edits it afterwards).

        On a copy of the resolved config: ZeRO-0 for an evaluation engine asked for
        ZeRO-1/2 (they partition optimizer states and gradients only, and DeepSpeed
        refuses them without an optimizer; the weights are the same at stage 0);
        ``zero_allow_untested_optimizer`` for an element-wise torch optimizer and for
        the norm-reading ones stepped per parameter (``engine/norm_optimizers.py``); a
        universal checkpoint's load (``universal``, training engines); the settings that
        depend on the module (``config/model_settings.py``).

        Args:
            module (nn.Module): The submodule the engine is built around.
            universal (bool): The run resumes from a universal checkpoint.
                Defaults to False.

        Returns:
            dict: What ``deepspeed.initialize`` gets: :attr:`ds_config`, or a copy
            with clipping left to the optim wrapper (``zero/zero_dim.py``).
        """
        if self.finished:
            raise RuntimeError(f'The ds_config of engine {self.name!r} was already finished.')
        ds = copy.deepcopy(self.ds_config)
        if self.optimizer is None and zero_stage(ds) in (1, 2):
            ds['zero_optimization']['stage'] = 0
        if isinstance(self.optimizer, ELEMENTWISE_OPTIMIZERS) or norm_math(self.optimizer):
            ds.setdefault('zero_allow_untested_optimizer', True)
        if universal and self.optimizer is not None:
            ds.setdefault('checkpoint', {})['load_universal'] = True
        fit_to_model(ds, module)
        self.ds_config, self.finished = ds, True
        return engine_config(ds, module)


class EngineSpecs:
    """Every engine of a runner, in the order of its optimizers.

    Args:
        source (dict | str | None): The user's ds_config (dict or JSON path).
        config_dir (str, optional): The MMEngine config's directory, for a
            relative JSON path.
        settings (dict[str, MMEngineSettings]): By engine name, from
            :func:`mmengine_settings`.
    """

    def __init__(self, source: DsConfigSource, config_dir: Optional[str],
                 settings: dict[str, MMEngineSettings]):
        self.source = source
        self.config_dir = config_dir
        self._specs = {name: EngineSpec(name, s) for name, s in settings.items()}
        self._resolved_for: Optional[tuple[Optional[int]]] = None  # (world_size,) once resolved

    @classmethod
    def of_run(cls, ds_config: DsConfigSource, config_file: Optional[str],
               train_dataloader: Any, optim_wrapper: Any, param_scheduler: Any) -> EngineSpecs:
        """A run's engines as its config (or the Runner's arguments) describes them: the
        one construction the runner and ``plan`` share.

        Args:
            ds_config (dict | str | None): The user's ds_config.
            config_file (str, optional): The MMEngine config's file (a relative
                JSON path is read from its directory).
            train_dataloader (Any): Runner argument.
            optim_wrapper (Any): Runner argument.
            param_scheduler (Any): Runner argument.
        """
        return cls(ds_config, osp.dirname(osp.abspath(config_file)) if config_file else None,
                   mmengine_settings(train_dataloader, optim_wrapper, param_scheduler))

    def __iter__(self) -> Iterator[EngineSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __getitem__(self, name: str) -> EngineSpec:
        return self._specs[name]

    @property
    def several(self) -> bool:
        """Whether the model has several engines (one per optimizer of an
        ``OptimWrapperDict``), each around a submodule."""
        return len(self._specs) > 1

    def use_settings(self, settings: dict[str, MMEngineSettings]) -> None:
        """Follow MMEngine's settings as ``train()`` built them (the optim wrappers may
        differ from the config's); resolved again only where they changed."""
        if {name: spec.settings for name, spec in self._specs.items()} != settings:
            self._specs = {name: EngineSpec(name, s) for name, s in settings.items()}
            self._resolved_for = None

    def resolve(self, world_size: Optional[int]) -> None:
        """Resolve every engine's ds_config (``world_size`` None: checks only), once per
        world size and settings.

        Raises:
            DsConfigError: The ds_config conflicts with MMEngine's config.
        """
        if self._resolved_for == (world_size,):
            return
        if any(spec.finished for spec in self):
            raise RuntimeError('The engines\' ds_configs were finished; they are not resolved '
                               'again.')
        for spec in self:
            spec.ds_config = resolve_ds_config(
                self.source, spec.settings, world_size=world_size,
                cuda_available=cuda_available(), config_dir=self.config_dir,
                native_bf16=native_bf16())
        self._resolved_for = (world_size,)

    def shared(self, key: str) -> Any:
        """A ds_config value every engine has alike (``zero_optimization.stage``...).

        The engines' configs come from one ds_config and differ only where
        MMEngine's settings differ per optimizer (accumulation, clipping).
        """
        values = {repr(get_value(spec.ds_config, key)) for spec in self}
        if len(values) != 1:
            raise RuntimeError(f'The engines disagree on {key} ({", ".join(sorted(values))}); '
                               'it must be the same for every optimizer.')
        return get_value(next(iter(self)).ds_config, key)

    def process_config(self, *keys: str) -> dict:
        """A resolved ds_config for what DeepSpeed configures per process, not per engine.

        ``deepspeed.checkpointing.configure`` and ``zero.Init`` take one
        config; every engine's agrees on ``keys`` (checked), so any serves.
        """
        for key in keys:
            self.shared(key)
        return next(iter(self)).ds_config

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of every engine."""
        return int(self.shared('zero_optimization.stage') or 0)

    @property
    def precision(self) -> str:
        """``'bf16'``, ``'fp16'`` or ``'fp32'``, the same for every engine."""
        kinds = {precision(spec.ds_config) for spec in self}
        if len(kinds) != 1:
            raise RuntimeError(f'The engines disagree on precision ({", ".join(sorted(kinds))}).')
        return kinds.pop()

    def bf16_requested(self) -> Optional[bool]:
        """Whether the user's ds_config asks for bf16 itself (see ``bf16_request``)."""
        return bf16_request(self.source, self.config_dir)

    @property
    def built(self) -> bool:
        """Whether the engines exist."""
        return any(spec.engine is not None for spec in self)

    @property
    def training(self) -> bool:
        """Whether the engines were built with their optimizers (by ``train()``)."""
        return any(spec.engine is not None and spec.engine.client_optimizer is not None
                   for spec in self)

    def engines(self) -> dict[str, DeepSpeedEngine]:
        """The built engines by name."""
        return {spec.name: spec.engine for spec in self if spec.engine is not None}

    def modules(self) -> dict[str, str]:
        """Each engine's submodule path, by name."""
        return {spec.name: spec.path for spec in self}

    def configs(self) -> dict[str, dict]:
        """Each engine's resolved ds_config, by name."""
        return {spec.name: spec.ds_config for spec in self}

    def for_evaluation(self) -> None:
        """One engine around the whole model (``val()``/``test()`` before ``train()``).

        Without optimizers there is nothing to split the model by; the
        engine takes the settings every optimizer's engine shares.
        """
        if list(self._specs) == [SINGLE_ENGINE]:
            return
        every = [spec.settings for spec in self]
        settings = MMEngineSettings(
            batch_size=every[0].batch_size,
            has_optim_wrapper=any(s.has_optim_wrapper for s in every),
            has_param_scheduler=any(s.has_param_scheduler for s in every))
        self._specs = {SINGLE_ENGINE: EngineSpec(SINGLE_ENGINE, settings)}
        self._resolved_for = None


# Keys of a several-optimizer ``optim_wrapper`` config that are not optimizer names.
WRAPPER_DICT_OPTIONS = ('constructor', 'paramwise_cfg')


def _batch_size(dataloader: Any) -> Optional[int]:
    if isinstance(dataloader, DataLoader):  # a batch sampler (MMDetection's) holds its own
        return dataloader.batch_size or getattr(dataloader.batch_sampler, 'batch_size', None)
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


def mmengine_settings(train_dataloader: Any, optim_wrapper: Any,
                      param_scheduler: Any) -> dict[str, MMEngineSettings]:
    """What the MMEngine config says about batch, accumulation and clipping, per engine.

    Args:
        train_dataloader (DataLoader | dict | None): Runner argument.
        optim_wrapper (OptimWrapper | OptimWrapperDict | dict | None):
            Runner argument; several optimizers give one entry each.
        param_scheduler (Any): Runner argument.

    Returns:
        dict[str, MMEngineSettings]: By engine name (``'model'`` for one).
    """
    batch_size = _batch_size(train_dataloader)
    has_scheduler = param_scheduler is not None

    def side(wrapper: Any) -> MMEngineSettings:
        if isinstance(wrapper, OptimWrapper):
            clip = wrapper.clip_grad_kwargs
            if clip and getattr(wrapper, 'grad_name', 'grad_norm') == 'grad_value':
                clip = dict(clip, type='value')
            return MMEngineSettings(batch_size=batch_size,
                                accumulative_counts=accumulative_counts(wrapper),
                                clip_grad=clip or None,
                                optim_wrapper_type=type(wrapper).__name__,
                                has_optim_wrapper=True, has_param_scheduler=has_scheduler)
        cfg = wrapper or {}
        return MMEngineSettings(batch_size=batch_size,
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


def as_plain_wrappers(optim_wrapper: Any, only_ours: bool = False) -> Any:
    """``optim_wrapper`` config with each wrapper built as MMEngine's ``OptimWrapper``.

    ``DeepSpeedOptimWrapper`` needs its engine, which exists only after the
    optimizer is built; the runner wraps the built optimizers afterwards.

    Args:
        optim_wrapper (Any): The ``optim_wrapper`` argument (a config, or built).
        only_ours (bool): Replace only ``DeepSpeedOptimWrapper``, keeping any other
            type (MMEngine's factory, called by the user). Defaults to False: every
            wrapper becomes an ``OptimWrapper`` (the engines' optimizers).
    """
    def plain(config: dict) -> dict:
        kind = config.get('type', 'OptimWrapper')
        if only_ours and getattr(kind, '__name__', kind) != 'DeepSpeedOptimWrapper':
            return config
        return dict(config, type='OptimWrapper')

    if not isinstance(optim_wrapper, dict):
        return optim_wrapper
    if not is_several(optim_wrapper):
        return plain(optim_wrapper)
    # configs become OptimWrapper configs; built wrappers (a dict of them) stay as they are
    return {k: plain(v) if k not in WRAPPER_DICT_OPTIONS and isinstance(v, dict) else v
            for k, v in optim_wrapper.items()}


def named_optimizers(built: Any) -> dict[str, Optimizer]:
    """The optimizers MMEngine built, by engine name."""
    return {name: wrapper.optimizer for name, wrapper in named_wrappers(built).items()}
