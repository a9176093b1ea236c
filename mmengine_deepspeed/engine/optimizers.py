"""DeepSpeed's optimizers in MMEngine's ``OPTIMIZERS`` registry, and a constructor of several.

ZeRO-Offload needs ``DeepSpeedCPUAdam`` (or ``DeepSpeedCPUAdagrad`` /
``DeepSpeedCPULion``) and CUDA runs want ``FusedAdam``; a config names them as
``optim_wrapper.optimizer.type``. MMEngine's own registration
(``mmengine._strategy.deepspeed.register_deepspeed_optimizers``) imports
``deepspeed.runtime.fp16.onebit``, which DeepSpeed 0.19 removed, so it fails
before registering anything; this one imports only the public ``deepspeed.ops``
modules.
"""
from __future__ import annotations

from typing import Optional

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapperDict
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIMIZERS
from torch import nn

DEEPSPEED_OPTIMIZERS = (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedAdam,
                        FusedLamb, FusedLion)


def register_deepspeed_optimizers() -> list[str]:
    """Register DeepSpeed's optimizers; safe to call more than once.

    Returns:
        list[str]: The names now available as ``optimizer.type``.
    """
    names = []
    for cls in DEEPSPEED_OPTIMIZERS:
        if OPTIMIZERS.get(cls.__name__) is None:
            OPTIMIZERS.register_module(module=cls)
        names.append(cls.__name__)
    return names


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class SubmoduleOptimWrapperConstructor:
    """One optim wrapper per named submodule: the config form of several optimizers.

    ``optim_wrapper=dict(constructor='SubmoduleOptimWrapperConstructor',
    generator=dict(optimizer=dict(type='Adam', lr=2e-4)),
    discriminator=dict(optimizer=...))`` builds, for each key, MMEngine's
    default constructor (with that key's ``paramwise_cfg``) on
    ``model.<key>`` and returns them as an ``OptimWrapperDict``, which
    DeepSpeedRunner turns into one engine per key. It works as mmagic's
    ``MultiOptimWrapperConstructor``, under another name so that both can
    be registered; that one is accepted as well.

    Args:
        optim_wrapper_cfg (dict): ``{submodule name: optim wrapper config}``.
        paramwise_cfg (dict, optional): Must be None: give each key its own
            ``paramwise_cfg``. Defaults to None.
    """

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: Optional[dict] = None):
        if paramwise_cfg is not None:
            raise ValueError(
                'SubmoduleOptimWrapperConstructor: put paramwise_cfg inside each submodule\'s '
                "entry (optim_wrapper=dict(generator=dict(optimizer=..., paramwise_cfg=...))), "
                'not beside them.')
        for name, cfg in optim_wrapper_cfg.items():
            if not isinstance(cfg, dict) or 'optimizer' not in cfg:
                raise ValueError(f'optim_wrapper.{name} must be a dict with an "optimizer" '
                                 f'entry (an optim wrapper config), got {cfg!r}.')
        self.optim_wrapper_cfg = optim_wrapper_cfg

    def __call__(self, model: nn.Module) -> OptimWrapperDict:
        """Build each key's optim wrapper on ``model.<key>``."""
        wrappers = {}
        for name, cfg in self.optim_wrapper_cfg.items():
            try:
                module = model.get_submodule(name)
            except AttributeError as e:
                children = ', '.join(n for n, _ in model.named_children())
                raise ValueError(
                    f'optim_wrapper.{name}: {type(model).__name__} has no submodule {name!r} '
                    f'(its children: {children}); name each optimizer after the submodule it '
                    'trains.') from e
            cfg = dict(cfg)
            constructor = DefaultOptimWrapperConstructor(cfg, cfg.pop('paramwise_cfg', None))
            wrappers[name] = constructor(module)
        return OptimWrapperDict(**wrappers)
