"""A layout's set-up on this rank (``config/layout.py``): its virtual ranks, checked against
what a layout cannot emulate, and the micro-batches each virtual rank's batch runs in.

The split is chosen once, before the engines are built (their accumulation counts it), from
``plan``'s prediction for the config's model on one batch of the loader, and agreed across
ranks (the largest: every rank must run as many micro-steps). Once the engines exist, an
``'auto'`` split gets its out-of-memory retry where the run can have one
(``engine/split_retry.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as torch_dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader

from ..compat import diff_rank_seed
from ..config.layout import AUTO, Split
from ..dist import cpu_group, local_world_size
from ..engine.collated import containers_of
from ..engine.optim_wrapper import DeepSpeedOptimWrapper
from ..engine.split_retry import SplitRetry, retry_refusal
from ..engine.virtual_ranks import VirtualRanks
from ..engine.wrapper import overrides
from ..plan.planner import device_memory_mib
from ..random_streams import raw_streams, set_raw_streams

if TYPE_CHECKING:
    from .run import RunStrategy


def layout_virtual_ranks(strategy: RunStrategy, loader: DataLoader) -> VirtualRanks:
    """This rank's virtual ranks of ``strategy.layout``, with the split of their batches
    (logged once, with why).

    Raises:
        ValueError: A model stepping its own optimizers, ``diff_rank_seed``, a split of a
            BatchNorm model without ``split_batchnorm=True``, or a split that does not fit.
    """
    layout, runner = strategy.layout, strategy.runner
    assert layout is not None
    count = layout.per_rank(runner.world_size)
    if overrides(strategy.bare_model, 'train_step') or strategy.specs.several:
        raise ValueError(
            f'{type(strategy.bare_model).__name__} steps its optimizers in its own train_step '
            '(a GAN\'s discriminator, then its generator): with layout each step would '
            'have to see every virtual rank\'s batch before the next one. Remove layout '
            'and set the batch and accumulation for the ranks you have.')
    if diff_rank_seed(runner):
        raise ValueError(
            'layout gives each virtual rank the random streams of that rank of the '
            'N-rank run, which with randomness.diff_rank_seed=True were seeded per rank '
            'before training: remove diff_rank_seed, or layout.')
    split = _split(strategy, loader)
    runner.logger.info(
        f'layout: training as the {layout.world_size}-rank run, {count} virtual rank(s) per '
        'rank, each a micro-step of every iteration' + (
            ', each virtual rank\'s batch ' + (
                f'in {split.count} micro-batches' if split.count > 1 else 'whole')
            + f' ({split.why})' if split.why else '') + '.')
    return VirtualRanks(count, strategy.bare_model, first=runner.rank * count,
                        world_size=layout.world_size, split=split.count)


def _split(strategy: RunStrategy, loader: DataLoader) -> Split:
    """The micro-batches per virtual rank's batch, the same on every rank."""
    layout = strategy.layout
    assert layout is not None
    if layout.micro_batches == 1:
        return Split(1, '')
    norms = [name for name, module in strategy.bare_model.named_modules()
             if isinstance(module, _BatchNorm)]
    if norms and not layout.split_batchnorm:
        raise ValueError(
            f'layout.micro_batches splits each per-GPU batch, but the model has BatchNorm '
            f'({", ".join(norms[:3])}{", ..." if len(norms) > 3 else ""}), whose batch '
            'statistics (and running averages) would then come from each micro-batch, not '
            'from the per-GPU batch the config was tuned with. Set '
            'layout.split_batchnorm=True to accept that (frozen BatchNorm, norm_eval=True, '
            'is unchanged), or remove micro_batches.')
    batch_size = int(loader.batch_size or 1)
    if layout.micro_batches != AUTO:
        return layout.split(batch_size)
    try:
        model = strategy.peak_model(_first_batch(loader, batch_size), batch_size)
    except Exception as e:
        raise ValueError(
            f"layout.micro_batches='auto' chooses the split from `mmengine-deepspeed plan`'s "
            f'prediction on the dataset\'s first batch, which failed here '
            f'({type(e).__name__}: {e}): give the number, layout.micro_batches=k (plan on the '
            'config shows each micro-batch\'s peak).') from e
    split = layout.split(batch_size, lambda micro_batch: model.peak_mib(micro_batch)[0],
                         device_memory_mib(local_world_size(strategy.runner.world_size)))
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return split
    agreed = torch.tensor([split.count], dtype=torch.int64)
    torch_dist.all_reduce(agreed, op=torch_dist.ReduceOp.MAX, group=cpu_group())
    count = int(agreed.item())  # once, before the engines: not a step's host read
    return split if count == split.count else Split(
        count, f'{split.why}; {count} micro-batches, another rank\'s need')


def split_retry(strategy: RunStrategy, virtual: VirtualRanks) -> Optional[SplitRetry]:
    """The retry of an ``'auto'`` split when a rank runs out of memory
    (``engine/split_retry.py``), where this run can retry (logged once, either way)."""
    layout, runner = strategy.layout, strategy.runner
    if layout is None or layout.micro_batches != AUTO:
        return None
    (engine,) = strategy.engines().values()  # a layout has one (several are refused)
    loader = runner.train_dataloader
    refusal = retry_refusal(engine, strategy.train_collate)
    if refusal is not None:
        runner.logger.info(
            f"layout: micro_batches='auto' cannot retry an iteration that runs out of "
            f'memory in this run ({refusal}): if the prediction falls short, the run fails '
            'as with a fixed split.')
        return None
    runner.logger.info(
        "layout: micro_batches='auto' retries the first iterations in more micro-batches "
        'if any rank runs out of memory, every rank together.')
    (sample,) = _first_samples(loader, 1)
    return SplitRetry(virtual, engine, cast(DeepSpeedOptimWrapper, runner.optim_wrapper),
                      int(loader.batch_size or 1), containers_of(sample), runner.rank,
                      runner.logger)


def _first_batch(loader: DataLoader, samples: int) -> Any:
    """The dataset's first ``samples`` samples, collated as the loader does: what ``plan``
    traces."""
    return loader.collate_fn(_first_samples(loader, samples))


def _first_samples(loader: DataLoader, samples: int) -> list[Any]:
    """The dataset's first ``samples`` samples. The process's random streams are left as
    they were (a random transform in this process draws from them)."""
    streams = raw_streams()
    try:
        return [loader.dataset[index] for index in range(samples)]
    finally:
        set_raw_streams(streams)
