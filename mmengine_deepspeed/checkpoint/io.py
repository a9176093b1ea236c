"""What the runner does with checkpoints: save, resume, load_from.

Save and resume are collective (every rank calls them). ``load_from`` reads
plain weights into the bare model before ``deepspeed.initialize``, so one code
path serves ZeRO 0-3 (ZeRO-3 partitions what was loaded) and DeepSpeed's
``load_checkpoint(load_optimizer_states=False)``, which ignores ``tag`` under
ZeRO-3 (DeepSpeed #8499), is never used.
"""
from __future__ import annotations

import os.path as osp
import re
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import deepspeed
import mmengine
import torch
from mmengine.optim import OptimWrapperDict
from mmengine.runner import EpochBasedTrainLoop
from torch import nn

from ..compat import set_loop_position
from ..config.resolve import precision, zero_stage
from ..version import __version__
from ..zero.partitioned import gather_on_use
from .export import consolidated_state_dict
from .layout import (
    CLIENT_FILE,
    OUTSIDE_ENGINES_KEY,
    RANK_FILE,
    SINGLE_ENGINE,
    WEIGHTS_FILE,
    CheckpointError,
    check_checkpoint,
    engine_modules,
    engine_tag,
    has_optimizer_state,
    shard_files,
)
from .reshard import Layout, convert, needs_universal
from .safe_load import check_pickles, safe_load
from .save import save_checkpoint_dir
from .state import hub_state, load_hub_state, load_rank_state, outside_engines, plain
from .weights import load_full_state_dict


def run_facts(runner: Any, epoch: int, iteration: int) -> dict[str, Any]:
    """The JSON meta of a checkpoint taken now."""
    return dict(
        epoch=epoch, iter=iteration, seed=runner.seed, world_size=runner.world_size,
        zero_stage=zero_stage(runner.ds_config), precision=precision(runner.ds_config),
        experiment_name=runner.experiment_name, time=time.strftime('%Y%m%d_%H%M%S'),
        versions=dict(mmengine=str(mmengine.__version__), deepspeed=str(deepspeed.__version__),
                      torch=str(torch.__version__), mmengine_deepspeed=__version__))


def named_wrappers(optim_wrapper: Any) -> dict[str, Any]:
    """The runner's optim wrappers by engine name (one, or an OptimWrapperDict's)."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        return dict(optim_wrapper.optim_wrappers)
    return {SINGLE_ENGINE: optim_wrapper}


def _labelled(schedulers: Any) -> list[tuple[str, Any]]:
    """Param schedulers (or their states) as MMEngine holds them: a list, or lists by key."""
    if isinstance(schedulers, dict):
        return [(f'[{name!r}][{i}]', s) for name, group in schedulers.items()
                for i, s in enumerate(group)]
    return [(f'[{i}]', s) for i, s in enumerate(schedulers)]


def _dataset_meta(runner: Any) -> Any:
    """The training dataset's ``metainfo`` (None for a runner without training)."""
    loop = runner.train_loop  # built from its config on first use, as MMEngine does
    dataset = getattr(getattr(loop, 'dataloader', None), 'dataset', None)
    return plain(getattr(dataset, 'metainfo', None))


def save(runner: Any, path: str, meta: dict[str, Any], save_param_scheduler: bool,
         weights_only: bool) -> None:
    """Save the runner's engines and state into directory ``path`` (collective).

    Args:
        runner (Any): The runner.
        path (str): The checkpoint directory.
        meta (dict): Its ``epoch`` and ``iter`` (and the caller's keys).
        save_param_scheduler (bool): Save the (built) param schedulers.
        weights_only (bool): Consolidated weights in place of DeepSpeed's
            shards (``weights.py``): no optimizer state.
    """
    facts = run_facts(runner, meta['epoch'], meta['iter'])
    if len(runner.engines) > 1:
        facts['engines'] = dict(runner.engine_modules)
    client: dict[str, Any] = {
        'meta': dict(meta, **facts, cfg=runner.cfg.pretty_text,
                     dataset_meta=_dataset_meta(runner)),
        'message_hub': hub_state(runner.message_hub),
    }
    if runner.has_training_engines():
        # Hyper-parameters (lr, momentum...) of each optimizer's groups:
        # restored on resume whatever path the optimizer states take (none,
        # for a weights-only checkpoint).
        client['optimizer_param_groups'] = {
            name: [{k: v for k, v in group.items() if k != 'params'}
                   for group in wrapper.optimizer.param_groups]
            for name, wrapper in named_wrappers(runner.optim_wrapper).items()}
    schedulers = runner.param_schedulers
    if save_param_scheduler and schedulers and all(
            hasattr(s, 'state_dict') for _, s in _labelled(schedulers)):  # built by train()
        client['param_schedulers'] = (
            {name: [s.state_dict() for s in group] for name, group in schedulers.items()}
            if isinstance(schedulers, dict) else [s.state_dict() for s in schedulers])
    if len(runner.engines) > 1 and not weights_only:
        client[OUTSIDE_ENGINES_KEY] = outside_engines(runner.bare_model, runner.engine_modules)
    runner.call_hook('before_save_checkpoint', checkpoint=client)
    save_checkpoint_dir(path, runner.engines, runner.bare_model, plain(client), facts,
                        weights_only=weights_only)


def _load_engines(runner: Any, path: str, meta: dict[str, Any]) -> None:
    """DeepSpeed's shards into the engines, resharded if the layout changed."""
    saved_modules = engine_modules(meta)
    if saved_modules != dict(runner.engine_modules):
        raise CheckpointError(
            f'{path!r} holds the engines {saved_modules} ({{name: submodule}}); this run builds '
            f'{dict(runner.engine_modules)}. Resume with the optim_wrapper keys the checkpoint '
            'was trained with, or start from its weights with load_from and resume=False.')
    saved = Layout(meta['world_size'], meta['zero_stage'])
    current = Layout(runner.world_size, zero_stage(runner.ds_config))
    universal = needs_universal(saved, current, path)
    if universal:
        runner.logger.info(f'Resharding {path}: {saved} -> {current}, through a DeepSpeed '
                           'universal checkpoint (converted once, kept beside it).')
    elif saved != current:
        runner.logger.info(f'Resuming {path} ({saved}) on {current}: ZeRO-0 state is whole.')
    for name, engine in runner.engines.items():
        tag = engine_tag(name)
        if universal:
            tag = convert(path, tag, current.zero_stage)
        load_path, _ = engine.load_checkpoint(path, tag=tag, load_module_strict=True,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f'DeepSpeed could not load {osp.join(path, tag)}.')


def _load_weights_only(runner: Any, path: str, allow_unsafe: bool) -> None:
    """A weights-only checkpoint's weights into the engines, fp32 masters included."""
    state = safe_load(osp.join(path, WEIGHTS_FILE), allow_unsafe)['state_dict']
    load_full_state_dict(runner.bare_model, [e.optimizer for e in runner.engines.values()],
                         state, path)
    runner.logger.warning(
        f'{path} holds no optimizer state (saved with save_optimizer=False, or before train() '
        'built the optimizer): its weights, loop position, param schedulers and RNG states '
        'are restored, and the optimizer\'s own state (momentum, Adam moments) starts '
        'from zero.')


def resume(runner: Any, path: str, allow_unsafe: bool) -> dict[str, Any]:
    """Restore engines, loop position, schedulers, hub, RNG, buffers and hooks from ``path``.

    Returns:
        dict: The checkpoint's client state (as hooks saw it when saving).
    """
    meta = check_checkpoint(path)
    check_pickles([*shard_files(path), osp.join(path, CLIENT_FILE)], allow_unsafe)
    client = safe_load(osp.join(path, CLIENT_FILE), allow_unsafe)
    if has_optimizer_state(meta):
        _load_engines(runner, path, meta)
    else:
        _load_weights_only(runner, path, allow_unsafe)
    groups = client.get('optimizer_param_groups', {})
    if isinstance(groups, list):  # format 1: one optimizer
        groups = {SINGLE_ENGINE: groups}
    for name, wrapper in named_wrappers(runner.optim_wrapper).items():
        for group, hyper in zip(wrapper.optimizer.param_groups, groups.get(name, [])):
            group.update(hyper)
    if OUTSIDE_ENGINES_KEY in client:
        runner.bare_model.load_state_dict(client[OUTSIDE_ENGINES_KEY], strict=False)
    ckpt_meta = client['meta']
    set_loop_position(runner.train_loop, ckpt_meta['epoch'], ckpt_meta['iter'])
    if hasattr(runner.train_loop, 'skip_trained_batches'):
        runner.train_loop.skip_trained_batches()
    load_hub_state(runner.message_hub, client['message_hub'])
    states = client.get('param_schedulers')
    if states is not None and runner.param_schedulers:
        for (label, scheduler), (_, state) in zip(_labelled(runner.param_schedulers),
                                                  _labelled(states)):
            configured_end = getattr(scheduler, 'end', None)
            scheduler.load_state_dict(state)
            warn_if_schedule_ends_early(runner, label, scheduler, configured_end)
    # On another world size, rank r takes the RNG and buffers of rank r mod N.
    rank_file = osp.join(path, RANK_FILE.format(rank=runner.rank % meta['world_size']))
    load_rank_state(runner.bare_model, safe_load(rank_file, allow_unsafe))
    runner.call_hook('after_load_checkpoint', checkpoint=client)
    return client


def warn_if_schedule_ends_early(runner: Any, label: str, scheduler: Any,
                                configured_end: Any) -> None:
    """One warning when a resumed scheduler ends before this run's schedule would.

    MMEngine restores a scheduler's ``end`` (and ``T_max``), which it
    defaulted from the ``max_epochs`` / ``max_iters`` of the run that saved,
    so that a resumed run equals the run that never stopped. A run resumed
    with a longer schedule then keeps the value reached at the old end.

    Args:
        runner (Any): The resuming runner.
        label (str): The scheduler's position in ``param_scheduler``
            (``[0]``, or ``['generator'][0]`` for schedulers by optimizer).
        scheduler (Any): The scheduler, its state restored.
        configured_end (Any): Its ``end`` as this run's config built it.
    """
    saved_end = getattr(scheduler, 'end', None)
    if not isinstance(saved_end, int) or not isinstance(configured_end, int) \
            or saved_end >= configured_end:
        return
    by_epoch = bool(getattr(scheduler, 'by_epoch', False))
    unit = 'epoch' if by_epoch else 'iteration'
    total = (f'max_epochs={runner.max_epochs}'
             if isinstance(runner.train_loop, EpochBasedTrainLoop)
             else f'max_iters={runner.max_iters}')
    runner.logger.warning(
        f'param_scheduler{label} ({type(scheduler).__name__}) resumed with end={saved_end} '
        f'({unit}s) from the checkpoint, but this config trains to {total}: like MMEngine, '
        'the resumed run continues the saved schedule, so its value stays at the one reached '
        f'at {unit} {saved_end}. To schedule the added {unit}s, append a scheduler with '
        f'begin={saved_end}, end={configured_end} to param_scheduler (the saved state fills '
        'only the first schedulers).')


def read_weights(source: str, allow_unsafe: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights and meta from our checkpoint directory, a ``.pth`` or a ``.safetensors``."""
    if osp.isdir(source):
        return consolidated_state_dict(source, allow_unsafe), dict(check_checkpoint(source))
    if not osp.isfile(source):
        raise CheckpointError(f'load_from={source!r} does not exist.')
    if source.endswith('.safetensors'):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(source), {}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f'{source} cannot be read as safetensors ({e}): it is truncated '
                                  'or not a safetensors file. Copy it again.') from e
    loaded = safe_load(source, allow_unsafe)
    if not isinstance(loaded, dict):
        raise CheckpointError(f'{source} holds a {type(loaded).__name__}, not a state dict.')
    meta = loaded.get('meta', {}) if isinstance(loaded.get('meta'), dict) else {}
    state = loaded.get('state_dict', loaded)
    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f'{source} is not a state dict (tensor values under "state_dict" or at the top).')
    return state, meta


def revise(state: dict[str, torch.Tensor],
           revise_keys: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Apply MMEngine-style ``(pattern, replacement)`` key rewrites."""
    for pattern, replacement in revise_keys:
        state = {re.sub(pattern, replacement, k): v for k, v in state.items()}
    return state


def refuse_unrelated(state: dict[str, torch.Tensor], model: nn.Module, source: str) -> None:
    """Refuse weights none of whose keys the model has (another model, or unrevised keys).

    MMEngine's non-strict loading would warn twice and train from random
    weights; a partial match (a backbone into a detector) still loads.
    """
    own = list(model.state_dict())
    if not state or not own or not set(state).isdisjoint(own):
        return
    raise CheckpointError(
        f'{source} matches none of this model\'s parameters: it holds {len(state)} keys '
        f'({", ".join(sorted(state)[:3])}, ...), the model has {", ".join(own[:3])}, ... '
        'Check that load_from names weights of this model; to map other key names, call '
        "runner.load_checkpoint(path, revise_keys=[(r'^backbone\\.', '')]) (pattern, "
        "replacement), or load a part with init_cfg=dict(type='Pretrained', prefix=...).")


def load_weights_into(model: nn.Module, source: str, *, strict: bool,
                      revise_keys: Sequence[tuple[str, str]], allow_unsafe: bool,
                      logger: Any, bare: bool = True) -> dict[str, Any]:
    """Load ``source``'s weights into ``model``.

    Args:
        bare (bool): No engine exists yet: a model built partitioned
            (``zero.Init``) is written one parameter group at a time
            (``partitioned.gather_on_use``). Otherwise the caller gathered it.
            Defaults to True.

    Returns:
        dict: ``{'meta': ..., 'state_dict': ...}`` for ``after_load_checkpoint``.
    """
    state, meta = read_weights(source, allow_unsafe)
    state = revise(state, revise_keys)
    refuse_unrelated(state, model, source)
    try:
        with gather_on_use(model) if bare else nullcontext():
            result = model.load_state_dict(state, strict=strict)
    except RuntimeError as e:
        raise CheckpointError(
            f'{source} does not fit this model: {e}\nCheck that load_from names a checkpoint '
            'of this model, or adapt the keys with revise_keys.') from e
    if result.missing_keys:
        logger.warning(f'load_from {source}: missing keys {result.missing_keys}')
    if result.unexpected_keys:
        logger.warning(f'load_from {source}: unexpected keys {result.unexpected_keys}')
    logger.info(f'Loaded weights from {source}')
    return {'meta': meta, 'state_dict': state}
