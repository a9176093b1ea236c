"""What a failed step is, and the settings of what follows one (``hooks/nonfinite.py``).

:class:`NonFinitePolicy` is the ``nonfinite`` config key, checked when the runner is
built; :class:`FailedStep` is one iteration whose step failed as every rank saw it: what
the log says about it, the line of ``nonfinite_steps.jsonl``, and the samples a rollback
leaves out.
"""
from __future__ import annotations

import json
import os.path as osp
from dataclasses import dataclass, field, fields
from typing import Any, Optional

POLICIES = ('skip', 'stop', 'rollback')


@dataclass(frozen=True)
class NonFinitePolicy:
    """What a run does after a step whose loss or gradients were not finite.

    Args:
        policy (str): ``'skip'`` (go on; stop past the limits below), ``'stop'``
            (stop at the first failed step) or ``'rollback'`` (past the limits, or at
            a loss spike: restore the newest checkpoint taken before the first failed
            step and leave its samples out). Defaults to ``'skip'``.
        max_consecutive (int): The limit of consecutive skipped updates (of any one
            optimizer). Defaults to 10.
        max_skipped (int): The limit of skipped updates within ``window``
            iterations. Defaults to 50.
        window (int): See ``max_skipped``. Defaults to 1000.
        max_rollbacks (int): Rollbacks in one process before the run stops instead.
            Defaults to 3.
        spike_zscore (float, optional): With ``'rollback'``: a rank's loss this many
            standard deviations above the mean of its previous ``spike_window``
            losses counts as a failed step. None: no spike check. Defaults to None.
        spike_window (int): See ``spike_zscore``. Defaults to 100.
    """

    policy: str = 'skip'
    max_consecutive: int = 10
    max_skipped: int = 50
    window: int = 1000
    max_rollbacks: int = 3
    spike_zscore: Optional[float] = None
    spike_window: int = 100

    @classmethod
    def of(cls, value: Any) -> NonFinitePolicy:
        """The policy of the ``nonfinite`` config key (None: the defaults); a bad value
        is refused, naming the key."""
        if value is None:
            return cls()
        if isinstance(value, NonFinitePolicy):
            return value
        if not isinstance(value, dict):
            raise TypeError(f'nonfinite must be a dict such as dict(policy="skip"), got '
                            f'{value!r}.')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f'nonfinite has unknown keys {unknown}; known: {sorted(known)}.')
        policy = cls(**value)
        if policy.policy not in POLICIES:
            raise ValueError(f'nonfinite.policy={policy.policy!r}: use one of {POLICIES}.')
        for name in ('max_consecutive', 'max_skipped', 'window', 'spike_window'):
            number = getattr(policy, name)
            if not isinstance(number, int) or number < 1:
                raise ValueError(f'nonfinite.{name}={number!r} must be an integer >= 1.')
        if not isinstance(policy.max_rollbacks, int) or policy.max_rollbacks < 0:
            raise ValueError(f'nonfinite.max_rollbacks={policy.max_rollbacks!r} must be an '
                             'integer >= 0.')
        if policy.spike_zscore is not None:
            if policy.policy != 'rollback':
                raise ValueError('nonfinite.spike_zscore needs policy="rollback": a spike '
                                 'reached the weights, only a rollback takes it back.')
            if not isinstance(policy.spike_zscore, (int, float)) or policy.spike_zscore <= 0:
                raise ValueError(f'nonfinite.spike_zscore={policy.spike_zscore!r} must be a '
                                 'number > 0 (6 is a common choice), or None.')
        return policy


def exclude_samples_of(value: Any) -> list[int]:
    """The ``exclude_samples`` config key: dataset indices, or the path of a JSON list of
    them (``excluded_samples.json`` from an earlier run)."""
    if value is None:
        return []
    if isinstance(value, str):
        if not osp.isfile(value):
            raise FileNotFoundError(f'exclude_samples={value!r}: no such file; give a list of '
                                    'dataset indices or the path of a JSON list of them.')
        with open(value, encoding='utf-8') as f:
            value = json.load(f)
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f'exclude_samples must be a list of dataset indices (integers >= 0) '
                         f'or the path of a JSON list of them, got {value!r}.')
    return sorted(set(value))


def is_loss_key(key: str) -> bool:
    """Whether a message hub key is a loss: a training key with ``loss`` in its name, as
    MMEngine's ``parse_losses`` sums them (not DeepSpeed's ``loss_scale``)."""
    name = key.removeprefix('train/')
    return key.startswith('train/') and 'loss' in name and not name.endswith('loss_scale')


@dataclass
class FailedStep:
    """One iteration whose step failed, as every rank saw it."""

    iteration: int  # 0-based
    skipped: bool = False
    losses: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> key -> value
    spikes: list[int] = field(default_factory=list)  # ranks
    batches: dict[int, Optional[list[int]]] = field(default_factory=dict)  # rank -> indices

    def culprits(self) -> list[int]:
        """The dataset indices to leave out: the batches of the ranks whose loss was not
        finite or spiked, else (gradients alone) every rank's."""
        ranks = sorted(set(self.losses) | set(self.spikes)) or sorted(self.batches)
        return sorted({i for rank in ranks for i in self.batches.get(rank) or []})

    def describe(self) -> str:
        what = []
        for rank, keys in sorted(self.losses.items()):
            values = ', '.join(f'{key.removeprefix("train/")}={value}'
                               for key, value in keys.items())
            what.append(f'rank {rank}: {values}')
        what += [f'rank {rank}: loss spike' for rank in self.spikes]
        cause = '; '.join(what) or 'gradients not finite, losses finite on every rank'
        batches = '; '.join(f'rank {rank}: {indices if indices is not None else "unknown"}'
                            for rank, indices in sorted(self.batches.items()))
        # a non-finite loss always has its update skipped (engine/nonfinite.py guard_loss)
        state = 'update skipped' if self.skipped or self.losses else 'update applied'
        return (f'iteration {self.iteration + 1} ({state}): {cause}. Dataset indices of the '
                f'batches: {batches}.')

    def record(self) -> dict[str, Any]:
        """As a line of ``nonfinite_steps.jsonl`` (JSON has no NaN: values as text)."""
        return dict(iteration=self.iteration + 1, skipped=self.skipped,
                    losses={str(r): {k: str(v) for k, v in keys.items()}
                            for r, keys in self.losses.items()},
                    spikes=self.spikes, batches={str(r): v for r, v in self.batches.items()})
