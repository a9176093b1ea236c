"""What a failed step is, and the settings of what follows one (``guard/hook.py``).

:class:`NonFinitePolicy` is the ``nonfinite`` config key, checked when the runner is
built; :class:`FailedStep` is one iteration whose step failed as every rank saw it: what
the log says about it, the line of ``nonfinite_steps.jsonl``, and the samples a rollback
leaves out; :class:`FailedStepWatch` is what one rank sees of them and the policy's limits.
"""
from __future__ import annotations

import collections
import json
import math
import os.path as osp
import statistics
from collections.abc import Iterable
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


class FailedStepWatch:
    """What one rank sees of failed steps: updates DeepSpeed skipped, losses that were not
    finite and loss spikes, from the skip counts and losses the message hub hands it, and
    whether the policy's limits are reached.

    What this rank saw since the last report is :meth:`take`-n for the report (which
    gathers every rank's); the limits count the reported steps of every rank.

    Args:
        policy (NonFinitePolicy): The limits and the spike check.
        counts (dict[str, float]): Each optimizer's skip-count key and its count now.
            Defaults to none.
        loss_scaled (Iterable[str]): Skip-count keys of fp16 engines, whose updates
            DeepSpeed's loss scaler skips with finite losses: counted, not failed steps.
            Defaults to none.
    """

    def __init__(self, policy: NonFinitePolicy, counts: Optional[dict[str, float]] = None,
                 loss_scaled: Iterable[str] = ()):
        self.policy = policy
        self.counts: dict[str, float] = dict(counts or {})
        self.loss_scaled = frozenset(loss_scaled)
        self._consecutive: collections.Counter = collections.Counter()
        self._recent: collections.deque[int] = collections.deque()  # reported skips
        self._losses: collections.deque[float] = collections.deque(maxlen=policy.spike_window)
        self._skips: list[int] = []
        self._bad: dict[int, dict[str, float]] = {}
        self._spikes: list[int] = []

    @staticmethod
    def watches(key: str) -> bool:
        """The message hub keys :meth:`observe` acts on: skip counts and losses."""
        return key.endswith('skipped_steps') or is_loss_key(key)

    def observe(self, key: str, iteration: int, value: float) -> None:
        """One logged value: a skip count (an update skipped when it grows) or a loss."""
        if key.endswith('skipped_steps'):
            last = self.counts.get(key, 0.0)
            self.counts[key] = value
            if key in self.loss_scaled:
                return
            if value > last:
                self._skips.append(iteration)
                self._consecutive[key] += 1
            else:
                self._consecutive[key] = 0
        elif is_loss_key(key):
            if not math.isfinite(value):
                self._bad.setdefault(iteration, {})[key] = value
            elif key == 'train/loss' and self.policy.spike_zscore is not None:
                self._check_spike(iteration, value)

    def _check_spike(self, iteration: int, value: float) -> None:
        window = self._losses
        if len(window) == window.maxlen:
            spread = statistics.pstdev(window)
            if spread > 0 and (value - statistics.fmean(window)) / spread \
                    > float(self.policy.spike_zscore or 0):
                self._spikes.append(iteration)
                return  # a spike stays out of the window it is measured against
        window.append(value)

    @property
    def seen(self) -> bool:
        """Whether this rank saw a failed step since the last :meth:`take`."""
        return bool(self._bad or self._skips or self._spikes)

    @property
    def skipped(self) -> int:
        """Updates skipped so far (every optimizer's, loss scaling's included)."""
        return int(sum(self.counts.values()))

    def take(self) -> dict[str, Any]:
        """This rank's failed steps since the last call, and forget them: ``skips`` (the
        iterations of skipped updates), ``bad`` (iteration -> non-finite losses by key) and
        ``spikes`` (iterations)."""
        seen = dict(skips=sorted(set(self._skips)), bad=self._bad, spikes=self._spikes)
        self._skips, self._bad, self._spikes = [], {}, []
        return seen

    def reported(self, steps: Iterable[FailedStep], iteration: int) -> None:
        """Count the skipped updates among ``steps`` (every rank's) toward ``max_skipped``
        within the window that ends at ``iteration``."""
        self._recent.extend(step.iteration for step in steps if step.skipped)
        while self._recent and self._recent[0] <= iteration - self.policy.window:
            self._recent.popleft()

    def limit_reached(self) -> Optional[str]:
        """Which limit the skipped updates reached, in words; None below both."""
        key, most = max(self._consecutive.items(), key=lambda kv: kv[1], default=('', 0))
        if most >= self.policy.max_consecutive:
            name = key.removeprefix('train/').removesuffix('skipped_steps').rstrip('.')
            return (f'{most} consecutive update{"s" if most > 1 else ""} '
                    f'{f"of {name} " if name else ""}skipped '
                    f'(max_consecutive={self.policy.max_consecutive})')
        if len(self._recent) >= self.policy.max_skipped:
            return (f'{len(self._recent)} updates skipped within {self.policy.window} '
                    f'iterations (max_skipped={self.policy.max_skipped})')
        return None

    def restart_limits(self) -> None:
        """Count toward the limits from zero (after a rollback)."""
        self._consecutive.clear()
        self._recent.clear()
