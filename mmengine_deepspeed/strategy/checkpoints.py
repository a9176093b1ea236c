"""The strategy's checkpoint side: MMEngine's Runner checkpoint API on checkpoint directories.

``save_checkpoint`` and ``resume`` keep
MMEngine's signatures and meaning (the runner's overrides call these); what differs is
that every rank takes part (a checkpoint is a directory of DeepSpeed shards plus our
client state) and that loading never unpickles untrusted files by default. The work is
the strategy's :class:`~.checkpoint.checkpointer.Checkpointer`'s; here is what the runner
knows: the loop position, the config, the dataset's meta, the run state beside the
engines (:func:`checkpoint_parts`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from mmengine.runner import EpochBasedTrainLoop

from ..checkpoint.layout import META_KEY, CheckpointError
from ..checkpoint.parts import Part, run_parts
from ..checkpoint.save import save_failure
from ..checkpoint.state import plain
from ..compat import randomness_cfg
from ..engine.spec import named_wrappers

if TYPE_CHECKING:
    from .run import RunStrategy

# MMEngine's names for the local disk (FileClient's 'disk', the file backends' 'local').
LOCAL_BACKENDS = ('local', 'disk')


def checkpoint_parts(strategy: RunStrategy, meta: Optional[dict] = None,
                     save_param_scheduler: bool = True) -> list[Part]:
    """The run state a checkpoint holds beside the engines, in restore order (``parts.py``).

    Args:
        strategy (RunStrategy): The run's strategy.
        meta (dict, optional): The meta to save (loop position and facts);
            None when restoring. Defaults to None.
        save_param_scheduler (bool): Save the (built) param schedulers.
            Defaults to True.
    """
    runner = strategy.runner
    loop = runner.train_loop
    schedule = ('' if loop is None else f'max_epochs={runner.max_epochs}'
                if isinstance(loop, EpochBasedTrainLoop) else f'max_iters={runner.max_iters}')
    return run_parts(
        wrappers=named_wrappers(runner.optim_wrapper) if strategy.specs.training else {},
        model=strategy.bare_model, modules=strategy.specs.modules(), loop=loop,
        hub=runner.message_hub, schedulers=runner.param_schedulers, schedule=schedule,
        logger=runner.logger, meta=meta, save_param_scheduler=save_param_scheduler,
        virtual=strategy.virtual_ranks)


def save_checkpoint(strategy: RunStrategy, path: str, *, save_optimizer: bool,
                    save_param_scheduler: bool, meta: Optional[dict], by_epoch: bool,
                    backends: dict[str, Optional[dict]]) -> None:
    """Save checkpoint directory ``path`` on every rank (MMEngine's is rank 0 only).

    With ``save_optimizer=False``, or before ``train()`` built an optimizer (after
    ``val()``, or before anything), the checkpoint holds the consolidated weights and
    no optimizer state (``weights.py``); resuming from it restores everything else.
    ``backends``: CheckpointHook's storage arguments by name, local ones only.
    """
    for key, args in backends.items():
        if args and args.get('backend') not in LOCAL_BACKENDS:
            raise ValueError(
                f'CheckpointHook {key}={args} names a remote storage backend; '
                'DeepSpeedRunner saves checkpoints to a local (or mounted) directory: '
                f'remove {key}, or copy the checkpoint directory to remote storage after '
                'the save.')
    runner = strategy.runner
    weights_only = not (save_optimizer and strategy.specs.training)
    if save_optimizer and weights_only:
        runner.logger.info(f'No optimizer exists yet (train() builds it): {path} holds '
                           'the weights and no optimizer state.')
    # The loop position MMEngine records (a runner without training has none).
    loop = runner.train_loop
    epoch, iteration = (runner.epoch, runner.iter) if loop is not None else (0, 0)
    meta = dict(meta or {})
    meta.setdefault('epoch', epoch + 1 if by_epoch else epoch)
    meta.setdefault('iter', iteration if by_epoch else iteration + 1)
    dataset = getattr(getattr(loop, 'dataloader', None), 'dataset', None)
    try:
        strategy.checkpointer.save(
            path, meta=dict(meta, cfg=strategy.whole_cfg.pretty_text,
                            dataset_meta=plain(getattr(dataset, 'metainfo', None))),
            weights_only=weights_only, save_param_scheduler=save_param_scheduler)
    except Exception as e:  # any failure: one message that says what to do
        message = save_failure(path, e, runner.work_dir)
        if runner.rank == 0:
            runner.logger.error(message)
        raise CheckpointError(message) from e


def resume(strategy: RunStrategy, path: str) -> None:
    """Resume everything from checkpoint directory ``path`` (collective).

    Engine (weights and optimizer partitions), loop position, param schedulers,
    message hub, this rank's RNG state and hooks' state come back exactly. Called
    before ``train()``, the weights are loaded at once and the rest when ``train()``
    has built the engines.
    """
    runner, checkpointer = strategy.runner, strategy.checkpointer
    if not strategy.specs.training:
        # DeepSpeed restores optimizer partitions only into the engine train() builds (its
        # ZeRO stage, its optimizer); an evaluation engine would refuse a ZeRO-1/2
        # checkpoint. The weights are loaded now, for val()/test(); the rest waits.
        checkpointer.request_resume(path)
        runner.load_checkpoint(path)
        runner.logger.info(f'Weights loaded from {path}; its optimizer state, schedulers '
                           'and loop position are restored when train() builds the engines.')
        return
    client = checkpointer.restore(path)
    resumed_seed = client[META_KEY].get('seed')
    configured_seed = randomness_cfg(runner).get('seed')
    if resumed_seed is not None and resumed_seed != configured_seed:
        runner.logger.warning(f'Resumed seed {resumed_seed} differs from the config seed '
                              f'{configured_seed}; the checkpoint\'s is kept.')
    runner.logger.info(f'Resumed from {path}: epoch {runner.epoch}, iter {runner.iter}')
