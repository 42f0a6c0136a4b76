"""The staleness rule both planes enforce (paper §2.2; DESIGN.md "Versions and staleness").

Units are prompt-level groups; ``B`` is the number of groups one training step consumes.
A group is tagged with the oldest actor version ``v_g`` that generated any of its tokens (a group resumed
after a partial-rollout interruption keeps its original tag). The trainer that holds version ``v_t``
and consumes the group for its update sees distance ``Δv = v_t − v_g``.

**Run-ahead (admission).** While rollouters hold version ``v``, at most
``floor((v + 1 + s) · B)`` groups may have been admitted to generation since the start.
This is veRL's fully-async rule (``async_training.staleness_threshold``: at most ``(1 + s)·B − n_stale``
samples generated per parameter-sync window, docs/advance/fully_async.md in volcengine/verl), written
cumulatively; for integer ``s`` it equals AReaL's capacity ``(max_staleness + version + 1)·batch``
(areal/infra/staleness_manager.py). ``s = 0`` allows exactly one batch per version (strict on-policy).

**Consumption.** ``max_lag = ceil(s)``. The batch for version ``v_t`` takes groups in order of
``(v_g, commit order)``:

* every admitted group with ``v_g ≤ v_t − max_lag`` *must* be in this batch (it would be too stale for the
  next one) — if such a group is still generating, the trainer waits for it;
* the rest of the batch is the oldest complete groups with ``v_g ≥ v_t − max_lag``.

Counting shows the rule is always satisfiable and never drops a group: with the admission bound,
at most ``floor((v_t + s)·B) − v_t·B ≤ floor(s·B)`` groups with ``v_g < v_t`` can be left when step ``v_t``
starts. Hence

* ``s = 0``: every consumed group has ``Δv = 0``;
* ``0 < s < 1``: ``Δv ≤ 1`` and at most ``floor(s·B)`` groups of a batch are stale (the batch-level
  freshness requirement);
* ``s ≥ 1``: ``Δv ≤ ceil(s)`` and a whole batch may be stale.

:func:`check_batch` states these as an invariant; the property tests run it on every batch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessRule:
    staleness: float
    batch: int

    def __post_init__(self):
        if self.staleness < 0:
            raise ValueError(f"staleness must be ≥ 0, got {self.staleness}")
        if self.batch < 1:
            raise ValueError(f"batch must be ≥ 1 group, got {self.batch}")

    @property
    def max_lag(self) -> int:
        return math.ceil(self.staleness)

    @property
    def stale_allowance(self) -> int:
        """Groups with Δv ≥ 1 one batch may hold."""
        if self.staleness == 0:
            return 0
        if self.staleness < 1:
            return math.floor(self.staleness * self.batch)
        return self.batch

    def admission_cap(self, rollout_version: int) -> int:
        """Most groups that may have been admitted in total while rollouters hold ``rollout_version``."""
        return math.floor((rollout_version + 1 + self.staleness) * self.batch + 1e-9)

    def leaves_consumable(self, left_versions: list, trainer_version: int) -> bool:
        """Whether the groups left after the batch for ``trainer_version`` can still all be consumed in time.

        ``left_versions`` (sorted) are the tags of every live group not in the batch. For every
        ``k = 0 … max_lag`` at most ``k·B`` of them may carry a tag ``≤ v_t + k − max_lag``: the next ``k``
        batches are the last that may take them. ``k = 0`` is the must-consume rule (nothing too stale for the
        next batch may be left); ``k ≥ 1`` is the look-ahead that keeps two "last-chance" groups from being
        stranded by oldest-first batches.
        """
        for k in range(self.max_lag + 1):
            if bisect.bisect_right(left_versions, trainer_version + k - self.max_lag) > k * self.batch:
                return False
        return True


    def leaves_consumable_counts(self, left_counts: dict, trainer_version: int, room: int = 0) -> bool:
        """:meth:`leaves_consumable` with the tags left given as counts ``{tag: groups}`` (the same answer,
        in O(tags) instead of O(groups)). ``room``: groups this version's step may still take after this batch (a
        streamed step's later local batches; 0 for a whole batch)."""
        for k in range(self.max_lag + 1):
            limit = trainer_version + k - self.max_lag
            if sum(n for tag, n in left_counts.items() if tag <= limit) > k * self.batch + room:
                return False
        return True


def check_batch(rule: StalenessRule, group_versions: list[int], trainer_version: int) -> None:
    """Raise AssertionError if a batch violates the rule (used by tests and the drivers' self-checks)."""
    if len(group_versions) != rule.batch:
        raise AssertionError(f"batch has {len(group_versions)} groups, expected {rule.batch}")
    lags = [trainer_version - v for v in group_versions]
    if min(lags) < 0:
        raise AssertionError(f"a group is newer than the trainer: lags {lags}")
    if max(lags) > rule.max_lag:
        raise AssertionError(f"Δv = {max(lags)} exceeds ceil(s) = {rule.max_lag}")
    stale = sum(1 for lag in lags if lag >= 1)
    if stale > rule.stale_allowance:
        raise AssertionError(f"{stale} stale groups exceed the allowance {rule.stale_allowance}")
