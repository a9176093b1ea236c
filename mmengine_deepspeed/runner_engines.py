"""Runner's optimizer and weight-init steps, where the DeepSpeed engines are built.

MMEngine's ``train()`` builds the optim wrapper(s), then calls ``_init_model_weights``;
DeepSpeed needs the weights initialised and the optimizer at once. ``train()`` therefore
sets the engines up before MMEngine's (:meth:`EngineMethods.set_up_engines`: the weights
initialised, one engine per optimizer, ``engine/build.py``), and ``build_optim_wrapper``
stays MMEngine's factory; ``val()`` / ``test()`` without training build an engine without
an optimizer (:meth:`EngineMethods.ensure_engine`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Union

from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.runner import Runner
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from .checkpoint.checkpointer import Checkpointer
from .checkpoint.resume_plan import ResumeKind
from .engine.activation import checkpoint_through_deepspeed, has_section
from .engine.build import build_engines, wrap_optimizers
from .engine.compile import compile_engines, compile_options
from .engine.optim_wrapper import DeepSpeedOptimWrapper
from .engine.spec import (
    SINGLE_ENGINE,
    EngineSpecs,
    as_plain_wrappers,
    mmengine_settings,
    named_optimizers,
)
from .engine.wrapper import overrides
from .zero.gather import gather_on_use
from .zero.in_step import hooks_update_on_whole_tensors


class EngineMethods(Runner):
    """Runner's ``build_optim_wrapper`` / ``_init_model_weights`` for DeepSpeedRunner."""

    engine_specs: EngineSpecs
    checkpointer: Checkpointer
    _find_unused_parameters: bool
    _weights_initialized: bool
    _compile_counts: Optional[dict[str, int]]

    @property
    def bare_model(self) -> nn.Module:
        """The user's model; the runner defines it."""
        raise NotImplementedError

    @override
    def _init_model_weights(self) -> None:
        """Run ``init_weights()`` once, before the DeepSpeed engine is built.

        MMEngine calls this after building the optimizer, when the engine
        would own (and under ZeRO-3 partition) the parameters, so the runner
        calls it earlier (see :meth:`set_up_engines`) and this later call
        does nothing. A model built partitioned (``zero.Init``) is
        initialised with each parameter gathered as torch touches it.
        """
        if self._weights_initialized:
            return
        if self.engine_specs.built:
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
        """MMEngine's factory: MMEngine's optim wrappers from a config, an optimizer or a
        built wrapper, any number of times, changing nothing else; the DeepSpeed wrappers
        :meth:`set_up_engines` built are returned as they are (``train()``'s own call).

        Args:
            optim_wrapper (Optimizer | OptimWrapper | OptimWrapperDict | dict):
                The ``optim_wrapper`` argument.

        Returns:
            OptimWrapper | OptimWrapperDict: MMEngine's wrapper(s), or the
            DeepSpeedOptimWrapper(s) given.
        """
        if isinstance(optim_wrapper, DeepSpeedOptimWrapper) or (
                isinstance(optim_wrapper, OptimWrapperDict) and all(
                    isinstance(w, DeepSpeedOptimWrapper) for w in optim_wrapper.values())):
            return optim_wrapper
        return super().build_optim_wrapper(as_plain_wrappers(optim_wrapper, only_ours=True))

    def set_up_engines(self) -> None:
        """One engine per optimizer of ``runner.optim_wrapper`` (whatever it is now), and
        their DeepSpeedOptimWrapper(s) in its place: what ``train()`` does before MMEngine's
        ``train()``, whose own ``build_optim_wrapper`` call then finds them built.

        The weights are initialised first (under ZeRO-3 the engine partitions them);
        ``activation_checkpointing`` goes through DeepSpeed's checkpoint where ds_config
        has that section, and ``compile`` compiles each engine's module.
        """
        self._init_model_weights()
        ds_config = self._activation_config()
        if has_section(ds_config):
            listed = self.cfg.get('activation_checkpointing') or []
            wrapped = checkpoint_through_deepspeed(self.bare_model, listed, ds_config)
            self.logger.info('DeepSpeed activation checkpointing configured; modules through '
                             f'its checkpoint: {", ".join(wrapped) or "none listed"}.')
        built = super().build_optim_wrapper(as_plain_wrappers(self.optim_wrapper))
        # The engines follow the wrappers built now (runner.optim_wrapper may have changed).
        self.engine_specs.use_settings(
            mmengine_settings(self.train_dataloader, built, self.param_schedulers))
        self._build_engines(named_optimizers(built))
        options = compile_options(self.cfg.get('compile'))
        if options is not None:
            self._compile_counts = compile_engines(self.engine_specs, options, self.logger)
        self.optim_wrapper = wrap_optimizers(
            self.engine_specs, self._find_unused_parameters,
            own_train_step=overrides(self.bare_model, 'train_step'))

    def _activation_config(self) -> dict:
        return self.engine_specs.process_config('activation_checkpointing')

    def _build_engines(self, optimizers: Mapping[str, Optional[Optimizer]]) -> None:
        """One engine per optimizer (``engine/build.py``); ``runner.model`` wraps them."""
        if self.engine_specs.built:
            raise RuntimeError(
                'The DeepSpeed engines were already built with their optimizers (train() '
                'ran); use runner.optim_wrapper, or build a new runner '
                'to train with another optimizer.' if self.engine_specs.training else
                'The DeepSpeed engine was already built without an optimizer by val()/test(); '
                'call train() first, or build a new runner for training.')
        self.model, self._find_unused_parameters = build_engines(
            self.engine_specs, self.bare_model, optimizers, world_size=self.world_size,
            find_unused_parameters=self._find_unused_parameters, logger=self.logger,
            before_partitioning=self._before_partitioning,
            universal=self.checkpointer.loads_universal(optimizers.values()))
        zero3 = [engine for engine in self.engine_specs.engines().values()
                 if engine.optimizer is not None and engine.zero_optimization_stage() == 3]
        for hook in hooks_update_on_whole_tensors(self.hooks, zero3):
            self.logger.info(f'{type(hook).__name__} updates the model on whole tensors under '
                             'ZeRO-3: each update gathers the model it is given.')

    def _before_partitioning(self, specs: EngineSpecs) -> None:
        """What needs the model whole, between the optimizers and ``deepspeed.initialize``."""
        plan = self.checkpointer.plan
        if plan.kind is ResumeKind.WEIGHTS and not self.checkpointer.weights_loaded:
            # Into the bare model, so DeepSpeed partitions (and keeps fp32 masters of) them.
            self.load_checkpoint(str(plan.path))
        # hooks that need the whole model (DeepSpeedEMAHook: its fp32 template)
        self.call_hook('before_partitioning', model=self.bare_model)

    def ensure_engine(self) -> None:
        """For ``val()`` / ``test()``: the plan resolved, and an engine without optimizer
        unless ``train()`` built the engines."""
        self.checkpointer.resolve_plan()  # once, before anything loads
        if not self.engine_specs.built:
            self._build_engines({SINGLE_ENGINE: None})
