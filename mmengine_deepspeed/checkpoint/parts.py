"""The run state a checkpoint holds beside the engines, as named parts.

Each part is a small adapter with one key of the client state (or, for the
per-rank part, a file of its own), a ``state_dict()`` that says what is
saved (None: nothing, this time) and a ``load_state_dict()`` that puts it
back: save and load mirror each other by construction, and the checkpoint
code sees the objects a part needs, never the runner. :func:`run_parts` is the
one list of them (``DeepSpeedRunner.checkpoint_parts`` passes the run's objects);
the engines' own state goes through DeepSpeed (``checkpointer.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from mmengine.logging import MessageHub
from torch import nn

from ..compat import set_loop_position
from ..engine.spec import SINGLE_ENGINE
from ..engine.virtual_ranks import VirtualRanks
from .layout import (
    ITERATOR_STREAMS_KEY,
    MESSAGE_HUB_KEY,
    META_KEY,
    OUTSIDE_ENGINES_KEY,
    PARAM_GROUPS_KEY,
    PARAM_SCHEDULERS_KEY,
    RANK_STATE_KEY,
    VIRTUAL_RANKS_KEY,
)
from .state import hub_state, load_hub_state, load_rank_state, outside_engines, rank_state


class Part(Protocol):
    """One named piece of run state."""

    key: str
    per_rank: bool
    # loaded from every saved rank's file (a list by saved rank), not this rank's only
    from_every_rank: bool

    def state_dict(self) -> Optional[Any]:
        """What to save; None saves nothing under :attr:`key`."""

    def load_state_dict(self, state: Any) -> None:
        """Put back what :meth:`state_dict` saved."""


@dataclass
class LoopPart:
    """The loop position, in the checkpoint's meta as MMEngine keeps it (``epoch``, ``iter``).

    Args:
        loop (Any): The train loop (None for a runner without training).
        meta (dict): The meta to save: position and facts about the run.
    """

    loop: Any
    meta: dict
    key: str = META_KEY
    per_rank: bool = False
    from_every_rank: bool = False

    def state_dict(self) -> dict:
        return self.meta

    def load_state_dict(self, state: dict) -> None:
        """Restore epoch and iteration; the loop then skips what was trained at the sampler."""
        set_loop_position(self.loop, state['epoch'], state['iter'])
        if hasattr(self.loop, 'skip_trained_batches'):
            self.loop.skip_trained_batches()


@dataclass
class MessageHubPart:
    """MMEngine's MessageHub: logged scalars and runtime info, as plain lists."""

    hub: MessageHub
    key: str = MESSAGE_HUB_KEY
    per_rank: bool = False
    from_every_rank: bool = False

    def state_dict(self) -> dict:
        return hub_state(self.hub)

    def load_state_dict(self, state: dict) -> None:
        load_hub_state(self.hub, state)


@dataclass
class ParamGroupsPart:
    """Each optimizer's group hyper-parameters (lr, momentum...), without the parameters.

    Restored whatever path the optimizer states take (none, for a
    weights-only checkpoint).

    Args:
        wrappers (dict[str, Any]): The training optim wrappers by engine
            name; empty before ``train()`` built them.
    """

    wrappers: dict[str, Any]
    key: str = PARAM_GROUPS_KEY
    per_rank: bool = False
    from_every_rank: bool = False

    def state_dict(self) -> Optional[dict]:
        if not self.wrappers:
            return None
        return {name: [{k: v for k, v in group.items() if k != 'params'}
                       for group in wrapper.optimizer.param_groups]
                for name, wrapper in self.wrappers.items()}

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, list):  # format 1: one optimizer
            state = {SINGLE_ENGINE: state}
        for name, wrapper in self.wrappers.items():
            for group, hyper in zip(wrapper.optimizer.param_groups, state.get(name, [])):
                group.update(hyper)


def _labelled(schedulers: Any) -> list[tuple[str, Any]]:
    """Param schedulers (or their states) as MMEngine holds them: a list, or lists by key."""
    if isinstance(schedulers, dict):
        return [(f'[{name!r}][{i}]', s) for name, group in schedulers.items()
                for i, s in enumerate(group)]
    return [(f'[{i}]', s) for i, s in enumerate(schedulers or [])]


@dataclass
class SchedulersPart:
    """MMEngine's param schedulers (once ``train()`` built them), and a warning on resume
    when a saved schedule ends before this run's.

    Args:
        schedulers (Any): ``runner.param_schedulers``: a list, lists by
            optimizer, configs (not built yet) or None.
        schedule (str): This run's length (``max_iters=12``), for the warning.
        logger (Any): The runner's logger.
        enabled (bool): ``save_param_scheduler``. Defaults to True.
    """

    schedulers: Any
    schedule: str
    logger: Any
    enabled: bool = True
    key: str = PARAM_SCHEDULERS_KEY
    per_rank: bool = False
    from_every_rank: bool = False

    def state_dict(self) -> Any:
        built = _labelled(self.schedulers)
        if not self.enabled or not built or not all(hasattr(s, 'state_dict') for _, s in built):
            return None
        if isinstance(self.schedulers, dict):
            return {name: [s.state_dict() for s in group]
                    for name, group in self.schedulers.items()}
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, state: Any) -> None:
        for (label, scheduler), (_, saved) in zip(_labelled(self.schedulers), _labelled(state)):
            configured_end = getattr(scheduler, 'end', None)
            scheduler.load_state_dict(saved)
            self._warn_if_ends_early(label, scheduler, configured_end)

    def _warn_if_ends_early(self, label: str, scheduler: Any, configured_end: Any) -> None:
        """MMEngine restores a scheduler's ``end`` (and ``T_max``), which it defaulted
        from the saving run's length, so that a resumed run equals the run that never
        stopped; a run resumed with a longer schedule keeps the value reached there."""
        saved_end = getattr(scheduler, 'end', None)
        if not isinstance(saved_end, int) or not isinstance(configured_end, int) \
                or saved_end >= configured_end:
            return
        unit = 'epoch' if getattr(scheduler, 'by_epoch', False) else 'iteration'
        self.logger.warning(
            f'param_scheduler{label} ({type(scheduler).__name__}) resumed with end={saved_end} '
            f'({unit}s) from the checkpoint, but this config trains to {self.schedule}: like '
            'MMEngine, the resumed run continues the saved schedule, so its value stays at the '
            f'one reached at {unit} {saved_end}. To schedule the added {unit}s, append a '
            f'scheduler with begin={saved_end}, end={configured_end} to param_scheduler (the '
            'saved state fills only the first schedulers).')


@dataclass
class OutsideEnginesPart:
    """Parameters and buffers no engine holds (an EMA copy, frozen parts of a GAN).

    Args:
        model (nn.Module): The user's whole model.
        modules (dict[str, str]): Each engine's submodule path, by name.
    """

    model: nn.Module
    modules: dict[str, str]
    key: str = OUTSIDE_ENGINES_KEY
    per_rank: bool = False
    from_every_rank: bool = False

    def state_dict(self) -> Optional[dict]:
        if '' in self.modules.values():  # an engine holds the whole model
            return None
        return outside_engines(self.model, self.modules)

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state, strict=False)


@dataclass
class IteratorStreamsPart:
    """The random streams the current epoch's DataLoader iterator was created from.

    Per rank: a run resumed inside that epoch creates its iterator from them
    (``data/order.create_iterator``). Loops without the attribute save nothing.
    """

    loop: Any
    key: str = ITERATOR_STREAMS_KEY
    per_rank: bool = True
    from_every_rank: bool = False

    def state_dict(self) -> Optional[dict]:
        return getattr(self.loop, 'iterator_streams', None)

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.loop, 'iterator_streams'):
            self.loop.iterator_streams = state


@dataclass
class VirtualRanksPart:
    """A layout's virtual ranks on this rank: their random streams and buffers
    (``engine/virtual_ranks.py``), per rank; nothing without a layout."""

    virtual: Optional[VirtualRanks]
    key: str = VIRTUAL_RANKS_KEY
    per_rank: bool = True
    # a run on another number of ranks takes each virtual rank from the file that holds it
    from_every_rank: bool = True

    def state_dict(self) -> Optional[dict]:
        return self.virtual.state_dict() if self.virtual is not None else None

    def load_state_dict(self, state: list[Optional[dict]]) -> None:
        if self.virtual is None:
            raise ValueError(
                'The checkpoint was saved by a run with layout (virtual ranks); resume it '
                'with the same layout.')
        self.virtual.load_state_dict(state)


@dataclass
class RankStatePart:
    """What differs between ranks: RNG states and buffers (BatchNorm statistics).

    Saved by every rank into its own file; on another world size rank r
    loads rank r mod N's.
    """

    model: nn.Module
    key: str = RANK_STATE_KEY
    per_rank: bool = True
    from_every_rank: bool = False

    def state_dict(self) -> dict:
        return rank_state(self.model)

    def load_state_dict(self, state: dict) -> None:
        load_rank_state(self.model, state)


def run_parts(*, wrappers: dict[str, Any], model: nn.Module, modules: dict[str, str],
              loop: Any, hub: MessageHub, schedulers: Any, schedule: str, logger: Any,
              meta: Optional[dict] = None, save_param_scheduler: bool = True,
              virtual: Optional[VirtualRanks] = None) -> list[Part]:
    """The run state a checkpoint holds beside the engines, in restore order: the one list
    the runner saves and restores (and its tests use).

    Args:
        wrappers (dict[str, Any]): The training optim wrappers by engine name; empty
            before ``train()`` built them.
        model (nn.Module): The user's whole model.
        modules (dict[str, str]): Each engine's submodule path (``''``: the model).
        loop (Any): The train loop (None for a runner without training).
        hub (MessageHub): The run's message hub.
        schedulers (Any): The param schedulers, as the runner holds them.
        schedule (str): The loop's length in words, for a schedulers mismatch warning.
        logger (Any): The runner's logger.
        meta (dict, optional): The meta to save (loop position and facts); None when
            restoring. Defaults to None.
        save_param_scheduler (bool): Save the (built) param schedulers. Defaults to True.
        virtual (VirtualRanks, optional): A layout's virtual ranks on this rank.
            Defaults to None.
    """
    return [
        ParamGroupsPart(wrappers),
        OutsideEnginesPart(model, modules),
        LoopPart(loop, meta or {}),
        MessageHubPart(hub),
        SchedulersPart(schedulers, schedule, logger, save_param_scheduler),
        RankStatePart(model),
        IteratorStreamsPart(loop),
        VirtualRanksPart(virtual),
    ]
