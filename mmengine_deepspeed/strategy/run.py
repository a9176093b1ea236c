"""RunStrategy: the one owner of what DeepSpeed touches in a run.

MMEngine's ``Runner`` wraps the model in ``__init__`` but builds the optimizer only in
``train()``; ``deepspeed.initialize`` needs both at once. :class:`RunStrategy` is the only
object that builds engines (``engine/build.py``): it owns the run's EngineSpecs, the
ZeRO-3 partitioned construction, the engines and their optim wrappers, the checkpointer
and the ranks' agreement. ``DeepSpeedRunner``'s overrides delegate to it in a few lines
(Lightning's Strategy shape); hooks and loops reach it through ``runner.strategy``
(``strategy/access.py``). Its checkpoint side is ``strategy/checkpoints.py``.

Named apart from MMEngine's ``DeepSpeedStrategy``, which serves ``FlexibleRunner`` and
is not used here.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any, Optional, Union, cast

import deepspeed
from mmengine.config import Config
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.runner import Runner
from torch import nn
from torch.optim import Optimizer

from ..checkpoint.checkpointer import Checkpointer
from ..config.layout import Layout
from ..config.resolve import DsConfigSource
from ..dist import cuda_available, local_world_size
from ..engine.activation import checkpoint_through_deepspeed, has_section
from ..engine.build import build_engines, left_unwrapped, wrap_optimizers
from ..engine.compile import check_deepcompile, compile_engines, compile_options
from ..engine.offload import check_nvme
from ..engine.optim_wrapper import DeepSpeedOptimWrapper
from ..engine.spec import (
    SINGLE_ENGINE,
    EngineSpecs,
    as_plain_wrappers,
    mmengine_settings,
    named_optimizers,
    named_wrappers,
)
from ..engine.virtual_ranks import MicroBatches, VirtualRanks
from ..engine.wrapper import DeepSpeedEngineWrapper, overrides
from ..plan.census import import_scope
from ..plan.planner import PeakModel, peak_model
from ..process_memory import rss_mib
from ..random_streams import rng_state, set_rng_state
from ..zero.gather import gather_on_use
from ..zero.in_step import hooks_update_on_whole_tensors
from ..zero.partitioned import build_advice, built_partitioned
from .agreement import Agreement, logging_interval
from .checkpoints import checkpoint_parts
from .layout import layout_virtual_ranks, split_retry


class RunStrategy:
    """The run's EngineSpecs, engines, checkpointer and agreement, and how they are built.

    Built by the runner before MMEngine's ``Runner.__init__`` (which builds the model
    through :meth:`build_model`); its checkpointer once the runner has its model, hub and
    hooks (:meth:`build_checkpointer`).

    Args:
        runner (Runner): The runner it works for (its ``__init__`` may not have run yet).
        specs (EngineSpecs): The run's engines (nothing built yet).
        allow_unsafe_checkpoints (bool): Unpickle beyond tensors and plain types.
        zero_init (bool): Under ZeRO-3, build a config's model inside ``zero.Init``.
        rss_at_start_mib (float): What the process held before any model or data (on
            CPU; 0 on CUDA), where ``plan``'s prediction starts.
        layout (Layout, optional): The layout the run trains as (``config/layout.py``);
            None for its own ranks. Defaults to None.
    """

    def __init__(self, runner: Runner, specs: EngineSpecs, *, allow_unsafe_checkpoints: bool,
                 zero_init: bool, rss_at_start_mib: float = 0.0,
                 layout: Optional[Layout] = None):
        self.runner = runner
        self.layout = layout
        self.virtual_ranks: Optional[VirtualRanks] = None  # a layout's, once set up
        # the train loader's own collate_fn, before the layout wraps it (split_retry's)
        self.train_collate: Optional[Callable[..., Any]] = None
        self.specs = specs
        self.allow_unsafe_checkpoints = allow_unsafe_checkpoints
        self.zero_init = zero_init
        self.rss_at_start_mib = rss_at_start_mib
        self.find_unused_parameters = False
        self._checkpointer: Optional[Checkpointer] = None
        self._agreement: Optional[Agreement] = None
        self._weights_initialized = False
        self.compile_counts: Optional[dict[str, int]] = None
        self._held_back: dict[str, Any] = {}  # cfg keys train() does itself

    @classmethod
    def of_run(cls, runner: Runner, cfg: Optional[Config], arguments: Mapping[str, Any], *,
               ds_config: DsConfigSource, allow_unsafe_checkpoints: bool,
               zero_init: bool, layout: Optional[Layout] = None) -> RunStrategy:
        """The strategy of a run with ``Runner.__init__``'s ``arguments``; a bad ds_config,
        NVMe path or ``compile`` value is refused here, before any process group or file.

        On CPU, what the process holds before any model or data is measured first, with the
        modules that building them from the config's scope imports (as ``plan``'s fixed
        cost): the training log's prediction starts there.
        """
        rss_at_start = 0.0
        if not cuda_available():
            import_scope(arguments.get('default_scope', 'mmengine'))
            rss_at_start = rss_mib()
        specs = EngineSpecs.of_run(
            ds_config, getattr(cfg, 'filename', None), arguments.get('train_dataloader'),
            arguments.get('optim_wrapper'), arguments.get('param_scheduler'))
        specs.resolve(world_size=None)
        for spec in specs:
            check_nvme(spec.ds_config)
        check_deepcompile(compile_options(cfg.get('compile') if cfg is not None else None),
                          specs.configs().values())
        return cls(runner, specs, allow_unsafe_checkpoints=allow_unsafe_checkpoints,
                   zero_init=zero_init, rss_at_start_mib=rss_at_start, layout=layout)

    def build_checkpointer(self, *, resume: bool, load_from: Optional[str]) -> None:
        """The run's checkpointer, with what it saves (once, at the end of the runner's
        ``__init__``)."""
        runner = self.runner
        self._checkpointer = Checkpointer(
            runner.work_dir, self.specs, self.bare_model,
            parts=lambda meta, schedulers: checkpoint_parts(self, meta, schedulers),
            call_hook=runner.call_hook, resume=resume, load_from=load_from,
            allow_unsafe=self.allow_unsafe_checkpoints, logger=runner.logger,
            world_size=runner.world_size, rank=runner.rank, seed=runner.seed,
            experiment_name=runner.experiment_name)

    @property
    def checkpointer(self) -> Checkpointer:
        """The run's :class:`~.checkpoint.checkpointer.Checkpointer` (once built)."""
        if self._checkpointer is None:
            raise RuntimeError('The checkpointer is built at the end of the runner\'s '
                               '__init__ (RunStrategy.build_checkpointer).')
        return self._checkpointer

    @property
    def bare_model(self) -> nn.Module:
        """The user's model, whatever wraps it."""
        model = self.runner.model
        return cast(nn.Module, model.module) if is_model_wrapper(model) else model

    def engines(self) -> dict[str, deepspeed.DeepSpeedEngine]:
        """The DeepSpeed engines by name (``'model'`` for one optimizer), once built."""
        return self.specs.engines()

    @property
    def agreement(self) -> Agreement:
        """What the ranks agree on while training (``agreement.py``), created at first use
        with the runner's logging interval."""
        if self._agreement is None:
            self._agreement = Agreement(logging_interval(self.runner))
        return self._agreement

    def build_model(self, runner: Runner, model: Union[nn.Module, dict],
                    build: Callable[[], nn.Module]) -> nn.Module:
        """``build()`` (MMEngine's ``build_model``); under ZeRO-3 a config is built
        partitioned (``zero/partitioned.py``): inside ``deepspeed.zero.Init`` each submodule
        is partitioned as soon as it is built, so the largest model that fits is set by all
        ranks' memory together."""
        specs = self.specs
        specs.resolve(runner.world_size)
        advice = build_advice(model, specs.zero_stage, self.zero_init, specs.several)
        if advice is not None:
            runner.logger.info(advice)
        if not isinstance(model, dict) or advice is not None or not self.zero_init \
                or specs.zero_stage != 3:
            return build()
        streams = rng_state()

        def whole() -> nn.Module:  # drawing what zero_init=False draws
            set_rng_state(streams)
            return build()

        return built_partitioned(build, whole, specs.process_config('zero_optimization'),
                                 runner.logger)

    def leave_unwrapped(self, runner: Runner, model_wrapper_cfg: Optional[dict],
                        model: nn.Module) -> nn.Module:
        """The model as it is (the engine needs the optimizer, built later); its wrapper's
        ``find_unused_parameters`` is kept for the engines (``engine/build.py``)."""
        model, self.find_unused_parameters = left_unwrapped(
            model, model_wrapper_cfg, runner.world_size, runner.cfg.get('sync_bn', None),
            runner.logger)
        return model

    def init_weights(self) -> None:
        """Run the model's ``init_weights()`` once, before any engine partitions it; a model
        built partitioned is initialised with each parameter gathered as torch touches it."""
        if self._weights_initialized:
            return
        if self.specs.built:
            raise RuntimeError('init_weights() must run before the DeepSpeed engine is built.')
        model = self.bare_model
        if hasattr(model, 'init_weights'):
            with gather_on_use(model):
                getattr(model, 'init_weights')()  # noqa: B009  (nn.Module typing)
        self._weights_initialized = True

    def activation_config(self) -> dict:
        """The ds_config's ``activation_checkpointing`` section (empty without one)."""
        return self.specs.process_config('activation_checkpointing')

    def set_up_engines(self) -> None:
        """One engine per optimizer of ``runner.optim_wrapper`` (whatever it is now), and
        their DeepSpeedOptimWrapper(s) in its place: what ``train()`` does before MMEngine's
        ``train()``, whose own ``build_optim_wrapper`` call then finds them built.

        The weights are initialised first (under ZeRO-3 the engine partitions them);
        ``activation_checkpointing`` goes through DeepSpeed's checkpoint where ds_config
        has that section, and ``compile`` compiles each engine's module.
        """
        runner = self.runner
        self.init_weights()
        ds_config = self.activation_config()
        if has_section(ds_config):
            listed = runner.cfg.get('activation_checkpointing') or []
            wrapped = checkpoint_through_deepspeed(self.bare_model, listed, ds_config)
            runner.logger.info('DeepSpeed activation checkpointing configured; modules through '
                               f'its checkpoint: {", ".join(wrapped) or "none listed"}.')
        built = Runner.build_optim_wrapper(runner, as_plain_wrappers(runner.optim_wrapper))
        virtual = None if self.layout is None else \
            self.start_virtual_ranks(runner.train_dataloader)
        split, micro_steps = (1, 1) if virtual is None else (virtual.split, virtual.micro_steps)
        # The engines follow the wrappers built now (runner.optim_wrapper may have changed);
        # a layout's virtual ranks (and their micro-batches) are accumulation micro-steps.
        self.specs.use_settings({
            name: replace(side, accumulative_counts=(side.accumulative_counts or 1) * micro_steps,
                          batch_size=side.batch_size and side.batch_size // split)
            for name, side in mmengine_settings(runner.train_dataloader, built,
                                                runner.param_schedulers).items()})
        self._build_engines(named_optimizers(built))
        options = compile_options(runner.cfg.get('compile'))
        if options is not None:
            self.compile_counts = compile_engines(self.specs, options, runner.logger)
        runner.optim_wrapper = wrap_optimizers(
            self.specs, self.find_unused_parameters,
            own_train_step=overrides(self.bare_model, 'train_step'), micro_steps=micro_steps)
        model = cast(DeepSpeedEngineWrapper, runner.model)
        model.virtual_ranks = virtual
        if virtual is not None:
            model.split_retry = split_retry(self, virtual)

    def start_virtual_ranks(self, loader: Any) -> VirtualRanks:
        """This rank's virtual ranks (a layout's: the train loop's ``loader`` gives their
        batches, the engine wrapper steps them), made at the first call
        (``strategy/layout.py``)."""
        if self.virtual_ranks is None:
            self.virtual_ranks = layout_virtual_ranks(self, loader)
            self.train_collate = loader.collate_fn
        return self.virtual_ranks

    def ensure_engine(self) -> None:
        """For ``val()`` / ``test()``: the plan resolved, and an engine without optimizer
        unless ``train()`` built the engines."""
        self.checkpointer.resolve_plan()  # once, before anything loads
        if not self.specs.built:
            self._build_engines({SINGLE_ENGINE: None})

    def _build_engines(self, optimizers: Mapping[str, Optional[Optimizer]]) -> None:
        """One engine per optimizer (``engine/build.py``); ``runner.model`` wraps them."""
        if self.specs.built:
            raise RuntimeError(
                'The DeepSpeed engines were already built with their optimizers (train() '
                'ran); use runner.optim_wrapper, or build a new runner '
                'to train with another optimizer.' if self.specs.training else
                'The DeepSpeed engine was already built without an optimizer by val()/test(); '
                'call train() first, or build a new runner for training.')
        runner = self.runner
        runner.model, self.find_unused_parameters = build_engines(
            self.specs, self.bare_model, optimizers, world_size=runner.world_size,
            find_unused_parameters=self.find_unused_parameters, logger=runner.logger,
            before_partitioning=self._before_partitioning,
            universal=self.checkpointer.loads_universal(optimizers.values()))
        zero3 = [engine for engine in self.engines().values()
                 if engine.optimizer is not None and engine.zero_optimization_stage() == 3]
        for hook in hooks_update_on_whole_tensors(runner.hooks, zero3):
            runner.logger.info(f'{type(hook).__name__} updates the model on whole tensors '
                               'under ZeRO-3: each update gathers the model it is given.')

    def _before_partitioning(self, specs: EngineSpecs) -> None:
        """What needs the model whole, between the optimizers and ``deepspeed.initialize``."""
        self.load_planned(engines_built=False)
        # hooks that need the whole model (DeepSpeedEMAHook: its fp32 template)
        self.runner.call_hook('before_partitioning', model=self.bare_model)

    def load_planned(self, *, engines_built: bool) -> None:
        """Load what the resume plan says is due now (``Checkpointer.due``) through the
        runner's own ``load_checkpoint`` / ``resume``, as MMEngine's ``load_or_resume``
        calls them: before the engines are built (``load_from`` weights into the bare model)
        and once they are (a resume)."""
        due = self.checkpointer.due(engines_built=engines_built)
        if due is not None:
            load = self.runner.resume if due.resumes else self.runner.load_checkpoint
            load(str(due.path))

    def roll_back(self, path: str, excluded: Iterable[int]) -> None:
        """Restore checkpoint ``path`` and leave ``excluded`` out from there on, besides
        what the train loop's sampler (the one owner of the set) left out before
        (collective; ``guard/hook.py`` decides, the loops call this)."""
        runner = self.runner
        loop = cast(Any, runner.train_loop)
        before = loop.resumable_sampler.excluded
        self.checkpointer.restore(path)
        loop.leave_out(before | set(excluded))  # the restore put the hub's older copy back
        for wrapper in named_wrappers(runner.optim_wrapper).values():
            wrapper.initialize_count_status(runner.model, loop.iter, loop.max_iters)

    @staticmethod
    def optim_wrapper_as_built(
        optim_wrapper: Union[Optimizer, OptimWrapper, dict]
    ) -> Optional[Union[OptimWrapper, OptimWrapperDict]]:
        """The DeepSpeedOptimWrapper(s) :meth:`set_up_engines` built, as given; None for
        anything else (MMEngine's factory builds that)."""
        if isinstance(optim_wrapper, DeepSpeedOptimWrapper) or (
                isinstance(optim_wrapper, OptimWrapperDict) and all(
                    isinstance(w, DeepSpeedOptimWrapper) for w in optim_wrapper.values())):
            return optim_wrapper
        return None

    @property
    def whole_cfg(self) -> Config:
        """The config as given: ``runner.cfg`` with the keys :meth:`keys_held_back` holds
        back from MMEngine's ``train()`` while it runs."""
        cfg = self.runner.cfg
        return Config(dict(cfg.to_dict(), **self._held_back)) if self._held_back else cfg

    @contextlib.contextmanager
    def keys_held_back(self) -> Iterator[None]:
        """MMEngine's ``train()`` runs inside without the cfg keys this strategy does itself.

        ``activation_checkpointing`` (when ds_config has DeepSpeed's section) goes through
        DeepSpeed's checkpoint, and ``compile`` compiles the engines' modules
        (``engine/compile.py``): MMEngine's ``train()`` reads both from ``runner.cfg`` in
        its body and would wrap the modules with torch's checkpoint and compile
        ``train_step`` instead, so they are out of ``runner.cfg`` while it runs (and in
        :attr:`whole_cfg`, which checkpoints record).
        """
        cfg = self.runner.cfg
        keys = ['compile'] if cfg.get('compile') is not None else []
        if cfg.get('activation_checkpointing') is not None \
                and has_section(self.activation_config()):
            keys.append('activation_checkpointing')
        self._held_back = {key: cfg.pop(key) for key in keys}
        try:
            yield
        finally:
            cfg.update(self._held_back)
            self._held_back = {}

    def predicted_peak_mib(self, data_batch: Any,
                           saved: Optional[tuple[int, int]] = None) -> float:
        """What ``mmengine-deepspeed plan`` predicts per rank for this run's engines, at
        the micro-batch of the loop's ``data_batch`` (a layout's first micro-batch).

        ``saved``: what the run's first step saved for backward, measured, for a model the
        meta device cannot run. Raises where the model is not a config, or without
        ``saved`` where tracing fails.
        """
        if isinstance(data_batch, MicroBatches):
            data_batch = data_batch[0]
        micro_batch = int(self.specs.shared('train_micro_batch_size_per_gpu'))
        return self.peak_model(data_batch, micro_batch, saved).peak_mib(micro_batch)[0]

    def peak_model(self, data_batch: Any, samples: int,
                   saved: Optional[tuple[int, int]] = None) -> PeakModel:
        """``plan``'s model of this run's peak per rank by micro-batch (``peak_mib``).

        Traced on a meta-device copy of the config's model with a copy of ``data_batch``
        (``samples`` samples; no second dataset, which would raise the memory being
        predicted; meta ops draw no random numbers); ``saved`` as in
        :meth:`predicted_peak_mib`.
        """
        runner = self.runner
        if not isinstance(runner.cfg.get('model'), dict):
            raise ValueError('the model was given as an instance, not a config')
        return peak_model(self.whole_cfg, self.specs, runner.world_size,
                          local_world_size(runner.world_size), copy.deepcopy(data_batch),
                          samples, self.rss_at_start_mib,
                          None if saved is None else (self.bare_model, saved))
