"""The rollout buffer: every admitted prompt group, where it is, and which are ready to train on (§2.2, §5.2).

A group moves ``running`` (on a rollout worker) → ``complete`` (committed, waiting in the buffer) →
``consumed`` (in a training batch). An interrupted group goes ``running`` → ``partial`` (its prefix kept
here) → ``running`` again on whichever worker resumes it; it is never regenerated from scratch.
Group ids are admitted in order 0, 1, 2, …; the driver maps an id to a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from bidirl.core.protocol import GroupState
from bidirl.core.staleness import StalenessRule


@dataclass
class GroupRecord:
    group_id: int
    version: int                 # staleness tag: oldest actor version among its tokens
    status: str = "running"      # running | partial | complete | consumed
    worker: Optional[str] = None
    state: Optional[GroupState] = None
    commit_seq: int = -1
    started: float = 0.0         # when it last started running on a worker (driver clock)


#: how a batch is formed from the complete groups (the control plane's rule, and the modelled systems' ones)
BATCH_RULES = {
    "lookahead": "oldest tag first, accepted only if what stays behind can still be consumed in time (bidirl)",
    "completion": "the first B groups to complete, whatever their tag (veRL fully-async: FIFO message queue)",
    "submission": "the B earliest-submitted among the complete groups (AReaL: oldest create_time first)",
    "oldest-first": "the B oldest live groups, waiting for those still generating (ROLL: oldest start step)",
}


@dataclass
class RolloutBuffer:
    rule: StalenessRule
    groups: dict = field(default_factory=dict)       # group_id -> GroupRecord, live groups only
    consumed_ids: set = field(default_factory=set)   # consumed groups leave ``groups`` (keeps scans short)
    next_group_id: int = 0
    commits: int = 0
    duplicates: int = 0
    dropped: int = 0                                  # groups discarded unfinished; their admission slots free

    # admission -----------------------------------------------------------------------------------
    def admissible(self, rollout_version: int) -> int:
        """How many new groups may be admitted now under the run-ahead rule."""
        return max(0, self.rule.admission_cap(rollout_version) - (self.next_group_id - self.dropped))

    def in_flight(self) -> int:
        """Groups generating or waiting to resume."""
        return sum(1 for r in self.groups.values() if r.status in ("running", "partial"))

    def admit(self, rollout_version: int, worker: str, t: float = 0.0) -> int:
        gid = self.next_group_id
        self.next_group_id += 1
        self.groups[gid] = GroupRecord(gid, rollout_version, "running", worker, started=t)
        return gid

    # generation results --------------------------------------------------------------------------
    def commit(self, state: GroupState) -> bool:
        """A complete group arrived. Returns False (and counts a duplicate) if it was already committed."""
        rec = self.groups.get(state.group_id)
        if rec is None and state.group_id not in self.consumed_ids:
            raise ValueError(f"group {state.group_id} was never admitted")
        if rec is None or rec.status == "complete":
            self.duplicates += 1
            return False
        rec.status, rec.worker, rec.state = "complete", None, state
        rec.version = min(rec.version, state.version)
        rec.commit_seq = self.commits
        self.commits += 1
        return True

    def park(self, state: GroupState) -> None:
        """An interrupted group's prefix comes back; it waits to be resumed."""
        rec = self.groups.get(state.group_id)
        if rec is None or rec.status == "complete":
            return
        rec.status, rec.worker, rec.state = "partial", None, state
        rec.version = min(rec.version, state.version)

    def resume(self, group_id: int, worker: str, t: float = 0.0) -> Optional[GroupState]:
        rec = self.groups[group_id]
        rec.status, rec.worker, rec.started = "running", worker, t
        return rec.state

    def drop(self, group_id: int) -> None:
        """Discard an unfinished group with its tokens (a system that drops over-stale work, as ROLL does); its
        admission slot is free again."""
        rec = self.groups.pop(group_id)
        if rec.status == "complete":
            raise AssertionError(f"group {group_id} is complete; only unfinished groups are dropped")
        self.dropped += 1

    def lose(self, group_id: int) -> None:
        """The worker generating the group died: it waits to be resumed from its last known state (the prefix
        generated since it was last parked is lost with the worker)."""
        rec = self.groups[group_id]
        rec.status, rec.worker = "partial", None

    def partial_ids(self) -> list[int]:
        """Parked groups, oldest tag first (they are the ones the trainer may have to wait for)."""
        return sorted((r.group_id for r in self.groups.values() if r.status == "partial"),
                      key=lambda g: (self.groups[g].version, g))

    def running_on(self, worker: str) -> list[int]:
        return [g for g, r in self.groups.items() if r.status == "running" and r.worker == worker]

    # consumption ---------------------------------------------------------------------------------
    def select_batch(self, trainer_version: int, rule: str = "lookahead") -> Optional[list[int]]:
        """The batch for ``trainer_version`` under batch-formation ``rule`` (see :data:`BATCH_RULES`)."""
        B = self.rule.batch
        if rule == "lookahead":
            return self._select_lookahead(trainer_version)
        if rule == "oldest-first":
            live = sorted(self.groups.values(), key=lambda r: (r.version, r.group_id))[:B]
            return [r.group_id for r in live] if len(live) == B and all(r.status == "complete" for r in live) \
                else None
        key = {"completion": lambda r: r.commit_seq, "submission": lambda r: r.group_id}[rule]
        complete = sorted((r for r in self.groups.values() if r.status == "complete"), key=key)
        return [r.group_id for r in complete[:B]] if len(complete) >= B else None

    def _select_lookahead(self, trainer_version: int) -> Optional[list[int]]:
        """The batch for ``trainer_version`` if it can be formed now, else None.

        Takes the ``B`` oldest complete groups (by tag, then commit order) and accepts them only if what
        stays behind can still be consumed in time: after this batch, at most ``k·B`` live groups may carry
        a tag ``≤ v_t + k − ceil(s)`` for every ``k = 0 … ceil(s)`` (k = 0: nothing too stale for the next
        batch may be left). Otherwise the trainer waits for the older groups still generating.
        """
        B = self.rule.batch
        complete = sorted((r for r in self.groups.values() if r.status == "complete"),
                          key=lambda r: (r.version, r.commit_seq))
        if len(complete) < B:
            return None
        chosen = complete[:B]
        taken = {r.group_id for r in chosen}
        left = sorted(r.version for r in self.groups.values() if r.group_id not in taken)
        if not self.rule.leaves_consumable(left, trainer_version):
            return None
        return [r.group_id for r in chosen]

    def deficit(self, trainer_version: int) -> int:
        """Q_r: groups still generating among the ``B`` oldest live ones (what the next batch waits for)."""
        live = sorted(self.groups.values(), key=lambda r: (r.version, r.group_id))[: self.rule.batch]
        missing = sum(1 for r in live if r.status != "complete")
        return missing + max(0, self.rule.batch - len(live))

    def needed(self) -> list:
        """The records of the groups the next batch waits for: not complete among the ``B`` oldest live ones."""
        live = sorted(self.groups.values(), key=lambda r: (r.version, r.group_id))[: self.rule.batch]
        return [r for r in live if r.status != "complete"]

    def consume(self, group_ids: list[int]) -> list[GroupState]:
        out = []
        for gid in group_ids:
            rec = self.groups.get(gid)
            if rec is None or rec.status != "complete":
                raise AssertionError(f"group {gid} consumed while {rec.status if rec else 'consumed'}")
            del self.groups[gid]
            self.consumed_ids.add(gid)
            out.append(rec.state)
        return out

    # accounting ----------------------------------------------------------------------------------
    def counts(self) -> dict:
        by = {"running": 0, "partial": 0, "complete": 0, "consumed": len(self.consumed_ids)}
        for rec in self.groups.values():
            by[rec.status] += 1
        return by
