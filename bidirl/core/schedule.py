"""The reproducible mode's rule: which batch each group joins and which version generates it (issue 42).

Asynchronous RL normally forms a batch from the groups that completed first, and a sync cuts the responses in
flight wherever they are (partial rollout), so two runs of one seed train on different batches. In the
reproducible mode (``rl.reproducible``; on by default at s = 0) both are fixed by a rule of the step, the group and
the staleness bound s, never by completion order:

* **Batch.** Group ids are admitted in order 0, 1, 2, … (the driver maps an id to a prompt by the run's seed);
  group ``g`` is consumed by step ``g div B`` — a streamed step's local batches take consecutive ids too — and a
  batch is taken only when all of its groups are complete (:data:`SCHEDULE_RULE` in
  :meth:`bidirl.core.buffer.RolloutBuffer.select_batch`), groups in id order.
* **Version.** Group ``g`` is generated entirely from version ``e(g)``, the first version under which the run-ahead
  bound admits it: the smallest ``v ≥ 0`` with ``g < ⌊(v + 1 + s)·B⌋`` (:func:`generation_version`). Admission
  already starts it there; the mode keeps it there: a sync waits until every group admitted under the version
  still held has finished on it, instead of interrupting them (partial rollout's cut would follow timing).
* **Reductions.** The trainer's chunks are cut on a fixed grid (:class:`bidirl.core.chunks.TrainerStep`'s
  ``grid``: one micro-batch per device of the primary gang, from each stage's first sample), whichever gang takes
  them, and the step's gradient is summed in unit order (the engines' ordered sum).

It obeys the staleness rule: ``e(g) ≥ g div B − ⌈s⌉``, and for s < 1 at most ``⌊s·B⌋`` groups of a batch
are generated one version early, so :func:`bidirl.core.staleness.check_batch` holds for every batch (a hypothesis test).
Its price: the trainer waits for the rule's groups when others are complete, and a sync waits for the groups in
flight instead of cutting them; both waits are measured (:class:`Reproducibility`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

#: the batch rule of the reproducible mode (a key of ``bidirl.core.buffer.BATCH_RULES``)
SCHEDULE_RULE = "schedule"


def batch_of(group_id: int, batch: int) -> int:
    """The step that consumes group ``group_id``."""
    return int(group_id) // int(batch)


def generation_version(group_id: int, staleness: float, batch: int) -> int:
    """``e(g)``: the first version whose run-ahead bound ``⌊(v + 1 + s)·B⌋`` admits group ``g`` (module doc)."""
    g, v = int(group_id), 0
    while g >= math.floor((v + 1 + staleness) * batch + 1e-9):     # the admission cap of StalenessRule
        v += 1
    return v


@dataclass
class Reproducibility:
    """Whether a run's batches, rewards and weights follow its seed only, what made them depend on timing if not,
    and what the mode cost: seconds the trainer waited for the rule's batch while the default rule had one
    (``trainer_wait_s``), and seconds a sync waited for groups in flight that partial rollout would have cut
    (``sync_wait_s``)."""
    on: bool
    timing: list = field(default_factory=list)       # why the run depended on timing (empty: it did not)
    trainer_wait_s: float = 0.0
    sync_wait_s: float = 0.0
    _trainer_since: Optional[float] = None
    _sync_since: Optional[float] = None

    @classmethod
    def of(cls, settings, topology, policy) -> "Reproducibility":
        """The run's mode and what, from the start, makes it depend on timing."""
        out = cls(on=bool(settings.reproducible))
        if not out.on:
            out.note("the reproducible mode is off (rl.reproducible): batches take the groups that completed first "
                     "and a sync cuts responses in flight" if settings.staleness > 0 else
                     "the reproducible mode is off (rl.reproducible: false): chunks follow the borrowing split and "
                     "gradients add in the order they finish")
            return out
        if topology.aux_trainer_replicas and policy.trainer_on_rollout_pool \
                and topology.aux_trainer_replicas != topology.trainer_replicas:
            out.note(f"the auxiliary trainer gang has {topology.aux_trainer_replicas} replicas and the primary "
                     f"{topology.trainer_replicas}: a chunk's gradient depends on which gang computed it")
        return out

    def note(self, why: str) -> None:
        if why not in self.timing:
            self.timing.append(why)

    def trainer_waits(self, now: float, waiting: bool) -> Optional[tuple]:
        """The trainer is (``waiting``) or is no longer held back by the rule while a default batch was ready;
        returns the wait ``(start, end)`` that this ends, if any."""
        since = self._trainer_since
        self._trainer_since, self.trainer_wait_s = _tick(since, self.trainer_wait_s, now, waiting)
        return (since, now) if since is not None and not waiting else None

    def sync_waits(self, now: float, waiting: bool) -> Optional[tuple]:
        """A sync is (``waiting``) or is no longer held for groups in flight that partial rollout would cut;
        returns the wait ``(start, end)`` that this ends, if any."""
        since = self._sync_since
        self._sync_since, self.sync_wait_s = _tick(since, self.sync_wait_s, now, waiting)
        return (since, now) if since is not None and not waiting else None

    def summary(self) -> dict:
        return {"mode": self.on, "reproducible": self.on and not self.timing, "timing": list(self.timing),
                "trainer_wait_s": self.trainer_wait_s, "sync_wait_s": self.sync_wait_s}


def _tick(since: Optional[float], total: float, now: float, waiting: bool) -> tuple:
    """A wait's clock: start it, keep it, or stop it and add what it ran."""
    if waiting:
        return (now if since is None else since), total
    if since is not None:
        total += max(0.0, now - since)
    return None, total
