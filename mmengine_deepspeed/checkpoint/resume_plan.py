"""What a run loads before it trains, decided once: the resume plan.

MMEngine spreads this over ``resume``, ``load_from`` and a loaded flag; with
DeepSpeed it also depends on the checkpoint itself (optimizer state or
weights only), on whether its layout (world size, ZeRO stage) is this
run's, and on whether the elastic agent restarted the job. :func:`resolve_plan`
reads all of it once and names the outcome.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

from .layout import check_checkpoint, find_latest_complete, has_optimizer_state
from .reshard import Sharding, needs_universal


class ResumeKind(enum.Enum):
    """What the run loads from ``ResumePlan.path``."""

    NONE = 'nothing'
    WEIGHTS = 'weights (load_from)'
    FULL = 'everything'
    UNIVERSAL = 'everything, resharded through a universal checkpoint'
    WEIGHTS_ONLY = 'weights and run state, no optimizer state'


@dataclass(frozen=True)
class ResumePlan:
    """The outcome of :func:`resolve_plan`.

    Args:
        kind (ResumeKind): What is loaded.
        path (str, optional): From where (None for ``NONE``).
    """

    kind: ResumeKind
    path: Optional[str] = None

    @property
    def resumes(self) -> bool:
        """Whether the run continues a checkpoint (loop, optimizer, schedulers, RNG)."""
        return self.kind in (ResumeKind.FULL, ResumeKind.UNIVERSAL, ResumeKind.WEIGHTS_ONLY)


def plan_for(path: str, current: Sharding) -> ResumePlan:
    """How resuming checkpoint directory ``path`` goes on ``current`` (checks it first).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint, or its layout
            cannot be changed into ``current``.
    """
    meta = check_checkpoint(path)
    if not has_optimizer_state(meta):
        return ResumePlan(ResumeKind.WEIGHTS_ONLY, path)
    saved = Sharding(meta['world_size'], meta['zero_stage'])
    if needs_universal(saved, current, path):
        return ResumePlan(ResumeKind.UNIVERSAL, path)
    return ResumePlan(ResumeKind.FULL, path)


def resolve_plan(*, resume: bool, path: Optional[str], work_dir: str, current: Sharding,
                 logger: Any, restart: int = 0) -> ResumePlan:
    """The plan for MMEngine's ``resume`` / ``load_from`` arguments.

    After the elastic agent restarted the job (torchrun's ``--max-restarts``, which
    restarts every process when one dies), the latest complete checkpoint in
    ``work_dir`` is what to continue from, whatever ``resume`` / ``load_from`` say.

    Args:
        resume (bool): ``resume``: continue a checkpoint.
        path (str, optional): ``load_from`` (with ``resume``: the checkpoint
            to continue; None takes the latest complete one in ``work_dir``).
        work_dir (str): Where checkpoints are.
        current (Sharding): This run's layout.
        logger (Any): For skipped incomplete checkpoints and a resume with
            nothing to resume.
        restart (int): ``TORCHELASTIC_RESTART_COUNT``: 0 for the job's first
            attempt. Defaults to 0.

    Returns:
        ResumePlan: The plan.
    """
    if restart:
        latest, _ = find_latest_complete(work_dir)
        if latest is None:
            logger.warning(f'Restart {restart} of this job: no complete checkpoint in '
                           f'{work_dir} yet, starting over.')
        else:
            logger.warning(f'Restart {restart} of this job: resuming from {latest}, the '
                           'latest complete checkpoint.')
            resume, path = True, latest
    if not resume:
        return ResumePlan(ResumeKind.WEIGHTS, path) if path else ResumePlan(ResumeKind.NONE)
    if path is None:
        path, skipped = find_latest_complete(work_dir)
        for incomplete in skipped:
            logger.warning(f'Skipping incomplete checkpoint {incomplete} (its save did not '
                           'finish).')
        if path is None:
            logger.info(f'resume=True but no complete checkpoint in {work_dir}; starting from '
                        'scratch.')
            return ResumePlan(ResumeKind.NONE)
    return plan_for(path, current)
