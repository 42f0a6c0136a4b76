"""The rollout buffer: every admitted prompt group, where it is, and which are ready to train on (§2.2, §5.2).

A group moves ``running`` (on a rollout worker) → ``complete`` (committed, waiting in the buffer) →
``consumed`` (in a training batch). An interrupted group goes ``running`` → ``partial`` (its prefix kept
here) → ``running`` again on whichever worker resumes it; it is never regenerated from scratch.
Group ids are admitted in order 0, 1, 2, …; the driver maps an id to a prompt.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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
    "schedule": "the next B group ids, once all are complete (the reproducible mode: bidirl.core.schedule)",
}


def _decrement(counts: collections.Counter, tag: int) -> None:
    """One group fewer with ``tag``; a tag no group carries leaves the counter (so scans of it cost O(live tags),
    not O(tags ever seen))."""
    counts[tag] -= 1
    if not counts[tag]:
        del counts[tag]


@dataclass
class RolloutBuffer:
    """The live groups and three indexes kept in step with them (so the coordinator's per-event questions —
    what runs on a worker, how many are complete, which are parked — cost O(answer), not a scan): every status
    change goes through :meth:`_move`."""
    rule: StalenessRule
    groups: dict = field(default_factory=dict)       # group_id -> GroupRecord, live groups only (id order)
    consumed_ids: set = field(default_factory=set)   # consumed groups leave ``groups`` (keeps scans short)
    next_group_id: int = 0
    commits: int = 0
    duplicates: int = 0
    dropped: int = 0                                  # groups discarded unfinished; their admission slots free
    on_worker: dict = field(default_factory=dict)     # worker -> ids of the groups running there
    busy: set = field(default_factory=set)            # workers with at least one group running there
    partial: set = field(default_factory=set)         # ids of the parked groups
    complete: set = field(default_factory=set)        # ids of the complete groups
    tags: collections.Counter = field(default_factory=collections.Counter)           # tag -> live groups
    complete_tags: collections.Counter = field(default_factory=collections.Counter)  # tag -> complete groups
    complete_by_tag: dict = field(default_factory=dict)  # tag -> {id: None} of its complete groups, commit order

    def _move(self, rec: GroupRecord, status: str, worker: Optional[str] = None) -> None:
        """Set a live group's status and worker, keeping the indexes in step."""
        if rec.status == "running" and rec.worker is not None:
            ids = self.on_worker[rec.worker]
            ids.discard(rec.group_id)
            if not ids:
                self.busy.discard(rec.worker)
        elif rec.status == "partial":
            self.partial.discard(rec.group_id)
        elif rec.status == "complete":
            self.complete.discard(rec.group_id)
            _decrement(self.complete_tags, rec.version)
            del self.complete_by_tag[rec.version][rec.group_id]
        rec.status, rec.worker = status, worker
        if status == "running" and worker is not None:
            self.on_worker.setdefault(worker, set()).add(rec.group_id)
            self.busy.add(worker)
        elif status == "partial":
            self.partial.add(rec.group_id)
        elif status == "complete":
            self.complete.add(rec.group_id)
            self.complete_tags[rec.version] += 1
            self.complete_by_tag.setdefault(rec.version, {})[rec.group_id] = None

    def _retag(self, rec: GroupRecord, version: int) -> None:
        """Lower a group's staleness tag to ``version`` if older (the oldest version among its tokens)."""
        if version < rec.version:
            _decrement(self.tags, rec.version)
            self.tags[version] += 1
            if rec.status == "complete":
                _decrement(self.complete_tags, rec.version)
                self.complete_tags[version] += 1
                del self.complete_by_tag[rec.version][rec.group_id]
                ids = self.complete_by_tag.setdefault(version, {})
                ids[rec.group_id] = None
                # keep the tag's groups in commit order
                self.complete_by_tag[version] = dict.fromkeys(sorted(ids, key=lambda g: self.groups[g].commit_seq))
            rec.version = version

    def _remove(self, rec: GroupRecord) -> None:
        self._move(rec, "removed")
        _decrement(self.tags, rec.version)
        del self.groups[rec.group_id]

    # admission -----------------------------------------------------------------------------------
    def admissible(self, rollout_version: int) -> int:
        """How many new groups may be admitted now under the run-ahead rule."""
        return max(0, self.rule.admission_cap(rollout_version) - (self.next_group_id - self.dropped))

    def in_flight(self) -> int:
        """Groups generating or waiting to resume."""
        return len(self.groups) - len(self.complete)

    def admit(self, rollout_version: int, worker: str, t: float = 0.0) -> int:
        gid = self.next_group_id
        self.next_group_id += 1
        self.groups[gid] = rec = GroupRecord(gid, rollout_version, "new", None, started=t)
        self.tags[rollout_version] += 1
        self._move(rec, "running", worker)
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
        self._retag(rec, state.version)
        self._move(rec, "complete")
        rec.state = state
        rec.commit_seq = self.commits
        self.commits += 1
        return True

    def park(self, state: GroupState) -> None:
        """An interrupted group's prefix comes back; it waits to be resumed."""
        rec = self.groups.get(state.group_id)
        if rec is None or rec.status == "complete":
            return
        self._retag(rec, state.version)
        self._move(rec, "partial")
        rec.state = state

    def resume(self, group_id: int, worker: str, t: float = 0.0) -> Optional[GroupState]:
        rec = self.groups[group_id]
        self._move(rec, "running", worker)
        rec.started = t
        return rec.state

    def drop(self, group_id: int) -> None:
        """Discard an unfinished group with its tokens (a system that drops over-stale work, as ROLL does); its
        admission slot is free again."""
        rec = self.groups[group_id]
        if rec.status == "complete":
            raise AssertionError(f"group {group_id} is complete; only unfinished groups are dropped")
        self._remove(rec)
        self.dropped += 1

    def lose(self, group_id: int) -> None:
        """The worker generating the group died: it waits to be resumed from its last known state (the prefix
        generated since it was last parked is lost with the worker)."""
        self._move(self.groups[group_id], "partial")

    def partial_ids(self) -> list[int]:
        """Parked groups, oldest tag first (they are the ones the trainer may have to wait for)."""
        return sorted(self.partial, key=lambda g: (self.groups[g].version, g))

    def running_on(self, worker: str) -> list[int]:
        """The groups running on ``worker``, in id order."""
        return sorted(self.on_worker.get(worker, ()))

    def running_count(self, worker: str) -> int:
        return len(self.on_worker.get(worker, ()))

    def any_running(self, workers: frozenset) -> bool:
        """Whether a group runs on any of ``workers`` (a set: the test costs the smaller of it and the busy set)."""
        return not self.busy.isdisjoint(workers)

    # consumption ---------------------------------------------------------------------------------
    def select_batch(self, trainer_version: int, rule: str = "lookahead", size: Optional[int] = None,
                     room: int = 0) -> Optional[list[int]]:
        """The batch for ``trainer_version`` under batch-formation ``rule`` (see :data:`BATCH_RULES`).

        Streaming consumption (``rl.updates_per_sync``) takes a step's batch as several local batches: ``size``
        groups now (default: the whole batch ``B``), with ``room`` more groups of the same version still to be taken
        by the step's later local updates — which the look-ahead counts as places the groups left behind can still
        go (:meth:`_select_lookahead`). The last local batch of a step has no room left: the rule as for a whole
        batch."""
        B = self.rule.batch if size is None else int(size)
        if rule == "lookahead":
            return self._select_lookahead(trainer_version, B, room)
        if rule == "schedule":
            first = len(self.consumed_ids)             # ids are consumed in order: the next batch is the next B ids
            ids = list(range(first, first + B))
            recs = [self.groups.get(g) for g in ids]
            return ids if all(r is not None and r.status == "complete" for r in recs) else None
        if rule == "oldest-first":
            live = self._oldest(B) if len(self.complete) >= B else []
            return [r.group_id for r in live] if len(live) == B and all(r.status == "complete" for r in live) \
                else None
        key = {"completion": lambda r: r.commit_seq, "submission": lambda r: r.group_id}[rule]
        if len(self.complete) < B:
            return None
        complete = sorted((self.groups[g] for g in self.complete), key=key)
        return [r.group_id for r in complete[:B]] if len(complete) >= B else None

    def _select_lookahead(self, trainer_version: int, B: Optional[int] = None, room: int = 0) -> Optional[list[int]]:
        """The batch for ``trainer_version`` if it can be formed now, else None.

        Takes the ``B`` oldest complete groups (by tag, then commit order) and accepts them only if what
        stays behind can still be consumed in time: after this batch, at most ``k·B`` live groups may carry
        a tag ``≤ v_t + k − ceil(s)`` for every ``k = 0 … ceil(s)`` (k = 0: nothing too stale for the next
        batch may be left). Otherwise the trainer waits for the older groups still generating. A local batch of a
        streamed step (``B`` below the rule's batch) counts the ``room`` its step still has for this version too.
        """
        B = self.rule.batch if B is None else B
        if len(self.complete) < B:
            return None
        # the tags the B oldest complete groups take, and the tags of every live group left behind (counts: the
        # test needs only the multiset of tags, so it costs O(tags) until a batch is accepted)
        left, need = collections.Counter(self.tags), B
        for tag in sorted(t for t, n in self.complete_tags.items() if n):
            take = min(need, self.complete_tags[tag])
            left[tag] -= take
            need -= take
            if not need:
                break
        if not self.rule.leaves_consumable_counts(left, trainer_version, room):
            return None
        # the B oldest complete groups by (tag, commit order): each tag's groups are kept in commit order
        chosen = []
        for tag in sorted(t for t, n in self.complete_tags.items() if n):
            for gid in self.complete_by_tag[tag]:
                chosen.append(gid)
                if len(chosen) == B:
                    return chosen
        return chosen

    def deficit(self, trainer_version: int) -> int:
        """Q_r: groups still generating among the ``B`` oldest live ones (what a batch that takes the oldest live
        groups waits for; the look-ahead batch's is :meth:`waited_for`'s)."""
        live = self._oldest()
        missing = sum(1 for r in live if r.status != "complete")
        return missing + max(0, self.rule.batch - len(live))

    def needed(self) -> list:
        """The records of the groups a batch of the ``B`` oldest live ones waits for: not complete among them."""
        return [r for r in self._oldest() if r.status != "complete"]

    def waited_for(self, trainer_version: int, finish_first: Callable[[GroupRecord], Any],
                   size: Optional[int] = None, room: int = 0) -> tuple:
        """What the look-ahead batch for ``trainer_version`` (:meth:`_select_lookahead`, ``size``/``room`` as
        there) waits for: ``(records, unadmitted)``, the unfinished groups expected to complete it and how many
        groups not admitted yet it still needs; ``len(records) + unadmitted`` is Q_r (§5.2).

        The batch forms once ``size`` groups are complete and taking the oldest of them leaves what stays behind
        consumable: for every ``k = 0 … ceil(s)`` at least ``live(≤ x_k) − (k·B + room)`` groups with a tag
        ``≤ x_k = v_t + k − ceil(s)`` complete (k = 0: every group too stale for the next batch). Past those,
        any group completes it: at ``s ≥ 1`` a batch need not wait for the oldest groups still generating. So for
        each ``k`` in turn the unfinished groups of those tags expected to complete first (``finish_first``, a sort
        key: smaller first) are taken until the count holds, then any until ``size`` would be complete."""
        B = self.rule.batch if size is None else int(size)
        lag = self.rule.max_lag
        unfinished = sorted((r for r in self.groups.values() if r.status != "complete"),
                            key=lambda r: (finish_first(r), r.version, r.group_id))
        chosen, chosen_tags = {}, collections.Counter()

        def up_to(counts, x):
            return sum(n for tag, n in counts.items() if tag <= x)

        def take(n, x=None):
            for r in unfinished:
                if n <= 0:
                    return
                if r.group_id not in chosen and (x is None or r.version <= x):
                    chosen[r.group_id] = r
                    chosen_tags[r.version] += 1
                    n -= 1

        for k in range(lag + 1):
            x = trainer_version + k - lag
            take(up_to(self.tags, x) - (k * self.rule.batch + room) - up_to(self.complete_tags, x)
                 - up_to(chosen_tags, x), x)
        take(B - len(self.complete) - len(chosen))
        return list(chosen.values()), max(0, B - len(self.complete) - len(chosen))

    def _oldest(self, n: Optional[int] = None) -> list:
        """The ``n`` (default ``B``) oldest live groups, by tag then id."""
        return heapq.nsmallest(self.rule.batch if n is None else n, self.groups.values(),
                               key=lambda r: (r.version, r.group_id))

    def consume(self, group_ids: list[int]) -> list[GroupState]:
        out = []
        for gid in group_ids:
            rec = self.groups.get(gid)
            if rec is None or rec.status != "complete":
                raise AssertionError(f"group {gid} consumed while {rec.status if rec else 'consumed'}")
            self._remove(rec)
            self.consumed_ids.add(gid)
            out.append(rec.state)
        return out

    # accounting ----------------------------------------------------------------------------------
    def counts(self) -> dict:
        return {"running": len(self.groups) - len(self.partial) - len(self.complete), "partial": len(self.partial),
                "complete": len(self.complete), "consumed": len(self.consumed_ids)}
