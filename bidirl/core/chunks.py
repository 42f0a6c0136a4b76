"""One training step's stage-ordered trainer workload as chunks (paper §5.2 Algorithm 2, §6.3 Table 2).

The step's samples (``B`` groups × ``group_size`` responses, in batch order) are processed stage by stage:
``old_logprob`` and ``ref_logprob`` (forward passes, one *segment*), then ``actor_update`` (a second
segment: it needs the first segment's log-probs of every sample, so the segments are separated by a barrier).
With optimizer mini-batches (``mini_batch`` samples, ``rl.mini_batch_prompts`` × ``group_size``: veRL's
``ppo_mini_batch_size``) the ``actor_update`` segment is one segment per mini-batch, in batch order: a chunk never
spans two mini-batches, and each mini-batch's optimizer step (its chunks' gradients accumulated, then one AdamW
step) comes between its segment and the next one's, whose chunks compute on the updated weights (veRL's
``DataParallelPPOActor.update_policy``: mini-batches split in order, micro-batches inside each, ``optimizer.step()``
per mini-batch). The forward stages are not split: veRL computes log-probs over the whole batch.
A segment is an ordered list of *units* ``(stage, sample)``. A chunk is a contiguous run of units of one
stage executed by one trainer gang of ``d`` replicas of ``rho`` devices: one micro-batch of at most
``micro_batch_per_device`` (s_max) units on every device, ``per_device`` units each; the smallest chunk is one unit
per device (§5.2). With a token budget (``max_tokens_per_micro_batch``, veRL's dynamic batch size) a chunk is
instead the samples that pack first-fit, in order, into one micro-batch of at most that many tokens on every
device (:func:`~bidirl.core.protocol.packed_chunk_len`): the chunk length depends on where it starts.

Chunk states follow Table 2: ``queued`` (sent, not started: recoverable), ``running`` (finishes),
``finished`` (merged in original order), ``cancelled`` (terminal; its units go back to the queue).
Finished chunks are merged in unit order, so where a chunk ran never changes what the update computes. The end
of a segment — TailWindow and JointTailSplit — is in :mod:`~bidirl.core.tail_split`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

from bidirl.core.aux_weights import AuxWeights
from bidirl.core.protocol import (AUXILIARY, FORWARD_STAGES, UPDATE_STAGES, Chunk, chunk_size, mini_batch_bounds,
                                  packed_chunk_len, packed_groups)
from bidirl.core.tail_split import TailSplit



class SegmentUnits(Sequence):
    """A segment's units ``(stage, sample)``, stage-major, computed from the unit index: unit ``u`` is sample
    ``u mod n`` of the segment's stage ``u div n`` (``n`` samples). Never materialised, so opening a segment
    costs O(1) however large the batch."""

    def __init__(self, stages: tuple, n_samples: int):
        self.stages, self.n_samples = stages, n_samples

    def __len__(self) -> int:
        return len(self.stages) * self.n_samples

    def __getitem__(self, u):
        if isinstance(u, slice):
            return [self[i] for i in range(*u.indices(len(self)))]
        n = len(self)
        if not -n <= u < n:
            raise IndexError(f"unit {u} out of range")
        stage, sample = divmod(u % n, self.n_samples)
        return self.stages[stage], sample


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
class TrainerStep(TailSplit, AuxWeights):
    """The chunk queue of one step. ``chunk_time(stage, prompt_lens, response_lens, d, side)`` predicts."""
    step: int
    version: int
    groups: list                 # GroupState, batch order
    stages: tuple
    micro_batch_per_device: int               # s_max, units per device (the per-device micro-batch)
    next_chunk_id: Callable[[], int]
    rho: int = 1                 # devices per trainer replica
    max_tokens_per_micro_batch: Optional[int] = None   # token-budget micro-batches (None: s_max samples)
    sequence_parallel: int = 1   # Ulysses degree k: a chunk has one micro-batch per k devices
    grid: Optional[int] = None   # reproducible mode: chunks are cells of a fixed grid, cut for a gang of this many
    #                              replicas
    mini_batch: Optional[int] = None   # samples per optimizer update (None: the whole batch is one update)
    # whether the primary gang holds the version's weights when the step starts: False for a streamed step's later
    # local updates (``rl.updates_per_sync``), which run on the weights the earlier ones left
    version_weights: bool = True
    # the auxiliary gang's weights (:mod:`bidirl.core.aux_weights`): optimizer steps of the version's earlier local
    # updates; whether it is refreshed after each optimizer step (False: it keeps the version's weights, so it runs
    # only the segments that compute on them); the weights tag it holds (None: none loaded) and a refresh under way
    updates_before: int = 0
    aux_refresh: bool = False
    aux_weights: Optional[int] = None
    aux_refreshing: bool = False
    segment_index: int = 0
    pending: list = field(default_factory=list)       # sorted unit indices not yet in a live chunk
    tail_plan: dict = field(default_factory=dict)     # side -> list of unit tuples (after JointTailSplit)
    chunks: dict = field(default_factory=dict)        # chunk_id -> ChunkRecord (this segment)
    open_chunks: dict = field(default_factory=dict)   # chunk_id -> ChunkRecord queued or running
    unmerged: dict = field(default_factory=dict)      # first unit -> finished ChunkRecord not merged yet
    merged_upto: int = 0
    merge_order: list = field(default_factory=list)   # chunk ids in merge order, all segments
    merge_positions: list = field(default_factory=list)  # (segment, first unit) of each merged chunk
    aux_update_chunks: list = field(default_factory=list)
    # auxiliary update chunks finished since the auxiliary gang last handed its window over (§5.2: it accumulates a
    # window's gradients on its own devices and sends them once, when the window ends): lost if it dies now
    aux_unsent: list = field(default_factory=list)
    # TailWindow's reclaim (:meth:`tail_reclaim`): made once per segment; the queued chunks whose cancellation is
    # awaited (nothing is pulled until each answers: cancelled, or started after all)
    tail_reclaimed: bool = False
    reclaiming: set = field(default_factory=set)
    # a mini-batch's optimizer step under way between two update segments (the next one opens when it is done)
    optimizing: bool = False

    def __post_init__(self):
        self.prompt_lens = [g.prompt_len for g in self.groups for _ in g.generated]
        self.response_lens = [int(r) for g in self.groups for r in g.generated]
        self.sample_refs = [(g.group_id, i) for g in self.groups for i in range(len(g.generated))]
        self.tokens = [p + r for p, r in zip(self.prompt_lens, self.response_lens)]
        self.segments = [tuple(s for s in seg if s in self.stages) for seg in (FORWARD_STAGES, UPDATE_STAGES)]
        self.segments = [s for s in self.segments if s]
        # each segment's samples [lo, hi): all of them, or one optimizer mini-batch of the update segment
        self.sample_ranges = [(0, self.n_samples)] * len(self.segments)
        if self.segments and self.segments[-1] == UPDATE_STAGES:
            bounds = self.mini_batch_bounds()
            if len(bounds) > 1:
                self.segments[-1:] = [UPDATE_STAGES] * len(bounds)
                self.sample_ranges[-1:] = [(lo, hi) for lo, hi in bounds]
        self._open_segment()

    def mini_batch_bounds(self) -> list:
        """The optimizer mini-batches ``[(lo, hi)]`` of the step's samples, in batch order: ``mini_batch`` samples
        each (the config makes it divide the local update), or one over the whole batch
        (:func:`~bidirl.core.protocol.mini_batch_bounds`, the planner's cut too)."""
        return mini_batch_bounds(self.n_samples, self.mini_batch)

    @property
    def update_segments(self) -> int:
        """Optimizer updates the step takes: one per update segment (its mini-batches)."""
        return sum(1 for seg in self.segments if seg == UPDATE_STAGES)

    @property
    def first_update_segment(self) -> int:
        """Index of the first update segment (the last segment if the step has none)."""
        return next((i for i, seg in enumerate(self.segments) if seg == UPDATE_STAGES), len(self.segments) - 1)

    @property
    def at_mini_batch_end(self) -> bool:
        """The current segment is an update mini-batch, finished, and another follows: its optimizer step comes
        before the next segment opens."""
        return (self.segment_done and self.segment == UPDATE_STAGES
                and self.segment_index < len(self.segments) - 1)

    @property
    def aux_last_segment(self) -> int:
        """The last segment an auxiliary gang may run (−1: none): any, when it is refreshed after each optimizer
        step (:attr:`aux_refresh`); else it holds the version's weights, which the step's first mini-batch computes
        on and later ones do not (each follows an optimizer step), nor any chunk of a streamed step's later local
        update."""
        if self.aux_refresh:
            return len(self.segments) - 1
        if not self.version_weights:
            return -1
        return self.first_update_segment if self.update_segments > 1 else len(self.segments) - 1

    def __setstate__(self, state: dict) -> None:
        """Unpickle (a checkpoint's step); one written before optimizer mini-batches existed has one update segment
        over all its samples."""
        state = {"updates_before": 0, "aux_refresh": False, "aux_weights": None, "aux_refreshing": False, **state}
        self.__dict__.update(state)
        if "sample_ranges" not in state:
            self.sample_ranges = [(0, self.n_samples)] * len(self.segments)
            self.segment_end = len(self.units)

    # ---------------------------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return len(self.sample_refs)

    @property
    def segment(self) -> tuple:
        return self.segments[self.segment_index]

    def _open_segment(self):
        self.units = SegmentUnits(self.segment, self.n_samples)
        lo, hi = self.sample_ranges[self.segment_index]
        n = self.n_samples
        if (lo, hi) == (0, n):
            self.pending = list(range(len(self.units)))
        else:                    # a mini-batch: one stage (the update), its samples' units only
            self.pending = list(range(lo, hi))
        self.segment_end = len(self.units) - (n - hi)
        self.tail_plan, self.chunks, self.open_chunks, self.unmerged, self.merged_upto = {}, {}, {}, {}, lo
        self.tail_reclaimed, self.reclaiming = False, set()

    @property
    def segment_done(self) -> bool:
        return self.merged_upto == self.segment_end

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

    def stage_of(self, u: int) -> str:
        """The stage of unit ``u`` of this segment."""
        return self.segment[u // self.n_samples]

    def _first_sample(self, units) -> Optional[int]:
        """The sample of the first unit if ``units`` are consecutive units of one stage (then their samples are
        consecutive too), else None."""
        if not units:
            return None
        first, last = units[0], units[-1]
        n = self.n_samples
        if last - first != len(units) - 1 or first // n != last // n:
            return None
        if not isinstance(units, range) and list(units) != list(range(first, last + 1)):
            return None
        return first % n

    def lens(self, units) -> tuple:
        """``(prompt_lens, response_lens)`` of the units' samples, in unit order."""
        units = units if isinstance(units, (tuple, list, range)) else list(units)
        i = self._first_sample(units)
        if i is not None:
            return self.prompt_lens[i:i + len(units)], self.response_lens[i:i + len(units)]
        n = self.n_samples
        idx = [u % n for u in units]
        return [self.prompt_lens[i] for i in idx], [self.response_lens[i] for i in idx]

    def remaining_work(self, until: Optional[int] = None) -> tuple:
        """The units not finished in this and later segments (before segment ``until`` if given) — the workload
        U — as two lists in unit order: each unit's stage and its sample (built a stage at a time: a stage's units
        are one block of the sorted list)."""
        live = [u for c in self.live() for u in c.units]
        planned = [u for plan in self.tail_plan.values() for run in plan for u in run]
        units = sorted(set(self.pending).union(live, planned))
        n, stages = self.n_samples, []
        for k, stage in enumerate(self.segment):
            stages += [stage] * (bisect.bisect_left(units, (k + 1) * n) - bisect.bisect_left(units, k * n))
        samples = [u % n for u in units]
        for seg, (lo, hi) in zip(self.segments[self.segment_index + 1:until],
                                 self.sample_ranges[self.segment_index + 1:until]):
            for stage in seg:
                stages += [stage] * (hi - lo)
                samples += range(lo, hi)
        return stages, samples

    # pulling -------------------------------------------------------------------------------------
    def _take_run(self, limit: int) -> tuple:
        """Up to ``limit`` pending units from the front, contiguous and of one stage."""
        if not self.pending:
            return ()
        first, n = self.pending[0], self.n_samples
        stage = first // n
        last = min(limit, len(self.pending)) - 1
        if self.pending[last] == first + last and (first + last) // n == stage:
            run = self.pending[: last + 1]          # consecutive units of one stage (the usual case)
            del self.pending[: last + 1]
            return tuple(run)
        run = [first]
        for u in self.pending[1:limit]:
            if u != run[-1] + 1 or u // n != stage:
                break
            run.append(u)
        del self.pending[: len(run)]
        return tuple(run)

    # the reproducible mode's grid -------------------------------------------------------------------
    def _cell_bounds(self) -> list:
        """The grid's cell boundaries within a stage, as sample indices ``0 < b₁ < … < n``: full chunks of the
        primary gang (``grid`` replicas) from the stage's first sample, so a cell's samples do not depend on which
        gang runs it or on how the step was split."""
        bounds = getattr(self, "_bounds", None)
        if bounds is None or bounds[-1] != self.n_samples:
            bounds = []
            for lo, hi in self.mini_batch_bounds():      # a cell never spans two mini-batches
                i = lo
                while i < hi:
                    i += max(1, self._chunk_len(i, self.grid, hi))
                    bounds.append(min(i, hi))
            self._bounds = bounds
        return bounds

    def cell_end(self, u: int) -> int:
        """The unit after the last of the grid cell that holds unit ``u``."""
        n = self.n_samples
        base, i = (u // n) * n, u % n
        bounds = self._cell_bounds()
        return base + bounds[bisect.bisect_right(bounds, i)]

    def is_cell_start(self, u: int) -> bool:
        bounds = self._cell_bounds()
        if getattr(self, "_bound_set", None) is None or len(self._bound_set) != len(bounds):
            self._bound_set = set(bounds)
        i = u % self.n_samples
        return i == 0 or i in self._bound_set

    def _take_back(self) -> tuple:
        """The last pending cell of the grid (its pending units, contiguous): the auxiliary side's pull in the
        reproducible mode. The primaries pull from the front and the auxiliaries from the back, as the tail split
        divides the queue, so the primary gang's chunks reach it in unit order and it adds each into its gradient
        at once; only the auxiliary chunks wait, one shard each, for their place in the sum (``ordered_sum``)."""
        last, n = self.pending[-1], self.n_samples
        bounds = [0] + self._cell_bounds()
        start = (last // n) * n + bounds[bisect.bisect_right(bounds, last % n) - 1]
        k = len(self.pending) - 1
        while k > 0 and self.pending[k - 1] == self.pending[k] - 1 and self.pending[k - 1] >= start:
            k -= 1
        run = tuple(self.pending[k:])
        del self.pending[k:]
        return run

    def _aligned(self, units: list, n_a: int) -> int:
        """The auxiliary side's share ``n_a`` of ``units`` moved to the nearest cell boundary (grid mode), so each
        side's chunks are whole cells."""
        if self.grid is None:
            return n_a
        n = len(units)
        cuts = [i for i in range(n + 1) if i in (0, n) or self.is_cell_start(units[i]) or units[i] != units[i - 1] + 1]
        best = min(cuts, key=lambda i: (abs(i - (n - n_a)), i))
        return n - best

    def pull(self, side: str, d: int, worker: str) -> Optional[ChunkRecord]:
        """LazyPull(Q, x, s_max): the next chunk for ``side`` — its tail-plan entry if one was made (on the grid in
        the reproducible mode: one cell, whichever side pulls it). None for an auxiliary gang that does not hold
        the segment's weights (:attr:`~bidirl.core.aux_weights.AuxWeights.aux_ready`)."""
        if side == AUXILIARY and self.aux_refresh and not self.aux_ready:
            return None
        plan = self.tail_plan.get(side)
        if plan:
            units = plan.pop(0)
        elif self.tail_plan:
            return None          # after the tail split each side runs only its own plan
        elif self.grid is not None and self.pending:
            units = self._take_back() if side == AUXILIARY else self._take_run(self.cell_end(self.pending[0])
                                                                               - self.pending[0])
        else:
            units = self._take_run(self.chunk_units_at(self.pending[0], d)) if self.pending else ()
        if not units:
            return None
        return self._make_chunk(units, side, d, worker)

    def chunk_units(self, d: int) -> int:
        """Units in a full chunk on a gang of ``d`` replicas: s_max on each of its ``d · rho`` devices."""
        return chunk_size(self.micro_batch_per_device, self.rho, d, self.sequence_parallel)

    def chunk_units_at(self, u: int, d: int) -> int:
        """Units in the full chunk that starts at unit ``u`` on a gang of ``d`` replicas: :meth:`chunk_units`, or
        with a token budget the samples from ``u``'s on (within its stage) that pack into one micro-batch per
        device (:func:`~bidirl.core.protocol.packed_chunk_len`)."""
        return self._chunk_len(u % self.n_samples, d, self.sample_ranges[self.segment_index][1])

    def _chunk_len(self, i: int, d: int, stop: int) -> int:
        """Samples in the full chunk that starts at sample ``i`` on ``d`` replicas, packing no sample from ``stop``
        on (the end of its mini-batch) under a token budget."""
        if self.max_tokens_per_micro_batch is None:
            return self.chunk_units(d)
        groups, budget = packed_groups(d * self.rho, self.max_tokens_per_micro_batch, self.sequence_parallel)
        return packed_chunk_len(self.tokens, i, stop, groups, budget)

    def _make_chunk(self, units: tuple, side: str, d: int, worker: str) -> ChunkRecord:
        """A chunk of ``units``: consecutive units of one stage (as :meth:`_take_run` and :meth:`split_runs` cut
        them from the sorted queue), so its samples are a slice of the step's."""
        i = self._first_sample(units)
        if i is None:
            raise AssertionError(f"chunk units {units[:3]}… are not consecutive units of one stage")
        samples = tuple(self.sample_refs[i:i + len(units)])
        per_device = -(-len(units) // (d * self.rho))
        chunk = Chunk(self.next_chunk_id(), self.step, self.stage_of(units[0]), units[0], samples, per_device)
        rec = ChunkRecord(chunk, side, units, worker=worker)
        self.chunks[chunk.chunk_id] = self.open_chunks[chunk.chunk_id] = rec
        return rec

    # chunk life cycle ----------------------------------------------------------------------------
    def started(self, chunk_id: int, t: float) -> None:
        rec = self.chunks[chunk_id]
        if rec.status == "queued":
            rec.status, rec.started = "running", t
        self.reclaiming.discard(chunk_id)        # it started before the reclaim reached it: it runs

    def cancel(self, chunk_id: int) -> bool:
        """Reclaim a queued chunk: its units return to the queue (Table 2: recoverable). A tail split made
        before is folded back too, so the returned units are planned again with the rest."""
        rec = self.chunks[chunk_id]
        self.reclaiming.discard(chunk_id)
        if rec.status != "queued":
            return False
        rec.status = "cancelled"
        del self.open_chunks[chunk_id]
        for u in rec.units:
            bisect.insort(self.pending, u)
        self.release_plan()
        return True

    def recover(self, side: str) -> None:
        """The ``side``'s gang died: every chunk sent to it, running ones too, returns its units to the queue
        (§5.3: an auxiliary gang's work is recoverable)."""
        for rec in self.live(side):
            rec.status = "queued"
            self.cancel(rec.chunk.chunk_id)
        self.release_plan()

    def lose(self, side: str) -> None:
        """The ``side``'s gang died with the gradients of this step's attempt: its chunks are cancelled and
        nothing returns to the queue (the step starts over, :meth:`Coordinator._restart_step`)."""
        for rec in self.live(side):
            rec.status = "cancelled"
            del self.open_chunks[rec.chunk.chunk_id]
            self.reclaiming.discard(rec.chunk.chunk_id)

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
        self.open_chunks.pop(chunk_id, None)
        self.unmerged[rec.units[0]] = rec
        if rec.side == AUXILIARY and rec.chunk.stage in UPDATE_STAGES:
            self.aux_update_chunks.append(chunk_id)
            self.aux_unsent.append(chunk_id)
        merged = []
        while self.merged_upto in self.unmerged:
            c = self.unmerged.pop(self.merged_upto)
            self.merged_upto = c.units[-1] + 1
            self.merge_order.append(c.chunk.chunk_id)
            self.merge_positions.append((self.segment_index, c.units[0]))
            merged.append(c.chunk.chunk_id)
        return merged

    def update_merge_order(self) -> tuple:
        """The actor-update chunks' ids in merge (original) order: the order the optimizer applies them."""
        return tuple(c for c in self.merge_order if c in self.chunks and self.chunks[c].chunk.stage in UPDATE_STAGES)

    def live(self, side: Optional[str] = None) -> list:
        """The chunks sent and not done (queued or running), of ``side`` if given, in the order they were made."""
        return [c for c in self.open_chunks.values() if side is None or c.side == side]

    def has_work(self, side: str) -> bool:
        if self.tail_plan:
            return bool(self.tail_plan.get(side))
        return bool(self.pending)
