"""One training step's stage-ordered trainer workload as chunks (paper §5.2 Algorithm 2, §6.3 Table 2).

The step's samples (``B`` groups × ``group_size`` responses, in batch order) are processed stage by stage:
``old_logprob`` and ``ref_logprob`` (forward passes, one *segment*), then ``actor_update`` (a second
segment: it needs the first segment's log-probs of every sample, so the segments are separated by a barrier).
A segment is an ordered list of *units* ``(stage, sample)``. A chunk is a contiguous run of units of one
stage executed by one trainer gang of ``d`` replicas of ``rho`` devices: one micro-batch of at most ``max_chunk``
(s_max) units on every device, ``per_device`` units each; the smallest chunk is one unit per device (§5.2).

Chunk states follow Table 2: ``queued`` (sent, not started: recoverable), ``running`` (finishes),
``finished`` (merged in original order), ``cancelled`` (terminal; its units go back to the queue).
Finished chunks are merged in unit order, so where a chunk ran never changes what the update computes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Optional

from bidirl.core.gates import joint_tail_split
from bidirl.core.protocol import AUXILIARY, FORWARD_STAGES, PRIMARY, UPDATE_STAGES, Chunk


@dataclass
class ChunkRecord:
    chunk: Chunk
    side: str                    # "primary" | "auxiliary"
    units: tuple                 # unit indices in the segment, contiguous
    status: str = "queued"
    worker: str = ""
    started: Optional[float] = None
    predicted: float = 0.0


@dataclass
class TrainerStep:
    """The chunk queue of one step. ``chunk_time(stage, prompt_lens, response_lens, d, side)`` predicts."""
    step: int
    version: int
    groups: list                 # GroupState, batch order
    stages: tuple
    max_chunk: int               # s_max, units per device (the per-device micro-batch)
    next_chunk_id: Callable[[], int]
    rho: int = 1                 # devices per trainer replica
    segment_index: int = 0
    pending: list = field(default_factory=list)       # sorted unit indices not yet in a live chunk
    tail_plan: dict = field(default_factory=dict)     # side -> list of unit tuples (after JointTailSplit)
    chunks: dict = field(default_factory=dict)        # chunk_id -> ChunkRecord (this segment)
    merged_upto: int = 0
    merge_order: list = field(default_factory=list)   # chunk ids in merge order, all segments
    merge_positions: list = field(default_factory=list)  # (segment, first unit) of each merged chunk
    aux_update_chunks: list = field(default_factory=list)

    def __post_init__(self):
        self.prompt_lens, self.response_lens, self.sample_refs = [], [], []
        for g in self.groups:
            for i, r in enumerate(g.generated):
                self.prompt_lens.append(g.prompt_len)
                self.response_lens.append(int(r))
                self.sample_refs.append((g.group_id, i))
        self.segments = [tuple(s for s in seg if s in self.stages) for seg in (FORWARD_STAGES, UPDATE_STAGES)]
        self.segments = [s for s in self.segments if s]
        self._open_segment()

    # ---------------------------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return len(self.sample_refs)

    @property
    def segment(self) -> tuple:
        return self.segments[self.segment_index]

    def _open_segment(self):
        self.units = [(stage, i) for stage in self.segment for i in range(self.n_samples)]
        self.pending = list(range(len(self.units)))
        self.tail_plan, self.chunks, self.merged_upto = {}, {}, 0

    @property
    def segment_done(self) -> bool:
        return self.merged_upto == len(self.units)

    @property
    def done(self) -> bool:
        return self.segment_index == len(self.segments) - 1 and self.segment_done

    def advance_segment(self) -> bool:
        """Open the next segment after the barrier; False if this was the last."""
        if self.segment_index + 1 >= len(self.segments):
            return False
        self.segment_index += 1
        self._open_segment()
        return True

    def lens(self, units) -> tuple:
        idx = [self.units[u][1] for u in units]
        return [self.prompt_lens[i] for i in idx], [self.response_lens[i] for i in idx]

    def remaining_units(self) -> list:
        """Units not finished in this and later segments, as (stage, sample) pairs — the workload U."""
        live = [u for c in self.chunks.values() if c.status in ("queued", "running") for u in c.units]
        planned = [u for plan in self.tail_plan.values() for run in plan for u in run]
        now = [self.units[u] for u in sorted(set(self.pending) | set(live) | set(planned))]
        later = [(stage, i) for seg in self.segments[self.segment_index + 1:] for stage in seg
                 for i in range(self.n_samples)]
        return now + later

    # pulling -------------------------------------------------------------------------------------
    def _take_run(self, limit: int) -> tuple:
        """Up to ``limit`` pending units from the front, contiguous and of one stage."""
        if not self.pending:
            return ()
        first = self.pending[0]
        stage = self.units[first][0]
        run = [first]
        for u in self.pending[1:limit]:
            if u != run[-1] + 1 or self.units[u][0] != stage:
                break
            run.append(u)
        del self.pending[: len(run)]
        return tuple(run)

    def pull(self, side: str, d: int, worker: str) -> Optional[ChunkRecord]:
        """LazyPull(Q, x, s_max): the next chunk for ``side`` — its tail-plan entry if one was made."""
        plan = self.tail_plan.get(side)
        if plan:
            units = plan.pop(0)
        elif self.tail_plan:
            return None          # after the tail split each side runs only its own plan
        else:
            units = self._take_run(self.chunk_units(d))
        if not units:
            return None
        return self._make_chunk(units, side, d, worker)

    def chunk_units(self, d: int) -> int:
        """Units in a full chunk on a gang of ``d`` replicas: s_max on each of its ``d · rho`` devices."""
        return self.max_chunk * self.rho * d

    def _make_chunk(self, units: tuple, side: str, d: int, worker: str) -> ChunkRecord:
        stage = self.units[units[0]][0]
        samples = tuple(self.sample_refs[self.units[u][1]] for u in units)
        per_device = -(-len(units) // (d * self.rho))
        chunk = Chunk(self.next_chunk_id(), self.step, stage, units[0], samples, per_device)
        rec = ChunkRecord(chunk, side, units, worker=worker)
        self.chunks[chunk.chunk_id] = rec
        return rec

    # tail ----------------------------------------------------------------------------------------
    def in_tail_window(self, d_p: int, d_a: int, tail_window: int) -> bool:
        """TailWindow(Q): the pending work fits in ``tail_window`` rounds of full chunks on both sides (one
        combined primary-and-auxiliary window, as the paper fires it, when ``tail_window`` is 1)."""
        return (not self.tail_plan and 0 < len(self.pending)
                <= tail_window * (self.chunk_units(d_p) + self.chunk_units(d_a)))

    def split_runs(self, units: list, d: int) -> list:
        """Full chunks of s_max·d units plus at most one remainder per stage (never across stages)."""
        runs, cur = [], []
        for u in units:
            if cur and (self.units[u][0] != self.units[cur[-1]][0] or len(cur) == self.chunk_units(d)
                        or u != cur[-1] + 1):
                runs.append(tuple(cur))
                cur = []
            cur.append(u)
        if cur:
            runs.append(tuple(cur))
        return runs

    def plan_tail(self, d_p: int, d_a: int, ready_p: float, ready_a: float,
                  chunk_time: Callable) -> tuple[int, float]:
        """JointTailSplit over the pending units (:func:`bidirl.core.gates.joint_tail_split`): the auxiliary
        side takes the trailing ``n_a`` units, each side runs full chunks of s_max plus at most one remainder.
        Returns (units given to the auxiliary side, predicted joint completion)."""
        units = list(self.pending)
        n = len(units)

        def side_time(part, d, side):
            total = 0.0
            for run in self.split_runs(part, d):
                p, r = self.lens(run)
                total += chunk_time(self.units[run[0]][0], p, r, d, side)
            return total

        n_a, finish = joint_tail_split(n, d_p * self.rho, d_a * self.rho, ready_p, ready_a,
                                       lambda k: side_time(units[:k], d_p, PRIMARY),
                                       lambda k: side_time(units[n - k:], d_a, AUXILIARY))
        self.tail_plan = {PRIMARY: self.split_runs(units[: n - n_a], d_p),
                          AUXILIARY: self.split_runs(units[n - n_a:], d_a)}
        self.pending = []
        return n_a, finish

    def plan_proportional(self, d_p: int, d_a: int) -> int:
        """One-shot DP-proportional split of the pending work (the opportunistic ablation)."""
        units = list(self.pending)
        n_a = round(len(units) * d_a / (d_p + d_a))
        n_p = len(units) - n_a
        self.tail_plan = {PRIMARY: self.split_runs(units[:n_p], d_p),
                          AUXILIARY: self.split_runs(units[n_p:], d_a)}
        self.pending = []
        return n_a

    # chunk life cycle ----------------------------------------------------------------------------
    def started(self, chunk_id: int, t: float) -> None:
        rec = self.chunks[chunk_id]
        if rec.status == "queued":
            rec.status, rec.started = "running", t

    def cancel(self, chunk_id: int) -> bool:
        """Reclaim a queued chunk: its units return to the queue (Table 2: recoverable). A tail split made
        before is folded back too, so the returned units are planned again with the rest."""
        rec = self.chunks[chunk_id]
        if rec.status != "queued":
            return False
        rec.status = "cancelled"
        for u in rec.units:
            bisect.insort(self.pending, u)
        self.release_plan()
        return True

    def release_plan(self) -> None:
        """Fold the tail plan back into the queue (the auxiliary lease was revoked): primaries lazy-pull it."""
        for plan in self.tail_plan.values():
            for run in plan:
                for u in run:
                    bisect.insort(self.pending, u)
        self.tail_plan = {}

    def finish(self, chunk_id: int) -> list:
        """Mark finished and merge every chunk now contiguous from the front; returns newly merged ids."""
        rec = self.chunks[chunk_id]
        if rec.status == "finished":
            raise AssertionError(f"chunk {chunk_id} finished twice")
        rec.status = "finished"
        if rec.side == AUXILIARY and rec.chunk.stage in UPDATE_STAGES:
            self.aux_update_chunks.append(chunk_id)
        by_start = {c.units[0]: c for c in self.chunks.values() if c.status == "finished"}
        merged = []
        while self.merged_upto in by_start:
            c = by_start.pop(self.merged_upto)
            self.merged_upto = c.units[-1] + 1
            self.merge_order.append(c.chunk.chunk_id)
            self.merge_positions.append((self.segment_index, c.units[0]))
            merged.append(c.chunk.chunk_id)
        return merged

    def update_merge_order(self) -> tuple:
        """The actor-update chunks' ids in merge (original) order: the order the optimizer applies them."""
        return tuple(c for c in self.merge_order if c in self.chunks and self.chunks[c].chunk.stage in UPDATE_STAGES)

    def live(self, side: Optional[str] = None) -> list:
        return [c for c in self.chunks.values() if c.status in ("queued", "running")
                and (side is None or c.side == side)]

    def has_work(self, side: str) -> bool:
        if self.tail_plan:
            return bool(self.tail_plan.get(side))
        return bool(self.pending)
