"""MMEngine's Runner checkpoint methods on checkpoint directories, for DeepSpeedRunner.

``save_checkpoint``, ``resume``, ``load_or_resume`` and ``load_checkpoint``
keep MMEngine's signatures and meaning; what differs is that every rank takes
part (a checkpoint is a directory of DeepSpeed shards plus our client state)
and that loading never unpickles untrusted files by default. Each method is a
thin delegation to the runner's :class:`Checkpointer` (``checkpoint/``), which
never sees the runner: what it works on is attached here
(:meth:`CheckpointMethods.attach_checkpointer`), the run state beside the
engines as named parts (:meth:`CheckpointMethods.checkpoint_parts`).
"""
from __future__ import annotations

import os.path as osp
from collections.abc import Sequence
from typing import Any, Optional

from mmengine.runner import EpochBasedTrainLoop, Runner
from torch import nn
from typing_extensions import override

from .checkpoint.checkpointer import Checkpointer, Collaborators
from .checkpoint.layout import META_KEY, CheckpointError
from .checkpoint.parts import Part, run_parts
from .checkpoint.save import save_failure
from .checkpoint.state import plain
from .compat import randomness_cfg
from .engine.spec import EngineSpecs, named_wrappers

# MMEngine's names for the local disk (FileClient's 'disk', the file backends' 'local').
LOCAL_BACKENDS = ('local', 'disk')


class CheckpointMethods(Runner):
    """The Runner's checkpoint API over a :class:`Checkpointer`; mixed into DeepSpeedRunner."""

    checkpointer: Checkpointer
    engine_specs: EngineSpecs

    @property
    def bare_model(self) -> nn.Module:
        """The user's model; the runner defines it."""
        raise NotImplementedError

    @property
    def whole_cfg(self) -> Any:
        """The config as given; the runner defines it."""
        raise NotImplementedError

    def attach_checkpointer(self) -> None:
        """Give the checkpointer what it saves and restores (once, in ``__init__``): the
        run's EngineSpecs, built by ``train()`` / ``val()`` / ``test()`` later, the user's
        model and the parts."""
        self.checkpointer.attach(Collaborators(
            specs=self.engine_specs, model=self.bare_model, parts=self.checkpoint_parts,
            call_hook=self.call_hook, world_size=self.world_size, rank=self.rank,
            seed=self.seed, experiment_name=self.experiment_name))

    def checkpoint_parts(self, meta: Optional[dict] = None,
                         save_param_scheduler: bool = True) -> list[Part]:
        """The run state a checkpoint holds beside the engines, in restore order (``parts.py``).

        Args:
            meta (dict, optional): The meta to save (loop position and facts);
                None when restoring. Defaults to None.
            save_param_scheduler (bool): Save the (built) param schedulers.
                Defaults to True.
        """
        loop = self.train_loop
        schedule = ('' if loop is None else f'max_epochs={self.max_epochs}'
                    if isinstance(loop, EpochBasedTrainLoop) else f'max_iters={self.max_iters}')
        return run_parts(
            wrappers=named_wrappers(self.optim_wrapper) if self.engine_specs.training else {},
            model=self.bare_model, modules=self.engine_specs.modules(), loop=loop,
            hub=self.message_hub, schedulers=self.param_schedulers, schedule=schedule,
            logger=self.logger, meta=meta, save_param_scheduler=save_param_scheduler)

    def _dataset_meta(self) -> Any:
        """The training dataset's ``metainfo`` (None for a runner without training)."""
        dataset = getattr(getattr(self.train_loop, 'dataloader', None), 'dataset', None)
        return plain(getattr(dataset, 'metainfo', None))

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
        return self.checkpointer.load_weights(filename, strict=strict, revise_keys=revise_keys)

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
        consolidated weights and no optimizer state (``weights.py``);
        resuming from it restores everything else.
        """
        for key, args in (('file_client_args', file_client_args),
                          ('backend_args', backend_args)):
            if args and args.get('backend') not in LOCAL_BACKENDS:
                raise ValueError(
                    f'CheckpointHook {key}={args} names a remote storage backend; '
                    'DeepSpeedRunner saves checkpoints to a local (or mounted) directory: '
                    f'remove {key}, or copy the checkpoint directory to remote storage after '
                    'the save.')
        weights_only = not (save_optimizer and self.engine_specs.training)
        if save_optimizer and weights_only:
            self.logger.info(f'No optimizer exists yet (train() builds it): {filename} holds '
                             'the weights and no optimizer state.')
        # The loop position MMEngine records (a runner without training has none).
        epoch, iteration = (self.epoch, self.iter) if self.train_loop is not None else (0, 0)
        meta = dict(meta or {})
        meta.setdefault('epoch', epoch + 1 if by_epoch else epoch)
        meta.setdefault('iter', iteration if by_epoch else iteration + 1)
        path = osp.join(out_dir, filename)
        try:
            self.checkpointer.save(
                path, meta=dict(meta, cfg=self.whole_cfg.pretty_text,
                                dataset_meta=self._dataset_meta()),
                weights_only=weights_only, save_param_scheduler=save_param_scheduler)
        except Exception as e:  # any failure: one message that says what to do
            message = save_failure(path, e, self.work_dir)
            if self.rank == 0:
                self.logger.error(message)
            raise CheckpointError(message) from e

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
        if not self.engine_specs.training:
            # DeepSpeed restores optimizer partitions only into the engine
            # train() builds (its ZeRO stage, its optimizer); an evaluation
            # engine would refuse a ZeRO-1/2 checkpoint. The weights are
            # loaded now, for val()/test(); the rest waits for train().
            self.checkpointer.request_resume(filename)
            self.load_checkpoint(filename)
            self.logger.info(f'Weights loaded from {filename}; its optimizer state, schedulers '
                             'and loop position are restored when train() builds the engines.')
            return
        client = self.checkpointer.restore(filename)
        resumed_seed = client[META_KEY].get('seed')
        configured_seed = randomness_cfg(self).get('seed')
        if resumed_seed is not None and resumed_seed != configured_seed:
            self.logger.warning(f'Resumed seed {resumed_seed} differs from the config seed '
                                f'{configured_seed}; the checkpoint\'s is kept.')
        self.logger.info(f'Resumed from {filename}: epoch {self.epoch}, iter {self.iter}')

    @override
    def load_or_resume(self) -> None:
        """Carry out the resume plan (``checkpoint/resume_plan.py``), resolved on first use.

        ``load_from`` weights went into the bare model before the engines;
        a resume restores everything into the training engines, or, before
        them (``val()``/``test()``), loads its weights. Incomplete checkpoint
        directories (a save that was killed) are skipped with a warning.
        """
        plan = self.checkpointer.resolve_plan()
        if not plan.resumes or self.checkpointer.restored:
            return
        # Into the training engines; before them (val()/test()) the weights now and the
        # rest when train() builds the engines, unless the weights are in already.
        if self.engine_specs.training or not self.checkpointer.weights_loaded:
            self.resume(str(plan.path))
