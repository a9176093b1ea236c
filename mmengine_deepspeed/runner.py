"""DeepSpeedRunner: MMEngine's Runner with DeepSpeed engines in place of DDP.

MMEngine wraps the model in ``Runner.__init__`` but builds the optimizer only
in ``train()``; ``deepspeed.initialize`` needs both at once. This runner owns
that ordering (ARCHITECTURE.md, "The data path"): the model is left unwrapped
(built partitioned under ZeRO-3), ``init_weights()`` runs before any engine,
MMEngine builds the optimizer(s), and ``train()``'s one ``build_optim_wrapper``
call builds one engine per optimizer (``engine/build.py``), on whose wrappers MMEngine
then builds the param schedulers. ``val()`` and ``test()`` without training
build an engine without an optimizer.
"""
from __future__ import annotations

import contextlib
import inspect
import os.path as osp
from collections.abc import Mapping
from typing import Any, Optional, Union

import deepspeed
import torch
from mmengine.config import Config
from mmengine.dist import get_rank
from mmengine.logging import MessageHub, MMLogger
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import RUNNERS
from mmengine.runner import Runner
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from .checkpoint.data_order import resumable_loader
from .checkpoint.layout import SINGLE_ENGINE
from .checkpoint.loop import resumable_loop
from .checkpoint.reshard import Layout, load_universal_if_needed
from .checkpoint.runner_methods import CheckpointMethods
from .config.resolve import (
    DsConfigSource,
    bf16_request,
    precision,
    resolve_ds_config,
    zero_stage,
)
from .dist import cuda_available, init_distributed, native_bf16, quiet_deepspeed
from .engine.activation import checkpoint_through_deepspeed, has_section
from .engine.build import (
    as_plain_wrappers,
    build_engines,
    evaluation_stage,
    left_unwrapped,
    mmengine_sides,
    named_optimizers,
    wrap_optimizers,
)
from .engine.offload import check_nvme, cpu_optimizer
from .engine.optim_wrapper import DeepSpeedOptimWrapper
from .engine.wrapper import overrides
from .failure import failing_together
from .hooks.ema import DeepSpeedEMAHook
from .hooks.monitor import banner, precision_note
from .hooks.preemption import PreemptionHook
from .hooks.registration import deepspeed_custom_hooks, deepspeed_default_hooks
from .zero.partitioned import build_advice, gather_on_use, partitioned_construction
from .zero.unused_params import zero3_unsupported

CAST_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': None}


def _from_cfg(cfg: Optional[Config], key: str, value: Any, default: Any) -> Any:
    """A runner argument, else the config's key, else ``default``."""
    if value is not None:
        return value
    return cfg.get(key, default) if cfg is not None else default


@RUNNERS.register_module()
class DeepSpeedRunner(CheckpointMethods):
    """A :class:`mmengine.runner.Runner` that trains through DeepSpeed.

    Takes every ``Runner`` argument plus ``ds_config``. With
    ``runner_type='DeepSpeedRunner'`` in a config, ``RUNNERS.build(cfg)``
    and ``DeepSpeedRunner.from_cfg(cfg)`` read ``cfg.ds_config``.

    Args:
        *args: Positional arguments of :class:`mmengine.runner.Runner`.
        ds_config (dict | str, optional): The DeepSpeed config, or the path of
            a JSON file (relative to the working directory or to the config
            file). ``"auto"`` values are filled from the MMEngine config. None
            reads ``cfg.ds_config``, and without one uses DeepSpeed's defaults
            (ZeRO-0, fp32). Defaults to None.
        allow_unsafe_checkpoints (bool, optional): Load checkpoints with full
            unpickling, for files from a source you trust that hold objects
            beyond tensors and plain types. None reads
            ``cfg.allow_unsafe_checkpoints`` (default False).
            Defaults to None.
        zero_init (bool, optional): Under ZeRO-3, build a model given as a
            config inside ``deepspeed.zero.Init``, so that no rank holds it
            whole (``zero/partitioned.py``). None reads ``cfg.zero_init``
            (default True). Defaults to None.
        **kwargs: Keyword arguments of :class:`mmengine.runner.Runner`.
    """

    _has_loaded: bool
    _find_unused_parameters: bool

    def __init__(self, *args: Any, ds_config: DsConfigSource = None,
                 allow_unsafe_checkpoints: Optional[bool] = None,
                 zero_init: Optional[bool] = None, **kwargs: Any):
        bound = inspect.signature(Runner.__init__).bind(self, *args, **kwargs)
        arguments = bound.arguments
        cfg = arguments.get('cfg')
        cfg = Config(cfg) if isinstance(cfg, dict) and not isinstance(cfg, Config) else cfg
        if ds_config is None and cfg is not None:
            ds_config = cfg.get('ds_config')
        self.allow_unsafe_checkpoints = bool(_from_cfg(
            cfg, 'allow_unsafe_checkpoints', allow_unsafe_checkpoints, False))
        self.zero_init = bool(_from_cfg(cfg, 'zero_init', zero_init, True))
        filename = getattr(cfg, 'filename', None)
        self._ds_config_source = ds_config
        self._config_dir = osp.dirname(osp.abspath(filename)) if filename else None
        self._sides = mmengine_sides(arguments.get('train_dataloader'),
                                     arguments.get('optim_wrapper'),
                                     arguments.get('param_scheduler'))
        # Refuse a bad ds_config before any process group or file exists.
        for name in self._sides:
            check_nvme(self._resolve_ds_config(name, world_size=None))
        self._weights_initialized = False
        self._engines_wanted = False  # build_optim_wrapper builds engines (inside train())
        self._deepspeed_checkpointed: Optional[Any] = None
        self._resume_target: Optional[tuple[Optional[str]]] = None
        self.engines: dict[str, deepspeed.DeepSpeedEngine] = {}
        self.engine_modules: dict[str, str] = {}
        self.ds_config: dict = {}
        super().__init__(*args, **kwargs)
        self._resume_after_restart()

    def _resolve_ds_config(self, name: str, world_size: Optional[int]) -> dict:
        side = self._sides.get(name, self._sides[next(iter(self._sides))])
        return resolve_ds_config(self._ds_config_source, side, world_size=world_size,
                                 cuda_available=cuda_available(),
                                 config_dir=self._config_dir, native_bf16=native_bf16())

    @override
    def setup_env(self, env_cfg: dict) -> None:
        """Create the process group (CPU-safe, with a timeout), then MMEngine's setup.

        MMEngine's ``init_dist`` calls ``torch.cuda.set_device``
        unconditionally; with the group already up, ``Runner.setup_env`` skips
        it. Launcher ``'none'`` gets a one-process group, which DeepSpeed needs.
        """
        init_distributed(self.launcher, env_cfg.get('dist_cfg'))
        super().setup_env(env_cfg)
        quiet_deepspeed(self.rank, verbose=self.cfg.get('log_level', 'INFO') == 'DEBUG')

    @override
    def build_logger(self, log_level: Union[int, str] = 'INFO', log_file: Optional[str] = None,
                     **kwargs: Any) -> MMLogger:
        """MMEngine's logger, under an experiment name no earlier runner here has taken.

        Names end with the start second, so runners built in one process within
        that second shared MMEngine's logger and MessageHub (histories, best
        scores, warnings). A suffix (``_2``...) keeps them apart; every rank
        builds the same runners, so every rank picks the same name.
        """
        base, count = self._experiment_name, 1
        while MMLogger.check_instance_created(self._experiment_name) \
                or MessageHub.check_instance_created(self._experiment_name):
            count += 1
            self._experiment_name = f'{base}_{count}'
        return super().build_logger(log_level=log_level, log_file=log_file, **kwargs)

    @override
    def build_model(self, model: Union[nn.Module, dict]) -> nn.Module:
        """MMEngine's ``build_model``; under ZeRO-3 a config is built partitioned.

        Inside ``deepspeed.zero.Init`` each submodule is partitioned as soon
        as it is built (in the ds_config's dtype), so the largest model
        that fits is set by all ranks' memory together, not by one rank's.
        """
        ds_config = self._resolve_ds_config(next(iter(self._sides)), self.world_size)
        self.ds_config = ds_config  # what a checkpoint taken before train() records
        advice = build_advice(model, ds_config, self.zero_init, len(self._sides))
        if advice is not None:
            self.logger.info(advice)
        if not isinstance(model, dict) or advice is not None or not self.zero_init \
                or zero_stage(ds_config) != 3:
            return super().build_model(model)
        with partitioned_construction(ds_config):
            built = super().build_model(model)
        self.logger.info('Built the model partitioned under ZeRO-3 (deepspeed.zero.Init); '
                         'set zero_init=False to build it whole on every rank.')
        return built

    @override
    def wrap_model(self, model_wrapper_cfg: Optional[dict], model: nn.Module) -> nn.Module:
        """Leave the model unwrapped (the engine needs the optimizer, built later);
        ``find_unused_parameters`` is honoured (``engines.left_unwrapped``)."""
        model, self._find_unused_parameters = left_unwrapped(
            model, model_wrapper_cfg, self.world_size, self.cfg.get('sync_bn', None),
            self.logger)
        return model

    @override
    def build_train_loop(self, loop: Any) -> Any:
        """MMEngine's train loops, resuming exactly and without reloading data (``loop.py``)."""
        return super().build_train_loop(resumable_loop(loop))

    @override
    @staticmethod
    def build_dataloader(dataloader: Union[DataLoader, dict], seed: Optional[int] = None,
                         diff_rank_seed: bool = False) -> DataLoader:
        """MMEngine's ``build_dataloader``, its iterators off the global RNG (``data_order.py``).

        Creating an iterator then draws nothing from the model's random
        stream, and workers can reseed per sample, so a resumed run draws
        what the uninterrupted run drew.
        """
        return resumable_loader(
            Runner.build_dataloader(dataloader, seed=seed, diff_rank_seed=diff_rank_seed), seed,
            get_rank())

    @override
    def train(self) -> nn.Module:
        """MMEngine's ``train()``; listed ``activation_checkpointing`` modules go
        through DeepSpeed's checkpoint when ds_config has that section (``engine/activation.py``).

        An error on this rank ends every rank at once (``failure.py``); a stop
        signal ends them together after a checkpoint (``hooks/preemption.py``).
        """
        with failing_together(), contextlib.ExitStack() as signals:
            for hook in self.hooks:
                if isinstance(hook, PreemptionHook):
                    signals.enter_context(hook.catching_signals())
            # MMEngine's train() calls build_optim_wrapper once: that call builds the engines.
            self._engines_wanted = not self.engines
            try:
                return self._train()
            finally:
                self._engines_wanted = False

    def _train(self) -> nn.Module:
        listed = self.cfg.get('activation_checkpointing')
        if listed is None or not has_section(self._resolve_ds_config(next(iter(self._sides)),
                                                                      self.world_size)):
            return super().train()
        self._deepspeed_checkpointed = self.cfg.pop('activation_checkpointing')
        try:
            return super().train()
        finally:
            self.cfg['activation_checkpointing'] = listed
            self._deepspeed_checkpointed = None

    @override
    def _init_model_weights(self) -> None:
        """Run ``init_weights()`` once, before the DeepSpeed engine is built.

        MMEngine calls this after building the optimizer, when the engine
        would own (and under ZeRO-3 partition) the parameters, so the runner
        calls it earlier (see :meth:`build_optim_wrapper`) and this later call
        does nothing. A model built partitioned (``zero.Init``) is
        initialised with each parameter gathered as torch touches it.
        """
        if self._weights_initialized:
            return
        if self.engines:
            raise RuntimeError('init_weights() must run before the DeepSpeed engine is built.')
        model = self.bare_model
        if hasattr(model, 'init_weights'):
            with gather_on_use(model):
                getattr(model, 'init_weights')()  # noqa: B009  (nn.Module typing)
        self._weights_initialized = True

    @override
    def build_optim_wrapper(
        self, optim_wrapper: Union[Optimizer, OptimWrapper, dict]
    ) -> Union[OptimWrapper, OptimWrapperDict]:
        """MMEngine's factory; when ``train()`` starts, also one engine per optimizer.

        Called by the user (or a test) it is MMEngine's: it builds MMEngine's
        optim wrappers from a config, an optimizer or a built wrapper, any
        number of times, and changes nothing else. The one call ``train()``
        makes with ``runner.optim_wrapper`` (whatever it is then) builds the
        DeepSpeed engines from the result and returns their wrappers.

        Args:
            optim_wrapper (Optimizer | OptimWrapper | OptimWrapperDict | dict):
                The ``optim_wrapper`` argument.

        Returns:
            OptimWrapper | OptimWrapperDict: MMEngine's wrapper(s); inside
            ``train()`` the DeepSpeedOptimWrapper the train loop steps with, or
            one per optimizer by name.
        """
        if isinstance(optim_wrapper, DeepSpeedOptimWrapper) or (
                isinstance(optim_wrapper, OptimWrapperDict) and all(
                    isinstance(w, DeepSpeedOptimWrapper) for w in optim_wrapper.values())):
            return optim_wrapper
        if not self._engines_wanted:
            return super().build_optim_wrapper(as_plain_wrappers(optim_wrapper))
        self._engines_wanted = False  # one call builds them; later ones are the factory's
        self._init_model_weights()
        ds_config = self._resolve_ds_config(next(iter(self._sides)), self.world_size)
        if has_section(ds_config):
            wrapped = checkpoint_through_deepspeed(self.bare_model,
                                                   self._deepspeed_checkpointed or [], ds_config)
            self.logger.info('DeepSpeed activation checkpointing configured; modules through '
                             f'its checkpoint: {", ".join(wrapped) or "none listed"}.')
        optimizers = named_optimizers(super().build_optim_wrapper(as_plain_wrappers(optim_wrapper)))
        configs, stepped = self._build_engines(optimizers)
        return wrap_optimizers(self.engines, {k: v for k, v in stepped.items() if v is not None},
                               configs, self._find_unused_parameters,
                               own_train_step=overrides(self.bare_model, 'train_step'))

    def _build_engines(self, optimizers: Mapping[str, Optional[Optimizer]]
                       ) -> tuple[dict[str, dict], dict[str, Optional[Optimizer]]]:
        """One engine per optimizer; ``runner.model`` becomes their wrapper.

        Returns:
            tuple: The resolved ds_config of each engine, and the optimizers
            the engines step (DeepSpeed's CPU Adam where ZeRO offloads).
        """
        if self.engines:
            trained = self.has_training_engines()
            raise RuntimeError(
                'The DeepSpeed engines were already built with their optimizers (train() or '
                'build_optim_wrapper() ran); use runner.optim_wrapper, or build a new runner '
                'to train with another optimizer.' if trained else
                'The DeepSpeed engine was already built without an optimizer by val()/test(); '
                'call train() first, or build a new runner for training.')
        model = self.bare_model
        configs = {name: self._resolve_ds_config(name, world_size=self.world_size)
                   for name in optimizers}
        stage = zero_stage(next(iter(configs.values())))
        training = any(optimizer is not None for optimizer in optimizers.values())
        unsupported = zero3_unsupported(stage)
        if self._find_unused_parameters and training and unsupported is not None:
            self.logger.warning(unsupported)
            self._find_unused_parameters = False
        if not training and stage in (1, 2):
            self.logger.info(evaluation_stage(configs))
        optimizers = dict(optimizers)
        for name, optimizer in optimizers.items():
            if optimizer is not None:
                optimizers[name], note = cpu_optimizer(optimizer, configs[name])
                if note is not None:
                    self.logger.info(note)
        if self._load_from is not None and not self._resume and not self._has_loaded:
            # Into the bare model, so DeepSpeed partitions (and keeps fp32
            # masters of) the loaded weights.
            self.load_checkpoint(self._load_from)
        for hook in self.hooks:
            if isinstance(hook, DeepSpeedEMAHook):
                hook.take_template(model)  # full fp32 weights, before partitioning
        resume_from = self._resume_path() if training else None
        if resume_from is not None:
            load_universal_if_needed(resume_from, Layout(self.world_size, stage), optimizers,
                                     configs)
        self.ds_config = configs[next(iter(configs))]
        self.engines, self.engine_modules, self.model = build_engines(
            model, optimizers, configs, CAST_DTYPES[precision(self.ds_config)])
        self.logger.info(banner(self.ds_config, self.world_size, model, training))
        if len(self.engines) > 1:
            self.logger.info('One DeepSpeed engine per optimizer: ' + ', '.join(
                f'{name} -> model.{path}' for name, path in self.engine_modules.items()))
        note = precision_note(bf16_request(self._ds_config_source, self._config_dir),
                              precision(self.ds_config), cuda_available())
        if note is not None:
            self.logger.warning(note)
        return configs, optimizers

    def _ensure_engine(self) -> None:
        if not self.engines:
            self._build_engines({SINGLE_ENGINE: None})

    @override
    def val(self) -> dict:
        """Validate; without prior training, through an engine without optimizer."""
        with failing_together():
            self._ensure_engine()
            return super().val()

    @override
    def test(self) -> dict:
        """Test; without prior training, through an engine without optimizer."""
        with failing_together():
            self._ensure_engine()
            return super().test()

    @override
    def register_default_hooks(self, hooks: Optional[dict] = None) -> None:
        """MMEngine's default hooks, with the crash-safe checkpoint hook
        (``hooks/registration.py``)."""
        super().register_default_hooks(deepspeed_default_hooks(hooks))

    @override
    def register_hooks(self, default_hooks: Optional[dict] = None,
                       custom_hooks: Optional[list] = None) -> None:
        """MMEngine's hooks, with ``EMAHook`` made DeepSpeed-aware and a ThroughputHook."""
        super().register_hooks(default_hooks, deepspeed_custom_hooks(custom_hooks))
