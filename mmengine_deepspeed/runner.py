"""DeepSpeedRunner: MMEngine's Runner with DeepSpeed engines in place of DDP.

MMEngine wraps the model in ``Runner.__init__`` but builds the optimizer only
in ``train()``; ``deepspeed.initialize`` needs both at once. This runner owns
that ordering (ARCHITECTURE.md, "The data path"): the model is left unwrapped
(built partitioned under ZeRO-3), ``init_weights()`` runs before any engine,
MMEngine's factory builds the optimizer(s), and ``train()`` builds one engine per
optimizer (``engine/build.py``) before MMEngine's ``train()``, which then builds the param
schedulers on their wrappers. ``val()`` and ``test()`` without training
build an engine without an optimizer.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
from typing import Any, Optional, Union, cast

import deepspeed
from mmengine.config import Config
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from .checkpoint.checkpointer import Checkpointer
from .checkpoint.state import rng_state, set_rng_state
from .config.resolve import DsConfigSource
from .config.runner_keys import switch
from .data.loops import IndexedBatches, resumable_loop
from .data.order import resumable_loader
from .dist import cuda_available, init_distributed
from .engine.activation import checkpointed_modules, has_section
from .engine.build import left_unwrapped
from .engine.compile import check_deepcompile, compile_options, compile_report
from .engine.offload import check_nvme
from .engine.spec import EngineSpecs
from .failure import failing_together
from .hooks.failed_steps import NonFinitePolicy, exclude_samples_of
from .hooks.nonfinite import NonFiniteHook
from .hooks.runner_methods import HookMethods
from .message_hub import MessageHubMethods
from .plan.census import import_scope
from .plan.planner import predicted_peak_mib
from .process_memory import rss_mib
from .quiet import quiet_deepspeed
from .runner_checkpoint import CheckpointMethods
from .runner_engines import EngineMethods
from .zero.partitioned import build_advice, built_partitioned


def _from_cfg(cfg: Optional[Config], key: str, value: Any, default: Any) -> Any:
    """A runner argument, else the config's key, else ``default``."""
    if value is not None:
        return value
    return cfg.get(key, default) if cfg is not None else default


@RUNNERS.register_module()
class DeepSpeedRunner(EngineMethods, CheckpointMethods, HookMethods, MessageHubMethods):
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
        nonfinite (dict, optional): What follows a step whose loss or gradients
            were not finite (:class:`~.hooks.nonfinite.NonFinitePolicy`: ``policy``
            ``'skip'``, ``'stop'`` or ``'rollback'``, and its limits). None reads
            ``cfg.nonfinite`` (default ``dict(policy='skip')``). Defaults to None.
        exclude_samples (list[int] | str, optional): Dataset indices the training
            loader leaves out, or the path of a JSON list of them
            (``excluded_samples.json`` of a rollback). None reads
            ``cfg.exclude_samples``. Defaults to None.
        **kwargs: Keyword arguments of :class:`mmengine.runner.Runner`.
    """

    _find_unused_parameters: bool

    def __init__(self, *args: Any, ds_config: DsConfigSource = None,
                 allow_unsafe_checkpoints: Optional[bool] = None,
                 zero_init: Optional[bool] = None, nonfinite: Optional[dict] = None,
                 exclude_samples: Union[list[int], str, None] = None, **kwargs: Any):
        bound = inspect.signature(Runner.__init__).bind(self, *args, **kwargs)
        arguments = bound.arguments
        # what the process holds before any model or data, with the modules that building
        # them from the config's scope imports (as plan's fixed cost): the banner's plan
        # starts here
        self.rss_at_start_mib = 0.0
        if not cuda_available():
            import_scope(arguments.get('default_scope', 'mmengine'))
            self.rss_at_start_mib = rss_mib()
        cfg = arguments.get('cfg')
        cfg = Config(cfg) if isinstance(cfg, dict) and not isinstance(cfg, Config) else cfg
        if ds_config is None and cfg is not None:
            ds_config = cfg.get('ds_config')
        self.allow_unsafe_checkpoints = switch(
            cfg, 'allow_unsafe_checkpoints', allow_unsafe_checkpoints, False)
        self.zero_init = switch(cfg, 'zero_init', zero_init, True)
        self.nonfinite_hook = NonFiniteHook(
            NonFinitePolicy.of(_from_cfg(cfg, 'nonfinite', nonfinite, None)),
            exclude_samples_of(_from_cfg(cfg, 'exclude_samples', exclude_samples, None)))
        self.engine_specs = EngineSpecs.of_run(
            ds_config, getattr(cfg, 'filename', None), arguments.get('train_dataloader'),
            arguments.get('optim_wrapper'), arguments.get('param_scheduler'))
        # Refuse a bad ds_config before any process group or file exists.
        self.engine_specs.resolve(world_size=None)
        for spec in self.engine_specs:
            check_nvme(spec.ds_config)
        check_deepcompile(  # a bad compile value, or DeepCompile where it cannot run, early
            compile_options(cfg.get('compile') if cfg is not None else None),
            self.engine_specs.configs().values())
        self._weights_initialized = False
        self._taken: dict[str, Any] = {}  # cfg keys train() does itself (see _train)
        self._compile_counts: Optional[dict[str, int]] = None
        super().__init__(*args, **kwargs)
        self.checkpointer = Checkpointer(
            self.work_dir, resume=bool(arguments.get('resume', False)),
            load_from=arguments.get('load_from'),
            allow_unsafe=self.allow_unsafe_checkpoints, logger=self.logger)
        self.attach_checkpointer()
        self.checkpointer.resume_after_restart()

    @property
    def engines(self) -> dict[str, deepspeed.DeepSpeedEngine]:
        """The DeepSpeed engines by name (``'model'`` for one optimizer), once built."""
        return self.engine_specs.engines()

    @property
    @override
    def bare_model(self) -> nn.Module:
        """The user's model, wrapped or not."""
        return cast(nn.Module, self.model.module) if is_model_wrapper(self.model) else self.model

    @property
    @override
    def whole_cfg(self) -> Config:
        """The config as given: ``runner.cfg`` with the keys ``train()`` holds back from
        MMEngine's ``train()`` while it runs (see :meth:`_train`)."""
        return Config(dict(self.cfg.to_dict(), **self._taken)) if self._taken else self.cfg

    def predicted_peak_mib(self, data_batch: Any,
                           saved: Optional[tuple[int, int]] = None) -> float:
        """What ``mmengine-deepspeed plan`` predicts per rank for this run's engines.

        Traced on a meta-device copy of the config's model with a copy of the loop's
        batch (no second dataset, which would raise the memory being predicted; meta
        ops draw no random numbers); ``saved``: what the run's first step saved for
        backward, measured, for a model the meta device cannot run. Raises where the
        model is not a config, or without ``saved`` where tracing fails.
        """
        if not isinstance(self.cfg.get('model'), dict):
            raise ValueError('the model was given as an instance, not a config')
        return predicted_peak_mib(self.whole_cfg, self.engine_specs, self.world_size,
                                  int(os.environ.get('LOCAL_WORLD_SIZE', self.world_size)),
                                  copy.deepcopy(data_batch), self.rss_at_start_mib,
                                  None if saved is None else (self.bare_model, saved))

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
    def build_model(self, model: Union[nn.Module, dict]) -> nn.Module:
        """MMEngine's ``build_model``; under ZeRO-3 a config is built partitioned.

        Inside ``deepspeed.zero.Init`` each submodule is partitioned as soon
        as it is built (in the ds_config's dtype), so the largest model
        that fits is set by all ranks' memory together, not by one rank's.
        """
        specs = self.engine_specs
        specs.resolve(self.world_size)
        advice = build_advice(model, specs.zero_stage, self.zero_init, specs.several)
        if advice is not None:
            self.logger.info(advice)
        if not isinstance(model, dict) or advice is not None or not self.zero_init \
                or specs.zero_stage != 3:
            return super().build_model(model)
        streams = rng_state()

        def whole() -> nn.Module:  # drawing what zero_init=False draws
            set_rng_state(streams)
            return Runner.build_model(self, model)

        return built_partitioned(lambda: Runner.build_model(self, model), whole,
                                 specs.process_config('zero_optimization'), self.logger)

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
        """MMEngine's train loops, resuming exactly and without reloading data (``loop.py``);
        another loop class is built as it is, and the log says once what it goes without."""
        built = super().build_train_loop(resumable_loop(loop))
        if not isinstance(built, IndexedBatches):
            self.logger.warning(
                f'The train loop {type(built).__name__} is not one DeepSpeedRunner resumes '
                'exactly (MMEngine\'s EpochBasedTrainLoop or IterBasedTrainLoop): a resume '
                'restores its epoch and iteration as MMEngine does, not its position in the '
                'epoch\'s data nor the workers\' random streams, and a non-finite step cannot '
                'be rolled back (its samples are not known). For those, derive it from '
                'mmengine_deepspeed.data.loops.ResumableEpochBasedTrainLoop or '
                'ResumableIterBasedTrainLoop.')
        return built

    @override
    @staticmethod
    def build_dataloader(dataloader: Union[DataLoader, dict], seed: Optional[int] = None,
                         diff_rank_seed: bool = False) -> DataLoader:
        """MMEngine's ``build_dataloader``, its workers seeding each sample (``data/order.py``).

        A sample's random transform in a worker then depends on the sample, not on
        which worker fetched it or what a resumed run skipped.
        """
        return resumable_loader(
            Runner.build_dataloader(dataloader, seed=seed, diff_rank_seed=diff_rank_seed))

    @override
    def train(self) -> nn.Module:
        """MMEngine's ``train()``; listed ``activation_checkpointing`` modules go
        through DeepSpeed's checkpoint when ds_config has that section (``engine/activation.py``).

        An error on this rank ends every rank at once (``failure.py``); a stop
        signal ends them together after a checkpoint (``hooks/preemption.py``).
        """
        with failing_together(), contextlib.ExitStack() as during_train:
            # hooks enter what lasts until train() returns or raises (PreemptionHook)
            self.call_hook('during_train', stack=during_train)
            self.checkpointer.resolve_plan()  # once, before anything loads
            # a name the model lacks is refused here, naming the key, on both paths
            checkpointed_modules(self.bare_model, self.cfg.get('activation_checkpointing'))
            if not self.engine_specs.built and self._train_loop is not None:
                # MMEngine's train() builds the loop, then the optim wrappers: in that order
                # here, so that its build_optim_wrapper call finds DeepSpeed's built
                self._train_loop = self.build_train_loop(self._train_loop)
                self.set_up_engines()
            return self._train()

    def _train(self) -> nn.Module:
        """MMEngine's ``train()`` without the cfg keys this runner does itself.

        ``activation_checkpointing`` (when ds_config has DeepSpeed's section)
        goes through DeepSpeed's checkpoint, and ``compile`` compiles the
        engines' modules (``engine/compile.py``): MMEngine would wrap the
        modules with torch's checkpoint and compile ``train_step`` instead.
        """
        keys = ['compile'] if self.cfg.get('compile') is not None else []
        if self.cfg.get('activation_checkpointing') is not None \
                and has_section(self._activation_config()):
            keys.append('activation_checkpointing')
        self._taken = {key: self.cfg.pop(key) for key in keys}
        try:
            model = super().train()
        finally:
            self.cfg.update(self._taken)
            self._taken = {}
        if self._compile_counts is not None:
            self.logger.info(compile_report(self._compile_counts))
        return model

    @override
    def val(self) -> dict:
        """Validate; without prior training, through an engine without optimizer."""
        with failing_together():
            self.ensure_engine()
            return super().val()

    @override
    def test(self) -> dict:
        """Test; without prior training, through an engine without optimizer."""
        with failing_together():
            self.ensure_engine()
            return super().test()
