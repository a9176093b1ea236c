"""DeepSpeedRunner: MMEngine's Runner with DeepSpeed engines in place of DDP.

MMEngine wraps the model in ``Runner.__init__`` but builds the optimizer only
in ``train()``; ``deepspeed.initialize`` needs both at once. This runner owns
that ordering (ARCHITECTURE.md, "The data path"): the model is left unwrapped
(built partitioned under ZeRO-3), ``init_weights()`` runs before any engine,
MMEngine's factory builds the optimizer(s), and ``train()`` has the strategy build
one engine per optimizer (``strategy/run.py``) before MMEngine's ``train()``, which
then builds the param schedulers on their wrappers. ``val()`` and ``test()`` without
training build an engine without an optimizer. What DeepSpeed touches is the
strategy's; each override here is the hand-off in a few lines.
"""
from __future__ import annotations

import contextlib
import inspect
import os.path as osp
from collections.abc import Sequence
from typing import Any, Optional, Union

from mmengine.config import Config
from mmengine.logging import MessageHub, MMLogger
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import RUNNERS
from mmengine.runner import Runner
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from .config.layout import Layout
from .config.resolve import DsConfigSource
from .config.runner_keys import switch
from .data.loops import IndexedBatches, resumable_loop
from .data.order import resumable_loader
from .dist import init_distributed
from .engine.activation import checkpointed_modules
from .engine.compile import compile_report
from .engine.spec import as_plain_wrappers
from .failure import failing_together
from .guard.failed_steps import NonFinitePolicy, exclude_samples_of
from .guard.hook import NonFiniteHook
from .hooks.calling import HookCalls
from .hooks.registration import (
    added_hooks,
    added_hooks_info,
    deepspeed_custom_hooks,
    deepspeed_default_hooks,
    in_priority_order,
)
from .message_hub import deferred_message_hub, take_unused_experiment_name
from .quiet import quiet_deepspeed
from .strategy import RunStrategy
from .strategy import checkpoints as strategy_checkpoints


def _from_cfg(cfg: Optional[Config], key: str, value: Any, default: Any) -> Any:
    """A runner argument, else the config's key, else ``default``."""
    if value is not None:
        return value
    return cfg.get(key, default) if cfg is not None else default


@RUNNERS.register_module()
class DeepSpeedRunner(Runner):
    """A :class:`mmengine.runner.Runner` that trains through DeepSpeed.

    Each override hands DeepSpeed's part to :attr:`strategy` (``strategy/``), the one
    owner of the engines, the checkpointer and the ranks' agreement.

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
            were not finite (:class:`~.guard.hook.NonFinitePolicy`: ``policy``
            ``'skip'``, ``'stop'`` or ``'rollback'``, and its limits). None reads
            ``cfg.nonfinite`` (default ``dict(policy='skip')``). Defaults to None.
        exclude_samples (list[int] | str, optional): Dataset indices the training
            loader leaves out, or the path of a JSON list of them
            (``excluded_samples.json`` of a rollback). None reads
            ``cfg.exclude_samples``. Defaults to None.
        layout (dict, optional): ``dict(world_size=N)``: train as the N-rank run of the
            config would, on any number of ranks that divides N, each rank running N/W
            virtual ranks as the micro-steps of every iteration (``config/layout.py``).
            None reads ``cfg.layout`` (default: the run's own ranks). Defaults to None.
        **kwargs: Keyword arguments of :class:`mmengine.runner.Runner`.
    """


    strategy: RunStrategy  # what DeepSpeed touches, built before MMEngine's __init__
    added_hooks: list  # the runner's own hooks, run beside runner.hooks

    def __init__(self, *args: Any, ds_config: DsConfigSource = None,
                 allow_unsafe_checkpoints: Optional[bool] = None,
                 zero_init: Optional[bool] = None, nonfinite: Optional[dict] = None,
                 exclude_samples: Union[list[int], str, None] = None,
                 layout: Optional[dict] = None, **kwargs: Any):
        arguments = inspect.signature(Runner.__init__).bind(self, *args, **kwargs).arguments
        cfg = arguments.get('cfg')
        cfg = Config(cfg) if isinstance(cfg, dict) and not isinstance(cfg, Config) else cfg
        if ds_config is None and cfg is not None:
            ds_config = cfg.get('ds_config')
        self.strategy = RunStrategy.of_run(
            self, cfg, arguments, ds_config=ds_config,
            allow_unsafe_checkpoints=switch(cfg, 'allow_unsafe_checkpoints',
                                            allow_unsafe_checkpoints, False),
            zero_init=switch(cfg, 'zero_init', zero_init, True),
            layout=Layout.of(_from_cfg(cfg, 'layout', layout, None)))
        self.nonfinite_hook = NonFiniteHook(
            NonFinitePolicy.of(_from_cfg(cfg, 'nonfinite', nonfinite, None)),
            exclude_samples_of(_from_cfg(cfg, 'exclude_samples', exclude_samples, None)))
        if self.strategy.layout is not None and self.nonfinite_hook.policy.policy == 'rollback':
            raise ValueError(
                'layout does not roll back yet (nonfinite policy=\'rollback\'): the samples '
                'left out would be those of every virtual rank of the failed iteration, not '
                'the failing rank\'s as on N ranks. Use policy \'skip\' or \'stop\', or '
                'remove layout.')
        self._hook_calls = HookCalls(self.strategy.specs)
        super().__init__(*args, **kwargs)
        self.strategy.build_checkpointer(resume=bool(arguments.get('resume', False)),
                                         load_from=arguments.get('load_from'))

    @property
    def whole_cfg(self) -> Config:
        """The config as given: ``runner.cfg`` with the keys ``train()`` holds back from
        MMEngine's ``train()`` while it runs (``RunStrategy.keys_held_back``)."""
        return self.strategy.whole_cfg

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
        """MMEngine's logger, under an experiment name no earlier runner here has taken
        (``message_hub.take_unused_experiment_name``)."""
        take_unused_experiment_name(self)
        return super().build_logger(log_level=log_level, log_file=log_file, **kwargs)

    @override
    def build_message_hub(self, message_hub: Optional[dict] = None) -> MessageHub:
        """MMEngine's hub, reading tensor values on the host only when it is read
        (``message_hub.DeferredMessageHub``: no wait per iteration)."""
        return deferred_message_hub(message_hub, self.experiment_name)

    @override
    def build_model(self, model: Union[nn.Module, dict]) -> nn.Module:
        """MMEngine's ``build_model``; under ZeRO-3 a config is built partitioned
        (``RunStrategy.build_model``)."""
        return self.strategy.build_model(self, model, lambda: Runner.build_model(self, model))

    @override
    def wrap_model(self, model_wrapper_cfg: Optional[dict], model: nn.Module) -> nn.Module:
        """Leave the model unwrapped (the engine needs the optimizer, built later);
        ``find_unused_parameters`` is honoured (``RunStrategy.leave_unwrapped``)."""
        return self.strategy.leave_unwrapped(self, model_wrapper_cfg, model)

    @override
    def _init_model_weights(self) -> None:
        """``init_weights()`` once, before the engines (``RunStrategy.init_weights``):
        MMEngine calls this after building the optimizer, when the engine would own (and
        under ZeRO-3 partition) the parameters; ``train()`` calls it earlier."""
        self.strategy.init_weights()

    @override
    def build_optim_wrapper(
        self, optim_wrapper: Union[Optimizer, OptimWrapper, dict]
    ) -> Union[OptimWrapper, OptimWrapperDict]:
        """MMEngine's factory: MMEngine's optim wrappers from a config, an optimizer or a
        built wrapper, any number of times, changing nothing else; the DeepSpeed wrappers
        ``train()`` built are returned as they are (MMEngine's ``train()``'s own call)."""
        built = self.strategy.optim_wrapper_as_built(optim_wrapper)
        return built if built is not None else super().build_optim_wrapper(
            as_plain_wrappers(optim_wrapper, only_ours=True))

    @override
    def build_train_loop(self, loop: Any) -> Any:
        """MMEngine's train loops, resuming exactly and without reloading data (``data/``);
        another loop class is built as it is, and the log says once what it goes without."""
        built = super().build_train_loop(resumable_loop(loop))
        if not isinstance(built, IndexedBatches) and self.strategy.layout is not None:
            raise ValueError(
                f'layout needs MMEngine\'s train loops (its batches are made by them); the '
                f'train loop {type(built).__name__} is not one. Derive it from '
                'mmengine_deepspeed.data.loops.ResumableEpochBasedTrainLoop or '
                'ResumableIterBasedTrainLoop, or remove layout.')
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
    def scale_lr(self, optim_wrapper: OptimWrapper,
                 auto_scale_lr: Optional[dict] = None) -> None:
        """MMEngine's ``auto_scale_lr``; under a layout for its global batch (N x the
        batch), which the run trains with whatever its own number of ranks."""
        layout = self.strategy.layout
        if layout is not None and auto_scale_lr and auto_scale_lr.get('enable', False):
            # MMEngine scales by world size x batch / base: the same ratio for N ranks
            base = auto_scale_lr['base_batch_size']
            self.logger.info(f'auto_scale_lr for the layout\'s {layout.world_size} ranks: '
                             f'base_batch_size {base} read as {base * self.world_size} / '
                             f'{layout.world_size} for this run\'s {self.world_size}.')
            auto_scale_lr = dict(auto_scale_lr,
                                 base_batch_size=base * self.world_size / layout.world_size)
        super().scale_lr(optim_wrapper, auto_scale_lr)

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
    def register_default_hooks(self, hooks: Optional[dict] = None) -> None:
        """MMEngine's default hooks, with the crash-safe checkpoint hook
        (``hooks/registration.py``)."""
        super().register_default_hooks(deepspeed_default_hooks(hooks))

    @override
    def register_hooks(self, default_hooks: Optional[dict] = None,
                       custom_hooks: Optional[list] = None) -> None:
        """MMEngine's hooks, with ``EMAHook`` made DeepSpeed-aware; the runner's own hooks
        (throughput, preemption, streams after validation, non-finite steps) beside
        them, in :attr:`added_hooks` (``hooks/registration.py``)."""
        self.added_hooks = in_priority_order(added_hooks(default_hooks, custom_hooks),
                                             [self.nonfinite_hook])
        super().register_hooks(default_hooks, deepspeed_custom_hooks(custom_hooks))

    @override
    def call_hook(self, fn_name: str, **kwargs: Any) -> None:
        """MMEngine's ``call_hook`` over the registered hooks and :attr:`added_hooks`, in
        priority order (``hooks/calling.py``)."""
        self._hook_calls.call(self, self.added_hooks, super().call_hook, fn_name, kwargs)

    @override
    def get_hooks_info(self) -> str:
        """MMEngine's listing of the registered hooks, then the runner's own."""
        return f'{super().get_hooks_info()}\n{added_hooks_info(self.added_hooks)}'

    @override
    def load_checkpoint(self, filename: str, map_location: Any = 'cpu', strict: bool = False,
                        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),)) -> dict:
        """Load weights (our checkpoint directory, ``.pth`` or ``.safetensors``).

        Before the engine exists (``load_from``) the weights go into the bare
        model; into an evaluation engine they are written under
        ``GatheredParameters`` (ZeRO-3). A training engine keeps fp32
        masters the weights would not reach: use ``load_from`` (or
        ``resume``) instead. ``map_location`` is accepted for MMEngine
        compatibility; weights are read on CPU.

        Args:
            filename (str): What to load.
            map_location (Any): Ignored. Defaults to ``'cpu'``.
            strict (bool): Refuse missing or unexpected keys. Defaults to False.
            revise_keys (Sequence[tuple[str, str]]): ``(pattern, replacement)``
                rewrites of the checkpoint's keys. Defaults to stripping
                ``module.``.

        Returns:
            dict: ``{'meta': ..., 'state_dict': ...}``.
        """
        return self.strategy.checkpointer.load_weights(filename, strict=strict,
                                                       revise_keys=revise_keys)

    @override
    def save_checkpoint(self, out_dir: str, filename: str,
                        file_client_args: Optional[dict] = None, save_optimizer: bool = True,
                        save_param_scheduler: bool = True, meta: Optional[dict] = None,
                        by_epoch: bool = True, backend_args: Optional[dict] = None) -> None:
        """Save a checkpoint directory on every rank (MMEngine's is rank 0 only).

        Called by CheckpointHook on all ranks; arguments as
        :meth:`mmengine.runner.Runner.save_checkpoint`. With
        ``save_optimizer=False``, or before ``train()`` built an optimizer
        (after ``val()``, or before anything), the checkpoint holds the
        consolidated weights and no optimizer state (``checkpoint/weights.py``);
        resuming from it restores everything else.
        """
        strategy_checkpoints.save_checkpoint(
            self.strategy, osp.join(out_dir, filename), save_optimizer=save_optimizer,
            save_param_scheduler=save_param_scheduler, meta=meta, by_epoch=by_epoch,
            backends=dict(file_client_args=file_client_args, backend_args=backend_args))

    @override
    def resume(self, filename: str, resume_optimizer: bool = True,
               resume_param_scheduler: bool = True, map_location: Any = 'default') -> None:
        """Resume everything from checkpoint directory ``filename`` (collective).

        Engine (weights and optimizer partitions), loop position, param
        schedulers, message hub, this rank's RNG state and hooks' state come
        back exactly. Called before ``train()``, the weights are loaded at
        once and the rest when ``train()`` has built the engines.
        ``resume_optimizer``, ``resume_param_scheduler`` and ``map_location``
        are accepted for MMEngine compatibility; DeepSpeed places the state
        itself.
        """
        strategy_checkpoints.resume(self.strategy, filename)

    @override
    def load_or_resume(self) -> None:
        """Carry out the resume plan (``checkpoint/resume_plan.py``), resolved on first use:
        ``load_from`` weights went into the bare model before the engines; a resume restores
        everything into training engines, and only its weights into an evaluation engine
        (``Checkpointer.due``). Incomplete checkpoint directories (a save that was killed)
        are skipped with a warning."""
        self.strategy.load_planned(engines_built=True)

    @override
    def train(self) -> nn.Module:
        """MMEngine's ``train()``, the engines set up before it; listed
        ``activation_checkpointing`` modules go through DeepSpeed's checkpoint when
        ds_config has that section, and ``compile`` compiles the engines' modules
        (``RunStrategy.keys_held_back``).

        An error on this rank ends every rank at once (``failure.py``); a stop
        signal ends them together after a checkpoint (``hooks/preemption.py``).
        """
        strategy = self.strategy
        with failing_together(), contextlib.ExitStack() as during_train:
            # hooks enter what lasts until train() returns or raises (PreemptionHook)
            self.call_hook('during_train', stack=during_train)
            strategy.checkpointer.resolve_plan()  # once, before anything loads
            # a name the model lacks is refused here, naming the key, on both paths
            checkpointed_modules(strategy.bare_model, self.cfg.get('activation_checkpointing'))
            if not strategy.specs.built and self._train_loop is not None:
                # MMEngine's train() builds the loop, then the optim wrappers: in that order
                # here, so that its build_optim_wrapper call finds DeepSpeed's built
                self._train_loop = self.build_train_loop(self._train_loop)
                strategy.set_up_engines()
            with strategy.keys_held_back():
                model = super().train()
            if strategy.compile_counts is not None:
                self.logger.info(compile_report(strategy.compile_counts))
            return model

    @override
    def val(self) -> dict:
        """Validate; without prior training, through an engine without optimizer."""
        with failing_together():
            self.strategy.ensure_engine()
            return super().val()

    @override
    def test(self) -> dict:
        """Test; without prior training, through an engine without optimizer."""
        with failing_together():
            self.strategy.ensure_engine()
            return super().test()
