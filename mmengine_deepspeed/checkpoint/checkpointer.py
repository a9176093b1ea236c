"""The runner's checkpointer: what to resume from (the plan), save and restore.

Save and restore are collective (every rank calls them). The engines' state
goes through DeepSpeed (one tag per engine), resharded through a universal
checkpoint when the layout changed; everything else is a named part
(``parts.py``); hooks add and read their own keys (``before_save_checkpoint``
/ ``after_load_checkpoint``). ``load_from`` weights go into the bare model
before ``deepspeed.initialize``, so one path serves ZeRO 0-3 (ZeRO-3
partitions what was loaded) and DeepSpeed's ``load_checkpoint(
load_optimizer_states=False)``, which ignores ``tag`` under ZeRO-3
(DeepSpeed #8499), is never used.
"""
from __future__ import annotations

import os
import os.path as osp
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import Any, Optional

import deepspeed
import mmengine
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..dist import cpu_group
from ..engine.spec import EngineSpecs
from ..version import __version__
from ..zero.gather import gathered
from .layout import (
    CLIENT_FILE,
    RANK_FILE,
    STATE_DICT_KEY,
    WEIGHTS_FILE,
    CheckpointError,
    check_checkpoint,
    engine_modules,
    engine_tag,
    shard_files,
)
from .load_weights import load_weights_into
from .parts import Part
from .reshard import Sharding, check_reshardable, convert
from .resume_plan import ResumeKind, ResumePlan, plan_for, resolve_plan
from .safe_load import check_pickles, safe_load
from .save import save_checkpoint_dir, write_rank_state
from .state import plain
from .weights import load_full_state_dict

CallHook = Callable[..., None]
# The run state beside the engines, in restore order (``parts.py``): given the meta to save
# (None when restoring) and whether the param schedulers are saved.
PartsOf = Callable[[Optional[dict], bool], list[Part]]


def run_facts(specs: EngineSpecs, *, seed: Any, world_size: int,
              experiment_name: str) -> dict[str, Any]:
    """The JSON facts about the run a checkpoint records (beside epoch and iter)."""
    return dict(
        seed=seed, world_size=world_size, zero_stage=specs.zero_stage,
        precision=specs.precision, experiment_name=experiment_name,
        ds_configs=specs.configs(), time=time.strftime('%Y%m%d_%H%M%S'),
        versions=dict(mmengine=str(mmengine.__version__), deepspeed=str(deepspeed.__version__),
                      torch=str(torch.__version__), mmengine_deepspeed=__version__))


def agreed_path(path: str) -> str:
    """Rank 0's ``path`` on every rank: a name built from a clock or a rank-local value
    would otherwise send the ranks' shards to different directories (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return path
    chosen = [path]
    dist.broadcast_object_list(chosen, src=0, group=cpu_group())
    return str(chosen[0])


class Checkpointer:
    """What the run resumes from, and its collective save and restore.

    Built once the runner has its model, hub and hooks, with everything it works on: the
    run's EngineSpecs (built later by ``train()`` / ``val()`` / ``test()``; one object for
    the run), the user's model and the run state beside the engines; it never sees the
    runner. The resume plan is resolved once, when ``train()`` / ``val()`` / ``test()``
    start (:meth:`resolve_plan`), and again only after a new resume request.

    Args:
        work_dir (str): Where checkpoints are (``resume=True`` looks there).
        specs (EngineSpecs): The engines (built or not).
        model (nn.Module): The user's whole model.
        parts (PartsOf): The run state beside the engines (``parts.run_parts``).
        call_hook (CallHook): The runner's ``call_hook`` (hooks add and read their keys).
        resume (bool): MMEngine's ``resume``.
        load_from (str, optional): MMEngine's ``load_from``.
        allow_unsafe (bool): Unpickle beyond tensors and plain types.
        logger (Any): The runner's logger.
        world_size (int): Ranks in the run.
        rank (int): This rank.
        seed (Any): The run's seed, for the checkpoint's facts.
        experiment_name (str): The run's name, for the checkpoint's facts.
    """

    def __init__(self, work_dir: str, specs: EngineSpecs, model: nn.Module, *,
                 parts: PartsOf, call_hook: CallHook, resume: bool, load_from: Optional[str],
                 allow_unsafe: bool, logger: Any, world_size: int, rank: int, seed: Any,
                 experiment_name: str):
        self._work_dir = work_dir
        self._specs = specs
        self._model = model
        self._allow_unsafe = allow_unsafe
        self._logger = logger
        self._parts = parts
        self._call_hook = call_hook
        self._world_size, self._rank = world_size, rank
        self._seed, self._experiment_name = seed, experiment_name
        self._resume = resume
        self._load_from = load_from
        # after the elastic agent restarted the job, the latest checkpoint (resolve_plan)
        self._restart = int(os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0)
        self._plan: Optional[ResumePlan] = None
        self._weights_loaded = False  # weights are in the model (load_from, or a resume's)
        self._restored = False  # the plan's whole state was restored into the engines
        self._last_saved: Optional[tuple[str, int, int]] = None  # path, epoch, iter

    def request_resume(self, path: str) -> None:
        """Resume from ``path`` (``runner.resume`` before ``train()``), whatever the run
        was built with."""
        if self._plan is not None and self._plan.resumes and self._plan.path == path:
            return
        self._resume, self._load_from, self._restart = True, path, 0
        self._plan = None

    @property
    def resuming(self) -> bool:
        """Whether the run continues a checkpoint (not only loads weights): the resolved
        plan's answer (a restarted job resumes whatever the run was built with)."""
        return self._plan.resumes if self._plan is not None else self._resume

    def _sharding(self) -> Sharding:
        return Sharding(self._world_size, self._specs.zero_stage)

    def resolve_plan(self) -> ResumePlan:
        """The resume plan: resolved at its first call (the start of train/val/test, before
        anything loads), then kept until a new resume request."""
        if self._plan is None:
            self._plan = resolve_plan(resume=self._resume, path=self._load_from,
                                      work_dir=self._work_dir, current=self._sharding(),
                                      logger=self._logger, restart=self._restart)
        return self._plan

    def due(self, *, engines_built: bool) -> Optional[ResumePlan]:
        """What the resume plan loads now, if anything: the one place that decides what is
        loaded when (the plan resolved at its first use).

        Before the engines are built: ``load_from`` weights (a ``WEIGHTS`` plan), into the
        bare model, so that DeepSpeed partitions them and keeps fp32 masters of them. Once
        they are built: a resume (a plan that :attr:`~.resume_plan.ResumePlan.resumes`)
        whose state is not in yet: into training engines everything; into an evaluation
        engine (``val()`` / ``test()`` before ``train()``) its weights, unless they are in
        already, and the rest when ``train()`` builds the training engines.

        Returns:
            ResumePlan | None: The plan, where something of it is due now.
        """
        plan = self.resolve_plan()
        if not engines_built:
            return plan if plan.kind is ResumeKind.WEIGHTS and not self._weights_loaded \
                else None
        if not plan.resumes or self._restored:
            return None
        return plan if self._specs.training or not self._weights_loaded else None

    def loads_universal(self, optimizers: Iterable[Optional[Optimizer]]) -> bool:
        """Whether engines about to be built with ``optimizers`` load a universal checkpoint
        (training engines, on a plan that reshards); optimizers a universal checkpoint
        cannot carry are refused before any work is done."""
        plan = self.resolve_plan()
        training = [optimizer for optimizer in optimizers if optimizer is not None]
        if plan.kind is not ResumeKind.UNIVERSAL or not training:
            return False
        for optimizer in training:
            check_reshardable(optimizer, str(plan.path))
        return True

    def load_weights(self, filename: str, *, strict: bool,
                     revise_keys: Sequence[tuple[str, str]]) -> dict:
        """Weights from ``filename`` into the model: the bare one before the engines, an
        evaluation engine's gathered (ZeRO-3); refused once a training engine holds fp32
        masters the weights would not reach."""
        if self._specs.training:
            raise RuntimeError(
                f'load_checkpoint({filename!r}) after the training engine was built would not '
                'reach its fp32 master weights; set load_from (or resume) before train().')
        built = self._specs.built
        with gathered(self._model, modify=True) if built else nullcontext():
            checkpoint = load_weights_into(
                self._model, filename, strict=strict, revise_keys=list(revise_keys),
                allow_unsafe=self._allow_unsafe, logger=self._logger, bare=not built)
        self._call_hook('after_load_checkpoint', checkpoint=checkpoint)
        self._weights_loaded = True
        return checkpoint

    def save(self, path: str, *, meta: dict[str, Any], weights_only: bool,
             save_param_scheduler: bool = True) -> None:
        """Save the engines and every part into directory ``path`` (collective).

        Args:
            path (str): The checkpoint directory (rank 0's is used on every rank).
            meta (dict): The meta to save, with the loop position (``epoch``,
                ``iter``); the run's facts (:func:`run_facts`) are added.
            weights_only (bool): Consolidated weights in place of DeepSpeed's
                shards (``weights.py``): no optimizer state.
            save_param_scheduler (bool): Save the (built) param schedulers.
                Defaults to True.
        """
        started = time.perf_counter()
        path = agreed_path(path)
        facts = run_facts(self._specs, seed=self._seed, world_size=self._world_size,
                          experiment_name=self._experiment_name)
        parts = self._parts(dict(meta, **facts), save_param_scheduler)
        facts.update(epoch=meta['epoch'], iter=meta['iter'])
        if self._specs.several:
            facts['engines'] = self._specs.modules()
        client: dict[str, Any] = {}
        rank_state: dict[str, Any] = {}
        for part in parts:
            state = part.state_dict()
            if state is not None:
                (rank_state if part.per_rank else client)[part.key] = state
        self._call_hook('before_save_checkpoint', checkpoint=client)
        save_checkpoint_dir(path, self._specs.engines(), self._model, plain(client),
                            plain(rank_state), facts, weights_only=weights_only)
        self._last_saved = (path, int(facts['epoch']), int(facts['iter']))
        self._logger.info(f'Checkpoint {path} saved in {time.perf_counter() - started:.1f} s.')

    def after_validation(self, epoch: int, iteration: int) -> None:
        """Rewrite this rank's own state in the checkpoint saved at this loop position, if any.

        A validation inside training runs right after the checkpoint of its
        iteration and draws from the training's random streams (as with
        Runner). A run resumed from a checkpoint whose position is this one
        (``epoch``, ``iteration``) goes on after the validation, so the
        checkpoint must hold the streams the validation left, which the run
        that never stopped goes on from. (One saved at the last iteration of an
        epoch records the epoch before: a run resumed from it ends that epoch
        and validates again, from the streams saved before the validation.)
        Each rank writes only its own file (not collective); a run stopped during
        the validation keeps the streams from before it.
        """
        if self._last_saved is None or self._last_saved[1:] != (epoch, iteration) \
                or not osp.isdir(self._last_saved[0]):
            return
        write_rank_state(self._last_saved[0], plain(
            {part.key: state for part in self._parts(None, True)
             if part.per_rank and (state := part.state_dict()) is not None}))

    def restore(self, path: str) -> dict[str, Any]:
        """Restore the engines and every part from ``path`` (collective).

        Returns:
            dict: The checkpoint's client state (as hooks saw it when saving).
        """
        started = time.perf_counter()
        plan = plan_for(path, self._sharding())
        meta = check_checkpoint(path)
        check_pickles([*shard_files(path), osp.join(path, CLIENT_FILE)], self._allow_unsafe)
        client = safe_load(osp.join(path, CLIENT_FILE), self._allow_unsafe)
        if plan.kind is ResumeKind.WEIGHTS_ONLY:
            self._load_weights_only(path)
        else:
            self._load_engines(path, meta, plan.kind is ResumeKind.UNIVERSAL)
        # On another world size, rank r takes the RNG and buffers of rank r mod N.
        rank_file = osp.join(path, RANK_FILE.format(rank=self._rank % meta['world_size']))
        rank_state = safe_load(rank_file, self._allow_unsafe)
        every: Optional[list[dict[str, Any]]] = None  # every saved rank's file, if asked for
        for part in self._parts(None, True):
            if part.from_every_rank:
                every = every or [safe_load(osp.join(path, RANK_FILE.format(rank=r)),
                                            self._allow_unsafe)
                                  for r in range(meta['world_size'])]
                states = [state.get(part.key) for state in every]
                if any(state is not None for state in states):
                    part.load_state_dict(states)
                continue
            saved = (rank_state if part.per_rank else client).get(part.key)
            if saved is not None:
                part.load_state_dict(saved)
        self._call_hook('after_load_checkpoint', checkpoint=client)
        self._weights_loaded = self._restored = True
        self._logger.info(f'Checkpoint {path} restored in {time.perf_counter() - started:.1f} s.')
        return client

    def _load_engines(self, path: str, meta: dict[str, Any], universal: bool) -> None:
        """DeepSpeed's shards into the engines, resharded if the layout changed."""
        specs = self._specs
        saved_modules = engine_modules(meta)
        if saved_modules != specs.modules():
            raise CheckpointError(
                f'{path!r} holds the engines {saved_modules} ({{name: submodule}}); this run '
                f'builds {specs.modules()}. Resume with the optim_wrapper keys the checkpoint '
                'was trained with, or start from its weights with load_from and resume=False.')
        saved = Sharding(meta['world_size'], meta['zero_stage'])
        current = self._sharding()
        if universal:
            self._logger.info(f'Resharding {path}: {saved} -> {current}, through a DeepSpeed '
                             'universal checkpoint (converted once, kept beside it).')
        elif saved != current:
            self._logger.info(f'Resuming {path} ({saved}) on {current}: ZeRO-0 state is whole.')
        for name, engine in specs.engines().items():
            tag = engine_tag(name)
            if universal:
                tag = convert(path, tag, current.zero_stage)
            load_path, _ = engine.load_checkpoint(path, tag=tag, load_module_strict=True,
                                                  load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
            if load_path is None:
                raise CheckpointError(f'DeepSpeed could not load {osp.join(path, tag)}.')

    def _load_weights_only(self, path: str) -> None:
        """A weights-only checkpoint's weights into the engines, fp32 masters included."""
        state = safe_load(osp.join(path, WEIGHTS_FILE), self._allow_unsafe)[STATE_DICT_KEY]
        load_full_state_dict(self._model, [e.optimizer for e in self._specs.engines().values()],
                             state, path)
        self._logger.warning(
            f'{path} holds no optimizer state (saved with save_optimizer=False, or before '
            "train() built the optimizer): its weights, loop position, param schedulers and RNG "
            "states are restored, and the optimizer's own state (momentum, Adam moments) starts "
            'from zero.')
