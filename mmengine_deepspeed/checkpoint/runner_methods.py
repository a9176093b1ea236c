"""MMEngine's Runner checkpoint methods on checkpoint directories, for DeepSpeedRunner.

``save_checkpoint``, ``resume``, ``load_or_resume`` and ``load_checkpoint``
keep MMEngine's signatures and meaning; what differs is that every rank takes
part (a checkpoint is a directory of DeepSpeed shards plus our client state)
and that loading never unpickles untrusted files by default.
"""
from __future__ import annotations

import os
import os.path as osp
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Optional, cast

from mmengine.model import is_model_wrapper
from mmengine.runner import Runner
from torch import nn
from typing_extensions import override

from ..compat import request_resume
from ..zero.gather import gathered
from . import io as ckpt_io
from .layout import CheckpointError, find_latest_complete
from .save import save_failure

# MMEngine's names for the local disk (FileClient's 'disk', the file backends' 'local').
LOCAL_BACKENDS = ('local', 'disk')


class CheckpointMethods(Runner):
    """The Runner's checkpoint API; mixed into :class:`DeepSpeedRunner`."""

    engines: dict
    allow_unsafe_checkpoints: bool
    _resume_target: Optional[tuple[Optional[str]]]

    _pending_resume: Optional[str] = None  # resume() ran before train()

    def has_training_engines(self) -> bool:
        """Whether train() (or build_optim_wrapper) built the engines, with optimizers."""
        return any(e.client_optimizer is not None for e in self.engines.values())

    def _resume_after_restart(self) -> None:
        """After the elastic agent restarted the job (``--max-restarts``), resume by itself.

        torchrun (and ``mmengine-deepspeed train --max-restarts``) restart
        every process when one dies, with ``TORCHELASTIC_RESTART_COUNT`` > 0;
        the latest complete checkpoint in ``work_dir`` is then what to
        continue from, whatever ``resume`` / ``load_from`` the config says.
        """
        restart = int(os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0)
        if restart == 0:
            return
        latest, _ = find_latest_complete(self.work_dir)
        if latest is None:
            self.logger.warning(f'Restart {restart} of this job: no complete checkpoint in '
                                f'{self.work_dir} yet, starting over.')
            return
        request_resume(self, latest)
        self.logger.warning(f'Restart {restart} of this job: resuming from {latest}, the latest '
                            'complete checkpoint.')

    @property
    def bare_model(self) -> nn.Module:
        """The user's model, wrapped or not."""
        return cast(nn.Module, self.model.module) if is_model_wrapper(self.model) else self.model

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
        engine = next(iter(self.engines.values()), None)
        if engine is not None and engine.client_optimizer is not None:
            raise RuntimeError(
                f'load_checkpoint({filename!r}) after the training engine was built would not '
                'reach its fp32 master weights; set load_from (or resume) before train().')
        model = self.bare_model
        with gathered(model, modify=True) if engine is not None else nullcontext():
            checkpoint = ckpt_io.load_weights_into(
                model, filename, strict=strict, revise_keys=list(revise_keys),
                allow_unsafe=self.allow_unsafe_checkpoints, logger=self.logger,
                bare=engine is None)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        self._has_loaded = True
        return checkpoint

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
        weights_only = not (save_optimizer and self.has_training_engines())
        if save_optimizer and weights_only:
            self.logger.info(f'No optimizer exists yet (train() builds it): {filename} holds '
                             'the weights and no optimizer state.')
        # The loop position MMEngine records (a runner without training has none).
        epoch, iteration = (self.epoch, self.iter) if self.train_loop is not None else (0, 0)
        meta = dict(meta or {})
        if by_epoch:
            meta.setdefault('epoch', epoch + 1)
            meta.setdefault('iter', iteration)
        else:
            meta.setdefault('epoch', epoch)
            meta.setdefault('iter', iteration + 1)
        path = osp.join(out_dir, filename)
        try:
            ckpt_io.save(self, path, meta, save_param_scheduler, weights_only)
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
        if not self.has_training_engines():
            # DeepSpeed restores optimizer partitions only into the engine
            # train() builds (its ZeRO stage, its optimizer); an evaluation
            # engine would refuse a ZeRO-1/2 checkpoint. The weights are
            # loaded now, for val()/test(); the rest waits for train().
            self._resume, self._resume_target = True, (filename,)
            self._pending_resume = filename
            self.load_checkpoint(filename)
            self.logger.info(f'Weights loaded from {filename}; its optimizer state, schedulers '
                             'and loop position are restored when train() builds the engines.')
            return
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

    @override
    def load_or_resume(self) -> None:
        """Resume (latest complete checkpoint, or ``load_from``) or load weights.

        Incomplete checkpoint directories (a save that was killed) are
        skipped with a warning.
        """
        pending = self._pending_resume
        if pending is not None and self.has_training_engines():
            self._pending_resume = None
            self.resume(pending)
            return
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
