"""``layout.micro_batches='auto'`` when the device runs out of memory: every rank retries the
iteration with each batch in more micro-batches.

'auto' chooses the split before the engines are built, from ``plan``'s prediction
(``strategy/layout.py``), which can fall short of what the device then needs. The first
iterations show it: the first, and the first after the optimizer's first update (its states
exist then). For those (the first iteration of the first :data:`TRIAL_WINDOWS`
accumulation windows) every rank

* agrees with the others, before each micro-step's backward and after the last one,
  whether any rank ran out of memory (``torch.OutOfMemoryError``, what CUDA's allocator
  raises) in a forward or a backward, through the rendezvous store
  (:func:`~..failure.flagged_ranks`): a rank out of memory in a forward joins the agreement
  before that backward, one out of memory in a backward the next one;
* holds the accumulation boundary's reduction and update until the last agreement
  (:meth:`~.optim_wrapper.DeepSpeedOptimWrapper.hold_step`): ZeRO-0/1 reduce only there,
  so no rank waits inside a collective that another rank will not reach;
* on an agreed error: drops the iteration's gradients and counts, puts back every virtual
  rank's random streams and buffers, splits each micro-batch again
  (:func:`~..config.layout.finer`; the loader's collated batches are split in this process,
  ``collated.py``), tells the engine its micro-batch and accumulation (DeepSpeed's
  ``set_train_micro_batch_size`` / ``set_train_batch_size``: no rebuild), logs it and runs
  the iteration again, every rank alike. Out of memory at one sample, every rank raises.

After the window nothing of this runs (no agreement, no hold). A rank out of memory before
a collective of the model's own (an all-reduce in a loss, SyncBatchNorm) leaves its peers
inside it: it waits for them (:data:`WAIT_S` at least), then fails the run as it would
without the retry, and every rank ends.
"""
from __future__ import annotations

import time
from functools import partial
from logging import Logger
from typing import Any, Callable, Optional, TypeVar

import torch
from deepspeed import DeepSpeedEngine

from ..compat import accumulative_counts, backward_counts
from ..config.layout import finer
from ..failure import flagged_ranks
from .collated import COLLATES, Containers, split_collated
from .optim_wrapper import DeepSpeedOptimWrapper
from .virtual_ranks import MicroBatches, VirtualRanks

T = TypeVar('T')

# accumulation windows whose first iteration is tried: the first, and the first with the
# optimizer's states
TRIAL_WINDOWS = 2
# how long a rank out of memory waits for the others' answer, at least (4x its iteration's
# time so far, if longer): they may be finishing a micro-step
WAIT_S = 60.0
# how long a rank that did not run out of memory waits for the others' (a failed rank
# ends every rank sooner, failure.py)
PEER_WAIT_S = 1800.0


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory: this rank leaves the iteration at the agreement."""

    def __init__(self, ranks: list[int]):
        super().__init__(f'rank(s) {ranks} ran out of memory')
        self.ranks = ranks


def retry_refusal(engine: DeepSpeedEngine,
                  collate: Optional[Callable[..., Any]]) -> Optional[str]:
    """Why a run with this engine and collate cannot retry an iteration (None: it can)."""
    stage = engine.zero_optimization_stage()
    if stage >= 2:
        return (f'ZeRO-{stage} reduces gradients inside every backward' + (
            ' and gathers parameters inside every forward' if stage == 3 else '')
            + ': a rank out of memory there would leave the others inside that collective')
    if engine.zero_use_cpu_optimizer():
        return ('the offloaded optimizer keeps the accumulation steps it was built with, so '
                'the split cannot change')
    if stage == 1 and engine.zero_overlap_comm():
        return ('ZeRO-1 with overlap_comm reduces from the boundary backward\'s hooks, which '
                'cannot wait for an agreement')
    while isinstance(collate, partial) and not collate.args and not collate.keywords:
        collate = collate.func  # what Runner.build_dataloader makes of collate_fn's type
    if collate not in COLLATES:
        return ('train_dataloader.collate_fn is not MMEngine\'s pseudo_collate or '
                'default_collate, so its collated batches cannot be split again')
    return None


class SplitRetry:
    """Retries the first iterations of an ``'auto'`` split on an out-of-memory error.

    Args:
        virtual (VirtualRanks): This rank's virtual ranks (their split changes).
        engine (DeepSpeedEngine): The layout's one engine (ZeRO-0/1, see
            :func:`retry_refusal`).
        optim_wrapper (DeepSpeedOptimWrapper): Its optim wrapper.
        batch_size (int): The config's per-GPU batch (a virtual rank's).
        containers (Containers): A sample's containers (``collated.py``).
        rank (int): This rank.
        logger (Logger): The runner's.
    """

    def __init__(self, virtual: VirtualRanks, engine: DeepSpeedEngine,
                 optim_wrapper: DeepSpeedOptimWrapper, batch_size: int,
                 containers: Containers, rank: int, logger: Logger):
        self.virtual, self.engine, self.optim_wrapper = virtual, engine, optim_wrapper
        self.batch_size, self.containers, self.rank = batch_size, containers, rank
        self.logger = logger
        self._loaded = virtual.split  # the micro-batches the loader collates a batch in
        self._windows = TRIAL_WINDOWS
        self._trying = False  # in a tried iteration: agree before each backward
        self._started = 0.0

    def run(self, batches: MicroBatches, iteration: Callable[[MicroBatches], T]) -> T:
        """``iteration`` of this iteration's ``batches`` (the loader's micro-batches, split
        again as the split now is); tried, retried and agreed on in the trial window."""
        counted = backward_counts(self.optim_wrapper)[0]
        if not self._windows or counted % accumulative_counts(self.optim_wrapper):
            return iteration(self._pieces(batches))
        while True:
            kept = self.virtual.kept()
            self._started, self._trying = time.monotonic(), True
            self.optim_wrapper.hold_step()
            out_of_memory: Optional[str] = None  # this rank's error, as a line
            flagged: list[int] = []
            try:
                result = iteration(self._pieces(batches))
            except torch.OutOfMemoryError as error:
                out_of_memory = ' '.join(str(error).split())[:300]
            except _PeerOutOfMemory as peers:
                flagged = peers.ranks
            finally:
                self._trying = False
            if not flagged:  # (out of the handler: the failed step's tensors are freed)
                flagged = self._agree(out_of_memory)
            if not flagged:
                self.optim_wrapper.release_step()
                self._windows -= 1
                return result
            self.optim_wrapper.drop_step(counted)
            self.virtual.put_back(kept)
            self._split_again(flagged)

    def before_backward(self) -> None:
        """Where a tried iteration's micro-step is about to back-propagate: leave it if
        another rank ran out of memory (before any rank reduces)."""
        if self._trying:
            flagged = self._agree(None)
            if flagged:
                raise _PeerOutOfMemory(flagged)

    def _agree(self, out_of_memory: Optional[str]) -> list[int]:
        """The ranks out of memory (this one's error, if it is). A rank out of memory
        waits for the others for a bounded time (they may be inside a collective that it
        will not reach), then fails the run with its error."""
        if out_of_memory is None:
            return flagged_ranks('split_retry', False, self.rank, PEER_WAIT_S)
        seconds = max(WAIT_S, 4 * (time.monotonic() - self._started))
        try:
            return flagged_ranks('split_retry', True, self.rank, seconds)
        except TimeoutError as e:
            raise torch.OutOfMemoryError(
                f'{out_of_memory} (layout.micro_batches=\'auto\' would retry in more '
                f'micro-batches, but the other ranks did not reach the agreement within '
                f'{seconds:.0f} s: the model\'s own forward or loss may wait in a collective '
                'for this rank (an all-reduce, SyncBatchNorm); give micro_batches=k)') from e

    def _pieces(self, batches: MicroBatches) -> MicroBatches:
        parts = self.virtual.split // self._loaded
        if parts == 1:
            return batches
        return MicroBatches(piece for batch in batches
                            for piece in split_collated(batch, self.containers, parts))

    def _split_again(self, flagged: list[int]) -> None:
        """Every virtual rank's batch in more micro-batches from now on."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed attempt's cached blocks
        batch_size, split = self.batch_size, self.virtual.split
        finer_split = finer(batch_size, split)
        who = f'rank{"s" if len(flagged) > 1 else ""} {", ".join(map(str, flagged))}'
        if finer_split is None:
            raise RuntimeError(
                f"layout.micro_batches='auto': {who} ran out of memory at one sample per "
                'micro-batch: raise the ZeRO stage or offload (`mmengine-deepspeed plan` on '
                'the config shows what each needs), or launch on more ranks.')
        self.logger.warning(
            f'layout: {who} ran out of memory with each virtual rank\'s batch of '
            f'{batch_size} in {split} micro-batch{"es" if split > 1 else ""}; every rank '
            f'runs this iteration again, and the rest of the run, in {finer_split} '
            f'micro-batches of {batch_size // finer_split}.')
        global_batch = self.engine.train_batch_size()
        self.virtual.split = finer_split
        self.engine.set_train_micro_batch_size(batch_size // finer_split)
        self.engine.set_train_batch_size(global_batch)  # the same: more accumulation steps
        self.optim_wrapper.set_micro_steps(self.virtual.micro_steps)
