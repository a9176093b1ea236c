"""DeepSpeedRunner: MMEngine's Runner with a DeepSpeed engine in place of DDP.

MMEngine wraps the model in ``Runner.__init__`` but builds the optimizer only
in ``train()``; ``deepspeed.initialize`` needs both at once. This runner owns
that ordering in one place, ``_build_engine``:

1. the model is built by MMEngine and left unwrapped in ``__init__``;
2. ``init_weights()`` runs once, before anything is partitioned;
3. the optimizer is built from ``optim_wrapper`` by MMEngine's own machinery
   (``paramwise_cfg``, custom constructors, ``auto_scale_lr``);
4. the ds_config is resolved against the MMEngine config (``config.py``);
5. ``deepspeed.initialize`` returns the engine, which becomes
   ``runner.model`` (a :class:`DeepSpeedEngineWrapper`) and
   ``runner.optim_wrapper`` (a :class:`DeepSpeedOptimWrapper`).

Param schedulers are built afterwards by MMEngine on the DeepSpeed optim
wrapper, so they drive the learning rate DeepSpeed steps with. ``val()`` and
``test()`` without training build an engine without an optimizer.
"""
from __future__ import annotations

import inspect
import os.path as osp
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Optional, Union

import deepspeed
import torch
from mmengine.config import Config
from mmengine.hooks import CheckpointHook, EMAHook
from mmengine.model import convert_sync_batchnorm, is_model_wrapper, revert_sync_batchnorm
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import RUNNERS
from mmengine.runner import EpochBasedTrainLoop, Runner
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from .checkpoint import io as ckpt_io
from .checkpoint.hook import DeepSpeedCheckpointHook  # noqa: F401  registers it
from .checkpoint.layout import check_checkpoint, find_latest_complete
from .checkpoint.loop import ResumableEpochBasedTrainLoop  # noqa: F401  registers it
from .checkpoint.reshard import Layout, check_reshardable, needs_universal
from .config import (
    DsConfigSource,
    MMEngineSide,
    bf16_request,
    precision,
    resolve_ds_config,
    zero_stage,
)
from .dist import cuda_available, init_distributed, native_bf16, quiet_deepspeed
from .ema import DeepSpeedEMAHook
from .engine import DeepSpeedEngineWrapper, gathered
from .model_settings import fit_to_model
from .monitor import ThroughputHook, banner, precision_note
from .optim_wrapper import DeepSpeedOptimWrapper
from .scalars import engine_config, initializable
from .unused import zero3_unsupported

# torch optimizers that update each element from its own gradient and state
# only, and therefore behave the same on ZeRO's flattened partitions. DeepSpeed
# asks for ``zero_allow_untested_optimizer`` for all but Adam(W)/Adagrad; for
# these we set it, for anything else (LARS, LAMB, Shampoo...) the user decides.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.RMSprop, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
)

CAST_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': None}


ENGINE_KEY = 'model'


def _batch_size(dataloader: Any) -> Optional[int]:
    if isinstance(dataloader, DataLoader):
        return dataloader.batch_size
    if isinstance(dataloader, dict):
        return dataloader.get('batch_size')
    return None


def mmengine_side(train_dataloader: Any, optim_wrapper: Any,
                  param_scheduler: Any) -> MMEngineSide:
    """What the MMEngine config says about batch, accumulation and clipping.

    Args:
        train_dataloader (DataLoader | dict | None): Runner argument.
        optim_wrapper (OptimWrapper | dict | None): Runner argument.
        param_scheduler (Any): Runner argument.

    Returns:
        MMEngineSide: The overlap with the ds_config.
    """
    if isinstance(optim_wrapper, OptimWrapperDict) or (
            isinstance(optim_wrapper, dict) and optim_wrapper
            and 'optimizer' not in optim_wrapper and 'constructor' not in optim_wrapper):
        raise ValueError(
            'optim_wrapper defines several optimizers (an OptimWrapperDict); DeepSpeedRunner '
            'supports one optimizer for now. Merge them into one optim_wrapper with '
            'paramwise_cfg, or train this model with MMEngine\'s Runner.')
    if isinstance(optim_wrapper, OptimWrapper):
        clip = optim_wrapper.clip_grad_kwargs
        if clip and getattr(optim_wrapper, 'grad_name', 'grad_norm') == 'grad_value':
            clip = dict(clip, type='value')
        return MMEngineSide(
            batch_size=_batch_size(train_dataloader),
            accumulative_counts=optim_wrapper._accumulative_counts,
            clip_grad=clip or None,
            optim_wrapper_type=type(optim_wrapper).__name__,
            has_optim_wrapper=True,
            has_param_scheduler=param_scheduler is not None)
    wrapper_cfg = optim_wrapper or {}
    return MMEngineSide(
        batch_size=_batch_size(train_dataloader),
        accumulative_counts=wrapper_cfg.get('accumulative_counts'),
        clip_grad=wrapper_cfg.get('clip_grad'),
        optim_wrapper_type=wrapper_cfg.get('type'),
        has_optim_wrapper=optim_wrapper is not None,
        has_param_scheduler=param_scheduler is not None)


@RUNNERS.register_module()
class DeepSpeedRunner(Runner):
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
        **kwargs: Keyword arguments of :class:`mmengine.runner.Runner`.
    """

    _has_loaded: bool
    _find_unused_parameters: bool

    def __init__(self, *args: Any, ds_config: DsConfigSource = None,
                 allow_unsafe_checkpoints: Optional[bool] = None, **kwargs: Any):
        bound = inspect.signature(Runner.__init__).bind(self, *args, **kwargs)
        arguments = bound.arguments
        cfg = arguments.get('cfg')
        cfg = Config(cfg) if isinstance(cfg, dict) and not isinstance(cfg, Config) else cfg
        if ds_config is None and cfg is not None:
            ds_config = cfg.get('ds_config')
        if allow_unsafe_checkpoints is None:
            allow_unsafe_checkpoints = bool(cfg.get('allow_unsafe_checkpoints', False)) \
                if cfg is not None else False
        self.allow_unsafe_checkpoints = allow_unsafe_checkpoints
        filename = getattr(cfg, 'filename', None)
        self._ds_config_source = ds_config
        self._config_dir = osp.dirname(osp.abspath(filename)) if filename else None
        self._side = mmengine_side(arguments.get('train_dataloader'),
                                   arguments.get('optim_wrapper'),
                                   arguments.get('param_scheduler'))
        # Refuse a bad ds_config before any process group or file exists.
        self._resolve_ds_config(world_size=None)
        self._weights_initialized = False
        self._resume_target: Optional[tuple[Optional[str]]] = None
        self.engines: dict[str, deepspeed.DeepSpeedEngine] = {}
        self.ds_config: dict = {}
        super().__init__(*args, **kwargs)

    def _resolve_ds_config(self, world_size: Optional[int]) -> dict:
        return resolve_ds_config(self._ds_config_source, self._side, world_size=world_size,
                                 cuda_available=cuda_available(),
                                 config_dir=self._config_dir, native_bf16=native_bf16())

    def setup_env(self, env_cfg: dict) -> None:
        """Create the process group (CPU-safe, with a timeout), then MMEngine's setup.

        MMEngine's ``init_dist`` calls ``torch.cuda.set_device``
        unconditionally; with the group already up, ``Runner.setup_env`` skips
        it. Launcher ``'none'`` gets a one-process group, which DeepSpeed needs.
        """
        init_distributed(self.launcher, env_cfg.get('dist_cfg'))
        super().setup_env(env_cfg)
        quiet_deepspeed(self.rank, verbose=self.cfg.get('log_level', 'INFO') == 'DEBUG')

    def wrap_model(self, model_wrapper_cfg: Optional[dict], model: nn.Module) -> nn.Module:
        """Leave the model unwrapped: the engine needs the optimizer, built later.

        Args:
            model_wrapper_cfg (dict, optional): ``find_unused_parameters``
                is honoured (ranks may use different parameters in an
                iteration); other DDP options are ignored with a warning.
            model (nn.Module): The built model.

        Returns:
            nn.Module: The model, SyncBN reverted for a single process.
        """
        if is_model_wrapper(model):
            raise TypeError(
                f'model is already wrapped in {type(model).__name__}; pass the bare model, '
                'DeepSpeedRunner wraps it in a DeepSpeed engine.')
        wrapper_cfg = dict(model_wrapper_cfg or {})
        self._find_unused_parameters = bool(wrapper_cfg.pop('find_unused_parameters', False))
        wrapper_cfg.pop('type', None)
        if wrapper_cfg:
            self.logger.warning(
                f'model_wrapper_cfg keys {sorted(wrapper_cfg)} are ignored: DeepSpeedRunner wraps '
                'the model in a DeepSpeed engine, configured by ds_config (only '
                'find_unused_parameters is honoured).')
        if self.world_size == 1:
            return revert_sync_batchnorm(model)
        sync_bn = self.cfg.get('sync_bn', None)
        return convert_sync_batchnorm(model, sync_bn) if sync_bn is not None else model

    @property
    def bare_model(self) -> nn.Module:
        """The user's model, wrapped or not."""
        return self.model.module if is_model_wrapper(self.model) else self.model

    def build_train_loop(self, loop: Any) -> Any:
        """MMEngine's train loop, with epoch-based loops able to resume mid-epoch."""
        if isinstance(loop, dict):
            loop = dict(loop)
            if loop.get('type') in ('EpochBasedTrainLoop', EpochBasedTrainLoop) \
                    or ('type' not in loop and loop.get('by_epoch')):
                loop['type'] = 'ResumableEpochBasedTrainLoop'
                loop.pop('by_epoch', None)
        return super().build_train_loop(loop)

    def _init_model_weights(self) -> None:
        """Run ``init_weights()`` once, before DeepSpeed partitions anything.

        MMEngine calls this after building the optimizer; under ZeRO-3 the
        parameters are partitioned by then, so the runner calls it earlier
        (see :meth:`build_optim_wrapper`) and this later call does nothing.
        """
        if self._weights_initialized:
            return
        if self.engines:
            raise RuntimeError('init_weights() must run before the DeepSpeed engine is built.')
        model = self.bare_model
        if hasattr(model, 'init_weights'):
            getattr(model, 'init_weights')()  # noqa: B009  (nn.Module typing)
        self._weights_initialized = True

    def build_optim_wrapper(
        self, optim_wrapper: Union[Optimizer, OptimWrapper, dict]
    ) -> Union[OptimWrapper, OptimWrapperDict]:
        """Build the optimizer with MMEngine, then the engine around it.

        Args:
            optim_wrapper (Optimizer | OptimWrapper | dict): The
                ``optim_wrapper`` argument.

        Returns:
            DeepSpeedOptimWrapper: The wrapper the train loop steps with.
        """
        if isinstance(optim_wrapper, DeepSpeedOptimWrapper):
            return optim_wrapper
        self._init_model_weights()
        if isinstance(optim_wrapper, dict):
            optim_wrapper = dict(optim_wrapper, type='OptimWrapper')
        built = super().build_optim_wrapper(optim_wrapper)
        if isinstance(built, OptimWrapperDict):
            raise TypeError(
                'The optim_wrapper constructor built several optimizers (an OptimWrapperDict); '
                'DeepSpeedRunner supports one optimizer for now.')
        engine = self._build_engine(built.optimizer)
        return DeepSpeedOptimWrapper(
            engine, built.optimizer,
            accumulative_counts=self.ds_config['gradient_accumulation_steps'],
            clip_max_norm=float(self.ds_config['gradient_clipping']),
            find_unused_parameters=self._find_unused_parameters)

    def _build_engine(self, optimizer: Optional[Optimizer]) -> deepspeed.DeepSpeedEngine:
        """``deepspeed.initialize`` on the bare model; ``runner.model`` becomes its wrapper."""
        if self.engines:
            raise RuntimeError(
                'The DeepSpeed engine was already built without an optimizer by val()/test(); '
                'call train() first, or build a new runner for training.')
        ds_config = self._resolve_ds_config(world_size=self.world_size)
        unsupported = zero3_unsupported(zero_stage(ds_config))
        if self._find_unused_parameters and optimizer is not None and unsupported is not None:
            self.logger.warning(unsupported)
            self._find_unused_parameters = False
        if optimizer is None and zero_stage(ds_config) in (1, 2):
            # ZeRO-1/2 partition optimizer states and gradients only, and
            # DeepSpeed refuses them without an optimizer; the weights of an
            # evaluation engine are the same at stage 0.
            self.logger.info(f'No optimizer (val/test only): ZeRO-{zero_stage(ds_config)} has '
                             'nothing to partition, using ZeRO-0 for this engine.')
            ds_config['zero_optimization']['stage'] = 0
        if optimizer is not None and isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            ds_config.setdefault('zero_allow_untested_optimizer', True)
        model = self.bare_model
        if self._load_from is not None and not self._resume and not self._has_loaded:
            # Into the bare model, so DeepSpeed partitions (and keeps fp32
            # masters of) the loaded weights.
            self.load_checkpoint(self._load_from)
        for hook in self.hooks:
            if isinstance(hook, DeepSpeedEMAHook):
                hook.take_template(model)  # full fp32 weights, before partitioning
        fit_to_model(ds_config, model)
        resume_from = self._resume_path() if optimizer is not None else None
        if resume_from is not None:
            meta = check_checkpoint(resume_from)  # refuse a bad checkpoint before any work
            if needs_universal(Layout(meta['world_size'], meta['zero_stage']),
                               Layout(self.world_size, zero_stage(ds_config)), resume_from):
                check_reshardable(optimizer, resume_from)
                ds_config.setdefault('checkpoint', {})['load_universal'] = True
        with initializable(model, zero3=zero_stage(ds_config) == 3):
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                              config=engine_config(ds_config, model))
        self.ds_config = ds_config
        self.engines[ENGINE_KEY] = engine
        self.model = DeepSpeedEngineWrapper(engine, CAST_DTYPES[precision(ds_config)])
        self.logger.info(banner(ds_config, self.world_size, engine.module, optimizer is not None))
        note = precision_note(bf16_request(self._ds_config_source, self._config_dir),
                              precision(ds_config), cuda_available())
        if note is not None:
            self.logger.warning(note)
        return engine

    def _ensure_engine(self) -> None:
        if not self.engines:
            self._build_engine(optimizer=None)

    def val(self) -> dict:
        """Validate; without prior training, through an engine without optimizer."""
        self._ensure_engine()
        return super().val()

    def test(self) -> dict:
        """Test; without prior training, through an engine without optimizer."""
        self._ensure_engine()
        return super().test()

    def register_default_hooks(self, hooks: Optional[dict] = None) -> None:
        """MMEngine's default hooks, with the crash-safe checkpoint hook.

        A ``CheckpointHook`` config (or the default one) becomes a
        :class:`DeepSpeedCheckpointHook` with the same arguments.
        """
        hooks = dict(hooks or {})
        checkpoint = hooks.get('checkpoint', dict(type='CheckpointHook', interval=1))
        if isinstance(checkpoint, dict) and checkpoint.get('type') in ('CheckpointHook',
                                                                       CheckpointHook):
            checkpoint = dict(checkpoint, type='DeepSpeedCheckpointHook')
        if 'checkpoint' not in hooks or hooks['checkpoint'] is not None:
            hooks['checkpoint'] = checkpoint
        super().register_default_hooks(hooks)

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
        engine = self.engines.get(ENGINE_KEY)
        if engine is not None and engine.client_optimizer is not None:
            raise RuntimeError(
                f'load_checkpoint({filename!r}) after the training engine was built would not '
                'reach its fp32 master weights; set load_from (or resume) before train().')
        model = self.bare_model
        with gathered(model, modify=True) if engine is not None else nullcontext():
            checkpoint = ckpt_io.load_weights_into(
                model, filename, strict=strict, revise_keys=list(revise_keys),
                allow_unsafe=self.allow_unsafe_checkpoints, logger=self.logger)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        self._has_loaded = True
        return checkpoint

    def register_hooks(self, default_hooks: Optional[dict] = None,
                       custom_hooks: Optional[list] = None) -> None:
        """MMEngine's hooks, with ``EMAHook`` made DeepSpeed-aware and a ThroughputHook."""
        hooks = [dict(hook, type='DeepSpeedEMAHook')
                 if isinstance(hook, dict) and hook.get('type') in ('EMAHook', EMAHook) else hook
                 for hook in custom_hooks or []]
        if not any(isinstance(h, ThroughputHook) or (isinstance(h, dict) and h.get('type') in
                                                     ('ThroughputHook', ThroughputHook))
                   for h in hooks):
            hooks.append(dict(type='ThroughputHook'))
        super().register_hooks(default_hooks, hooks)

    def save_checkpoint(self, out_dir: str, filename: str,
                        file_client_args: Optional[dict] = None, save_optimizer: bool = True,
                        save_param_scheduler: bool = True, meta: Optional[dict] = None,
                        by_epoch: bool = True, backend_args: Optional[dict] = None) -> None:
        """Save a checkpoint directory on every rank (MMEngine's is rank 0 only).

        Called by CheckpointHook on all ranks; arguments as
        :meth:`mmengine.runner.Runner.save_checkpoint`. DeepSpeed always
        writes the optimizer partitions, so ``save_optimizer=False`` still
        saves them.
        """
        if file_client_args is not None or backend_args is not None:
            raise ValueError('DeepSpeedRunner saves checkpoints to a local (or mounted) '
                             'directory; remove file_client_args / backend_args.')
        if not self.engines:
            raise RuntimeError('There is no DeepSpeed engine to save yet; call train() first.')
        meta = dict(meta or {})
        if by_epoch:
            meta.setdefault('epoch', self.epoch + 1)
            meta.setdefault('iter', self.iter)
        else:
            meta.setdefault('epoch', self.epoch)
            meta.setdefault('iter', self.iter + 1)
        ckpt_io.save(self, osp.join(out_dir, filename), meta, save_param_scheduler)

    def resume(self, filename: str, resume_optimizer: bool = True,
               resume_param_scheduler: bool = True, map_location: Any = 'default') -> None:
        """Resume everything from checkpoint directory ``filename`` (collective).

        Engine (weights and optimizer partitions), loop position, param
        schedulers, message hub, this rank's RNG state and hooks' state come
        back exactly. ``resume_optimizer``, ``resume_param_scheduler`` and
        ``map_location`` are accepted for MMEngine compatibility; DeepSpeed
        places the state itself.
        """
        self._ensure_engine()
        client = ckpt_io.resume(self, filename, self.allow_unsafe_checkpoints)
        resumed_seed = client['meta'].get('seed')
        if resumed_seed is not None and resumed_seed != self._randomness_cfg.get('seed'):
            self.logger.warning(f'Resumed seed {resumed_seed} differs from the config seed '
                                f'{self._randomness_cfg.get("seed")}; the checkpoint\'s is kept.')
        self._has_loaded = True
        self.logger.info(f'Resumed from {filename}: epoch {self.epoch}, iter {self.iter}')

    def _resume_path(self) -> Optional[str]:
        """The checkpoint ``resume=True`` resumes from (found once, then cached)."""
        if not self._resume:
            return None
        if self._resume_target is None:
            path = self._load_from
            if path is None:
                path, skipped = find_latest_complete(self.work_dir)
                for incomplete in skipped:
                    self.logger.warning(f'Skipping incomplete checkpoint {incomplete} '
                                        '(its save did not finish).')
            self._resume_target = (path,)
        return self._resume_target[0]

    def load_or_resume(self) -> None:
        """Resume (latest complete checkpoint, or ``load_from``) or load weights.

        Incomplete checkpoint directories (a save that was killed) are
        skipped with a warning.
        """
        if self._has_loaded:
            return
        if self._resume:
            path = self._resume_path()
            if path is not None:
                self.resume(path)
            else:
                self.logger.info(f'resume=True but no complete checkpoint in {self.work_dir}; '
                                 'starting from scratch.')
        # load_from without resume was applied to the bare model in _build_engine.
        self._has_loaded = True
