"""The end of a segment (paper §5.2, Algorithm 2): TailWindow — when the pending work fits a few rounds of chunks on
both gangs, or the queued chunks were taken back for it — and JointTailSplit, which re-chunks the remaining tail
between the primary and the auxiliary gang so that both finish together; the opportunistic ablation's one-shot
DP-proportional split (§7.3).

:class:`TailSplit` is a part of :class:`bidirl.core.chunks.TrainerStep`, split out by concern (its methods read
and write the step's queue; the fields are declared there). :class:`TailSide` times one side's chunks for k units.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Callable, Optional

from bidirl.core.gates import joint_tail_split
from bidirl.core.protocol import AUXILIARY, PRIMARY

#: a tail side whose chunks hold at most this many samples in all is timed in one vectorised pass
TAIL_VECTOR_SAMPLES = 100_000


class TailSplit:
    """TailWindow, the reclaim of queued chunks, JointTailSplit (methods of the trainer step; no state of their own)."""

    def in_tail_window(self, d_p: int, d_a: int, tail_window: int) -> bool:
        """TailWindow(Q): the pending work fits in ``tail_window`` rounds of full chunks on both sides (one
        combined primary-and-auxiliary window, as the paper fires it, when ``tail_window`` is 1), or the
        segment's queued chunks were reclaimed for the split (:meth:`tail_reclaim`)."""
        if self.tail_plan or not self.pending:
            return False
        if self.tail_reclaimed:          # the queued chunks came back for the split (:meth:`tail_reclaim`)
            return True
        u = self.pending[0]
        return len(self.pending) <= tail_window * (self.chunk_units_at(u, d_p) + self.chunk_units_at(u, d_a))

    def tail_reclaim(self, d_p: int, d_a: int, tail_window: int) -> list:
        """The queued chunks TailWindow takes back before JointTailSplit, once per segment.

        JointTailSplit "re-chunks the remaining tail work" (§5.2), and a chunk sent but not started is part of it:
        Table 2 lists ``queued`` (inputs moving or buffered, nothing run) as recoverable. Lazy pull keeps
        ``chunks_in_flight`` chunks sent to each gang (§6's pipeline), so without the reclaim a slow side can hold
        a queued full chunk the split can no longer move, and the step waits for it while the other side idles.
        When TailWindow fires (:meth:`in_tail_window`), or the pending units plus those of the queued chunks fit in
        ``tail_window`` combined rounds, the queued chunks are returned (the caller cancels them, their units come
        back through :meth:`cancel`, and the split covers them with the rest); [] otherwise.
        """
        if self.tail_reclaimed or self.tail_plan:
            return []
        queued = [c for c in self.live() if c.status == "queued"]
        if not queued:
            return []
        first = self.pending[0] if self.pending else min(c.units[0] for c in queued)
        n = len(self.pending) + sum(len(c.units) for c in queued)
        if self.grid is not None:       # the reproducible mode: either side pulls whole cells of the grid
            per_round = 2 * (self.cell_end(first) - first)
        else:
            per_round = self.chunk_units_at(first, d_p) + self.chunk_units_at(first, d_a)
        if n > tail_window * per_round and not self.in_tail_window(d_p, d_a, tail_window):
            return []
        self.tail_reclaimed = True
        self.reclaiming = {c.chunk.chunk_id for c in queued}
        return queued

    def split_runs(self, units: list, d: int) -> list:
        """Full chunks of s_max·d units plus at most one remainder per stage (never across stages)."""
        runs, cur, n, size = [], [], self.n_samples, self.chunk_units(d)
        for u in units:
            if cur and (u // n != cur[-1] // n or len(cur) == size or u != cur[-1] + 1):
                runs.append(tuple(cur))
                cur = []
            if not cur:
                size = self.cell_end(u) - u if self.grid is not None else self.chunk_units_at(u, d)
            cur.append(u)
        if cur:
            runs.append(tuple(cur))
        return runs

    def plan_tail(self, d_p: int, d_a: int, ready_p: float, ready_a: float, chunk_time: Callable,
                  span_times: Optional[Callable] = None, span_bounds: Optional[Callable] = None) -> tuple[int, float]:
        """JointTailSplit over the pending units (:func:`bidirl.core.gates.joint_tail_split`): the auxiliary
        side takes the trailing ``n_a`` units, each side runs full chunks of s_max plus at most one remainder.
        Returns (units given to the auxiliary side, predicted joint completion).

        ``chunk_time(stage, prompt_lens, response_lens, d, side)`` predicts one chunk. A side's time for k units
        is a short list of chunks (:class:`TailSide`); all k together need O(n · s_max) samples' worth of chunks.
        The optional callables take chunks as spans ``[start, stop)`` of the step's samples (a chunk is a run of
        consecutive samples of one stage), ``(stage, prompt_lens, response_lens, starts, stops, d, side)``:
        ``span_times`` predicts many at once — used to time every chunk of a side in one pass while that is
        small (:data:`TAIL_VECTOR_SAMPLES`) — and ``span_bounds`` returns lower bounds, with which the search
        skips every split that cannot beat the best so far, so only the splits it asks about are timed. Either
        way the split and completion are those of timing every chunk one by one.
        """
        units = list(self.pending)
        n = len(units)
        sides = (TailSide(self, units, d_p, PRIMARY, chunk_time, from_end=False),
                 TailSide(self, units, d_a, AUXILIARY, chunk_time, from_end=True))
        bounds, lazy = [None, None], []
        for k, side in enumerate(sides):
            if span_times is not None and side.samples() <= TAIL_VECTOR_SAMPLES:
                side.time_all(span_times)
                continue
            if span_bounds is not None:
                bounds[k] = side.bounds(span_bounds).__getitem__
            lazy.append(side)

        def prepare(splits: list) -> None:
            # the search's next candidates, timed together: the spans they need, one vectorised call per stage
            for side in lazy:
                side.time_some([n_a if side.from_end else n - n_a for n_a in splits], span_times)
        n_a, finish = joint_tail_split(n, d_p * self.rho, d_a * self.rho, ready_p, ready_a,
                                       sides[0].time, sides[1].time, *bounds,
                                       prepare=prepare if span_times is not None and lazy else None)
        if self.grid is not None:         # whole cells on each side (the reproducible mode's grid)
            n_a = self._aligned(units, n_a)
            finish = max(ready_p + sides[0].time(n - n_a), ready_a + sides[1].time(n_a))
        self.tail_plan = {PRIMARY: self.split_runs(units[: n - n_a], d_p),
                          AUXILIARY: self.split_runs(units[n - n_a:], d_a)}
        self.pending = []
        return n_a, finish

    def plan_proportional(self, d_p: int, d_a: int) -> int:
        """One-shot DP-proportional split of the pending work (the opportunistic ablation)."""
        units = list(self.pending)
        n_a = self._aligned(units, round(len(units) * d_a / (d_p + d_a)))
        n_p = len(units) - n_a
        self.tail_plan = {PRIMARY: self.split_runs(units[:n_p], d_p),
                          AUXILIARY: self.split_runs(units[n_p:], d_a)}
        self.pending = []
        return n_a


class TailSide:
    """One side of the tail split: how long it takes to run ``k`` of the pending ``units`` — the first k
    (``from_end=False``, the primaries) or the last k (the auxiliaries) — cut into chunks as
    :meth:`TailSplit.split_runs` cuts them, for any k.

    A prefix's runs are the full list's runs cut at k (the cut is greedy from the front); a suffix's runs each
    end where a run starting at that position always ends (``size`` units on, or the next stage change or gap).
    So every k is a short list of *spans* ``(first unit, units)``; a span is timed once (``chunk_time``) and
    the side's time adds its spans' times in run order, as running them one after another would.
    """

    def __init__(self, step: TailSplit, units: list, d: int, side: str, chunk_time: Callable, from_end: bool):
        self.step, self.d, self.side, self.chunk_time, self.from_end = step, d, side, chunk_time, from_end
        self.n = n = len(units)
        if from_end:
            brk = [n] * (n + 1)            # brk[i]: the first position after i where a run must start anew
            ns = step.n_samples
            for i in range(n - 2, -1, -1):
                a, b = units[i], units[i + 1]
                brk[i] = i + 1 if a // ns != b // ns or b != a + 1 else brk[i + 1]
            self.end = [min(i + step.chunk_units_at(units[i], d), brk[i]) for i in range(n)]
        else:
            self.runs = step.split_runs(units, d)
            self.run_starts = list(itertools.accumulate((len(r) for r in self.runs[:-1]), initial=0))
        self.units = units
        self._times: dict = {}
        self._run_totals = [0.0]           # a prefix side's time of its first j full runs, added in order

    def spans(self, k: int) -> list:
        """The chunks, ``(first unit, units)`` in run order, of running k units on this side."""
        if k <= 0:
            return []
        if self.from_end:
            out, i = [], self.n - k
            while i < self.n:
                out.append((self.units[i], self.end[i] - i))
                i = self.end[i]
            return out
        j = bisect.bisect_right(self.run_starts, k - 1) - 1
        return [(run[0], len(run)) for run in self.runs[:j]] + [(self.runs[j][0], k - self.run_starts[j])]

    def _span_time(self, span: tuple) -> float:
        t = self._times.get(span)
        if t is None:
            u, m = span
            t = self._times[span] = self.chunk_time(self.step.stage_of(u), *self.step.lens(range(u, u + m)),
                                                    self.d, self.side)
        return t

    def time(self, k: int) -> float:
        """The side's predicted time for k units (its spans' times added in order). A prefix side's k units are
        full runs and one cut run: the full runs' running total is kept (the same additions in the same order),
        so each k costs O(1) instead of O(runs)."""
        if k <= 0:
            return 0.0
        if self.from_end:
            total = 0.0
            for span in self.spans(k):
                total += self._span_time(span)
            return total
        j = bisect.bisect_right(self.run_starts, k - 1) - 1
        totals = self._run_totals
        while len(totals) <= j:
            run = self.runs[len(totals) - 1]
            totals.append(totals[-1] + self._span_time((run[0], len(run))))
        return totals[j] + self._span_time((self.runs[j][0], k - self.run_starts[j]))

    def distinct_spans(self) -> list:
        """Every span of every k, once, in the order the k = 0 … n first use them: a suffix side's k adds one span
        (the one starting n − k units from the end; the rest are those of a smaller k), a prefix side's k the
        first k − start units of the run that holds its last unit."""
        if self.from_end:
            return [(self.units[i], self.end[i] - i) for i in range(self.n - 1, -1, -1)]
        return [(run[0], m) for run in self.runs for m in range(1, len(run) + 1)]

    def samples(self) -> int:
        """The samples of all distinct spans: what timing every k costs."""
        return sum(m for _, m in self.distinct_spans())

    def _per_span(self, fn: Callable, spans: list) -> dict:
        """``fn`` (a ``span_times``-like callable) on ``spans``, one call per stage: span -> value."""
        by_stage: dict = {}
        segment, n = self.step.segment, self.step.n_samples
        for span in spans:
            by_stage.setdefault(segment[span[0] // n], []).append(span)
        out = {}
        for stage, group in by_stage.items():
            starts = [u % n for u, _ in group]
            stops = [i + m for i, (_, m) in zip(starts, group)]
            out.update(zip(group, fn(stage, self.step.prompt_lens, self.step.response_lens, starts, stops, self.d,
                                     self.side)))
        return out

    def time_some(self, ks: list, span_times: Callable) -> None:
        """Time the spans of these k that are not timed yet, in one vectorised call per stage."""
        todo = list(dict.fromkeys(span for k in ks for span in self.spans(k) if span not in self._times))
        if todo:
            self._times.update(self._per_span(span_times, todo))

    def time_all(self, span_times: Callable) -> None:
        """Time every distinct span now, in one vectorised call per stage (then :meth:`time` only adds)."""
        self._times.update(self._per_span(span_times, self.distinct_spans()))

    def bounds(self, span_bounds: Callable) -> list:
        """A lower bound of :meth:`time` for every k = 0 … n: the spans' lower bounds added the same way (so
        each is at most the time it bounds), all spans bounded in one call per stage; a prefix side adds its full
        runs' bounds once, as :meth:`time` does."""
        lower = self._per_span(span_bounds, self.distinct_spans())
        if not self.from_end:
            out, full = [0.0], 0.0
            for run in self.runs:
                out += [full + lower[(run[0], m)] for m in range(1, len(run) + 1)]
                full += lower[(run[0], len(run))]
            return out
        out = []
        for k in range(self.n + 1):
            total = 0.0
            for span in self.spans(k):
                total += lower[span]
            out.append(total)
        return out

