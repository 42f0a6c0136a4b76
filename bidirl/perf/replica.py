"""A rollout replica as a model: continuous batching timed as the appendix's rollout model describes.

The simulator runs one :class:`BatchingEngine` per rollout replica on its event loop; an emulated Ray worker
runs one on a loop of its own against the wall clock, so both drive the same replica model.

The replica keeps a running set (bounded by its KV-cache budget and ``max_seqs``) and a waiting queue of
requests (one request per response of a group). Each engine iteration advances every running request by
one token and costs ``τ_dec + β_tok·n + β_hist·Σ live lengths`` (the per-step form of P_dec); newly
admitted requests first pay a prefill ``τ_pre + α_pre·F_pre`` over their prompt — plus the kept prefix when
a partial-rollout group resumes, whose KV cache was dropped at the interruption.

Between two changes (an arrival, an interruption, a completion) the running set is fixed, so the engine
jumps straight to the next completion in closed form instead of stepping token by token; an interruption
at any instant leaves each request with exactly the tokens decoded by then (a true prefix). Every change
draws a fresh log-normal jitter factor for the iterations that follow it (one draw per change, from the
replica's own seeded stream).

**Incremental state.** The engine counts the decode iterations it has run (``iterations``). A running request
stores ``offset = tokens held − iterations`` when it is admitted, so its tokens held are ``offset +
iterations`` at any time and it finishes when ``iterations`` reaches ``target − offset``: the running set is a
heap on that finish count, the live length ``Σ (prompt + tokens held)`` is ``Σ (prompt + offset) + n ·
iterations``, and a change costs O(log n) per request it finishes instead of a pass over every request.

**Only group completions are events.** Most request completions change nothing outside the replica (the
group still has responses running), so they are not scheduled on the event loop. After each change the
engine plans ahead on a copy of its state (:class:`Batch`) up to its next *visible* completion — one that
finishes a whole group — and schedules a single loop event there; the request completions before it are
settled on the copy. A change that arrives earlier (``add``, ``interrupt``) cancels that event, replays the
request completions before it on the real state and plans again. At a planned completion ``on_group`` and
``on_record`` run once the engine has planned its next one, so a driver may hand what they report to the
control plane at once instead of through one more loop event. The replica's behaviour is the one of
stepping every request completion through the loop (the simulator's event logs are unchanged): the times,
token counts and jitter draws are computed by the same arithmetic in the same order.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from bidirl.core.protocol import GroupState, GroupTask

#: jitter factors drawn at a time from a replica's stream (the same values, in order, as one draw per change)
FACTOR_BLOCK = 1024
#: slack on the iteration count that fits a time span (absorbs rounding in the completion times)
ITERATION_SLACK = 1e-12


@dataclass
class EngineGroup:
    """A prompt group on an engine: each response grows until it reaches its target length."""
    group_id: int
    prompt_len: int
    targets: tuple
    generated: list
    version: int

    @classmethod
    def from_task(cls, task: GroupTask, prompt_len: int, targets: tuple, version: int) -> "EngineGroup":
        """A ``Generate`` task on an engine holding ``version``: fresh, or resumed from its prefix (a resumed
        group keeps the oldest version among its tokens)."""
        if task.resume is None:
            return cls(task.group_id, prompt_len, tuple(targets), [0] * len(targets), version)
        return cls(task.group_id, prompt_len, tuple(targets), list(task.resume.generated),
                   min(task.resume.version, version))

    def state(self) -> GroupState:
        return GroupState(self.group_id, self.prompt_len, tuple(self.generated),
                          tuple(n >= t for n, t in zip(self.generated, self.targets)), self.version)


@dataclass
class EngineCosts:
    tau_pre: float
    alpha_pre: float
    tau_dec: float
    beta_tok: float
    beta_hist: float
    prefill_flops: Callable      # prompt lengths (array) -> FLOPs of one prefill wave
    kv_tokens: int               # KV-cache capacity in tokens
    max_seqs: int = 256
    noise: float = 0.03          # σ of the per-epoch log-normal cost jitter
    gamma_req: float = 0.0       # seconds per admitted request (P_pre's γ_req, bidirl.perf.rollout)


@dataclass
class Batch:
    """What a replica's scheduling changes between two changes: the running heap, the waiting queue and the
    iteration clock (module doc). Copied when the engine plans ahead.

    ``running`` holds ``(finish, seq, group_id, i, base)``: the iteration count at which the request finishes,
    its admission order (the running set's order), and ``base = prompt + offset`` (its share of the live length
    is ``base + iterations``).
    """
    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)      # (group_id, i), in arrival order
    left: dict = field(default_factory=dict)           # group_id -> requests not finished (running or waiting)
    iterations: int = 0
    live_base: int = 0                                 # Σ base over the running requests
    admitted: int = 0                                  # admissions so far (the running order)
    iter_start: float = 0.0                            # when the current iterations started (after any prefill)
    factor: float = 1.0                                # this change's jitter factor
    draws: int = 0                                     # jitter factors used
    a: float = 0.0                                     # the i-th iteration from iter_start costs a + b·i
    b: float = 0.0                                     #   (before jitter; set at each change)
    run_cost: float = 0.0                              # seconds until the next completion's iterations are done
    next_t: Optional[float] = None                     # the next request completion (None: nothing runs)
    completions: int = 0                               # request completions settled (epochs of the replica)
    reprefills: list = field(default_factory=list)     # (start, end, tokens, requests) not yet reported

    def copy(self) -> "Batch":
        return Batch(list(self.running), deque(self.waiting), dict(self.left), self.iterations, self.live_base,
                     self.admitted, self.iter_start, self.factor, self.draws, self.a, self.b, self.run_cost,
                     self.next_t, self.completions)    # a plan reports only the waves it runs itself

    def finishing(self) -> list:
        """The running requests that finish at the next completion (those with the smallest finish count)."""
        heap, out = self.running, []
        f = heap[0][0]
        stack = [0]
        while stack:
            k = stack.pop()
            if k < len(heap) and heap[k][0] == f:
                out.append(heap[k])
                stack += (2 * k + 1, 2 * k + 2)
        return out

    def finishes_a_group(self) -> bool:
        """Whether the next completion finishes some group's last request (the engine reports it: visible)."""
        heap = self.running
        f = heap[0][0]
        if (len(heap) < 2 or heap[1][0] != f) and (len(heap) < 3 or heap[2][0] != f):
            return self.left[heap[0][2]] == 1          # one request finishes (the heap's children finish later)
        count: dict = {}
        for entry in self.finishing():
            count[entry[2]] = count.get(entry[2], 0) + 1
        return any(self.left[g] == n for g, n in count.items())


@dataclass
class BatchingEngine:
    name: str
    costs: EngineCosts
    loop: object
    rng: np.random.Generator
    on_group: Callable           # (worker, GroupState, elapsed) -> None
    on_span: Callable            # (worker, kind, start, end, detail) -> None
    on_record: Callable          # (worker, prompt_lens, response_lens, elapsed) -> None
    groups: dict = field(default_factory=dict)
    batch: Batch = field(default_factory=Batch)
    busy_since: float = -1.0
    started_at: dict = field(default_factory=dict)
    clean: bool = True
    period: dict = field(default_factory=dict)   # gid -> (prompt, {i: tokens at the period's start}, {i: now})
    _plan: Optional[Batch] = None                 # the state just before the next visible completion
    _wake: Optional[int] = None                   # the loop event of that completion
    _held: Optional[list] = None                  # callbacks held until the engine is consistent again
    _factors: list = field(default_factory=list)  # the jitter stream drawn so far

    # ------------------------------------------------------------------------------------------
    def add(self, *groups: EngineGroup) -> None:
        """Queue ``groups`` now; the requests admitted in one scheduling step share one prefill wave."""
        now = self.loop.now
        st = self._catch_up(now)
        self._advance(st, now)
        if self.busy_since < 0:
            self.busy_since, self.clean, self.period = now, True, {}
        elif now > self.busy_since:
            self.clean = False                  # joined a busy period: the period is no clean measurement
        for group in groups:
            gid, prompt = group.group_id, group.prompt_len
            self.groups[gid] = group
            self.started_at[gid] = now
            todo = [i for i, (held, target) in enumerate(zip(group.generated, group.targets)) if held < target]
            if not todo:
                continue
            st.waiting.extend((gid, i) for i in todo)
            st.left[gid] = st.left.get(gid, 0) + len(todo)
            _, start, end = self.period.setdefault(gid, (prompt, {}, {}))
            for i in todo:
                start[i] = end[i] = group.generated[i]
        self._reschedule(st, now, report=True)
        self._plan_ahead()
        self._report_reprefills()

    def _report_reprefills(self) -> None:
        """Report the re-prefill shares of the prefill waves the real state has run (``reprefill`` spans, drawn
        over the busy period's ``generate`` span): a wave planned ahead is reported once its plan is adopted."""
        st = self.batch
        if st.reprefills:
            spans, st.reprefills = st.reprefills, []
            for start, end, tokens, requests in spans:
                self._report(self.on_span, self.name, "reprefill", start, end,
                             {"tokens": tokens, "requests": requests})

    def interrupt(self, group_ids=None) -> list:
        """Stop the listed groups (all if None) now; returns their states (prefixes kept exactly)."""
        now = self.loop.now
        st = self._catch_up(now)
        self._advance(st, now)
        ids = list(self.groups) if group_ids is None else [g for g in group_ids if g in self.groups]
        if len(ids) < len(self.groups):
            self.clean = False                  # part of the work leaves mid-period
        drop = set(ids)
        running = {(e[2], e[3]): e for e in st.running if e[2] in drop}
        queued = {r for r in st.waiting if r[0] in drop}
        out = []
        for gid in ids:
            g = self.groups.pop(gid)
            self.started_at.pop(gid, None)
            st.left.pop(gid, None)
            for i in range(len(g.targets)):
                entry = running.get((gid, i))
                if entry is not None:
                    g.generated[i] = entry[4] - g.prompt_len + st.iterations
                elif g.generated[i] < g.targets[i] and (gid, i) not in queued:
                    g.generated[i] = g.targets[i]          # finished earlier
            self._tokens_at_end(g)
            out.append(g.state())
        if running:
            st.running = [e for e in st.running if e[2] not in drop]
            heapq.heapify(st.running)
            st.live_base -= sum(e[4] for e in running.values())
        st.waiting = deque(r for r in st.waiting if r[0] not in drop)
        self._reschedule(st, now, report=True)
        self._plan_ahead()
        self._report_reprefills()
        return out

    def _tokens_at_end(self, group: EngineGroup) -> None:
        """Note the tokens each of the group's requests in this busy period holds now (the period's entries are
        plain ints in dicts, which the garbage collector does not track however many requests a period has)."""
        entry = self.period.get(group.group_id)
        if entry is not None:
            generated, end = group.generated, entry[2]
            for i in entry[1]:
                end[i] = generated[i]

    @property
    def busy(self) -> bool:
        return bool(self.groups)

    @property
    def completions(self) -> int:
        """Request completions settled so far (each one a change of the running set, as a loop event would be)."""
        return self.batch.completions

    # ------------------------------------------------------------------------------------------
    # the replica model
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _cost(factor: float, j: int, a: float, b: float) -> float:
        """Seconds for j iterations whose i-th costs a + b·i (times the change's jitter factor)."""
        return factor * (j * a + b * j * (j - 1) / 2)

    def _iterations_by(self, factor: float, seconds: float, a: float, b: float) -> int:
        if seconds <= 0:
            return 0
        s = seconds / factor
        if b <= 0:
            return int(s // a)
        # largest j with b/2 j^2 + (a - b/2) j - s <= 0
        A, B = b / 2, a - b / 2
        j = int((-B + math.sqrt(B * B + 4 * A * s)) / (2 * A))
        while j > 0 and self._cost(factor, j, a, b) > seconds + ITERATION_SLACK:
            j -= 1
        while self._cost(factor, j + 1, a, b) <= seconds + ITERATION_SLACK:
            j += 1
        return j

    def _advance(self, st: Batch, now: float) -> None:
        """Run the iterations that fit between the last change and ``now`` (never past a request's target)."""
        if not st.running or now <= st.iter_start:
            return
        remaining = st.running[0][0] - st.iterations
        seconds = now - st.iter_start
        if st.b > 0 and st.run_cost <= seconds + ITERATION_SLACK:
            j = remaining              # _iterations_by would find at least this many (its cost is monotone)
        else:
            j = min(self._iterations_by(st.factor, seconds, st.a, st.b), remaining)
        st.iterations += j
        st.iter_start = now

    def _factor(self, st: Batch) -> float:
        if not self.costs.noise:
            return 1.0
        if st.draws == len(self._factors):
            self._draw_factors()
        st.draws += 1
        return self._factors[st.draws - 1]

    def _draw_factors(self) -> None:
        """The next block of the replica's jitter stream (in place: a plan and the real state share it)."""
        self._factors.extend(np.exp(self.rng.normal(0.0, self.costs.noise, size=FACTOR_BLOCK)).tolist())

    def _reschedule(self, st: Batch, now: float, report: bool) -> None:
        """A change at ``now``: finish what reached its target, admit waiting requests while the KV budget and
        ``max_seqs`` allow, draw the change's jitter and compute the next completion. ``report``: this is the
        real state (completed groups are reported); otherwise a plan, which never completes a group."""
        done = self._finish(st)
        if done:
            if not report:
                raise AssertionError(f"{self.name}: a planned completion finished groups {done}")
            for gid in done:
                grp = self.groups.pop(gid)
                start = self.started_at.pop(gid, now)
                grp.generated = [max(n, t) for n, t in zip(grp.generated, grp.targets)]
                self._tokens_at_end(grp)
                self._report(self.on_group, self.name, grp.state(), now - start)
        c = self.costs
        admitted, held = self._admit(st, c) if st.waiting else ([], [])
        st.factor = self._factor(st)
        start = max(now, st.iter_start)      # a prefill still in progress delays what follows it
        if admitted:
            contexts = np.asarray(admitted)
            wave = c.prefill_flops(contexts)
            start += st.factor * (c.tau_pre + c.alpha_pre * wave + c.gamma_req * contexts.size)
            kept = np.asarray(held)
            if kept.any():                   # the share of the wave that recomputes kept prefixes' KV cache
                again = st.factor * c.alpha_pre * (wave - c.prefill_flops(contexts - kept))
                st.reprefills.append((start - again, start, int(kept.sum()), int(np.count_nonzero(kept))))
        st.iter_start = start
        if not st.running:
            st.next_t = None
            if report:
                self._close_period(now)
            return
        n = len(st.running)
        st.a = c.tau_dec + c.beta_tok * n + c.beta_hist * (st.live_base + n * st.iterations)
        st.b = c.beta_hist * n
        st.run_cost = self._cost(st.factor, st.running[0][0] - st.iterations, st.a, st.b)
        when = start + st.run_cost
        st.next_t = now + (when - now)         # the event time a loop event scheduled now would get

    def _admit(self, st: Batch, c: EngineCosts) -> list:
        """Move waiting requests into the running set, in arrival order, while ``max_seqs`` and the KV budget
        allow (one request always fits an empty set); returns their contexts (prompt + tokens held) and the tokens
        each already held (a resumed or moved request, whose KV cache is recomputed in the prefill wave)."""
        waiting, running, groups, it = st.waiting, st.running, self.groups, st.iterations
        live = st.live_base + len(running) * it
        admitted, held = [], []
        while waiting and len(running) < c.max_seqs:
            g, i = waiting[0]
            grp = groups[g]
            context = grp.prompt_len + grp.generated[i]
            if running and live + context + 1 > c.kv_tokens:
                break
            waiting.popleft()
            base = context - it
            heapq.heappush(running, (grp.targets[i] - grp.generated[i] + it, st.admitted, g, i, base))
            st.admitted += 1
            st.live_base += base
            admitted.append(context)
            held.append(grp.generated[i])
            live += context + 1
        return admitted, held

    def _finish(self, st: Batch) -> list:
        """Drop the requests that reached their target from the running set; the groups now complete, in the
        running set's order of their first finished request."""
        heap = st.running
        if not heap or heap[0][0] > st.iterations:
            return []
        finished = [heapq.heappop(heap)]
        if not heap or heap[0][0] > st.iterations:       # one request (the common case)
            _, _, gid, _, base = finished[0]
            st.live_base -= base
            st.left[gid] -= 1
            if st.left[gid]:
                return []
            del st.left[gid]
            return [gid]
        while heap and heap[0][0] <= st.iterations:
            finished.append(heapq.heappop(heap))
        finished.sort(key=lambda e: e[1])
        touched = []
        for _, _, gid, _, base in finished:
            st.live_base -= base
            st.left[gid] -= 1
            if gid not in touched:
                touched.append(gid)
        done = [g for g in touched if st.left[g] == 0]
        for g in done:
            del st.left[g]
        return done

    def _complete(self, st: Batch, t: float, report: bool) -> None:
        """The request completion at ``t``: advance to it and reschedule (one epoch of the replica)."""
        st.completions += 1
        self._advance(st, t)
        self._reschedule(st, t, report)

    # ------------------------------------------------------------------------------------------
    # planning ahead: one loop event per visible completion
    # ------------------------------------------------------------------------------------------
    def _catch_up(self, now: float) -> Batch:
        """The real state at ``now``, before a change made now: the request completions before ``now`` settled
        (a completion at exactly ``now`` comes after the change, as a loop event of lower priority would)."""
        if self._wake is not None:
            self.loop.cancel(self._wake)
        self._plan = self._wake = None
        self._settle(self.batch, until=now, stop_at_visible=False)
        return self.batch

    def _plan_ahead(self) -> None:
        """Settle request completions on a copy until the next one that finishes a group; schedule that one."""
        if self.batch.next_t is None:
            return
        plan = self.batch.copy()
        self._settle(plan, until=math.inf, stop_at_visible=True)
        if plan.next_t is not None:
            self._plan = plan
            self._wake = self.loop.schedule_at(plan.next_t, self._on_visible, priority=2)

    def _settle(self, st: Batch, until: float, stop_at_visible: bool) -> None:
        """Settle the request completions before ``until`` (stopping before one that finishes a group if
        ``stop_at_visible``) with ``report=False``.

        The common completion — one request finishes and not its group's last, nothing waits, the iterations
        fit exactly — is written out here with the arithmetic of :meth:`_advance` and :meth:`_reschedule` (the
        same operations in the same order); any other goes through :meth:`_complete`."""
        c = self.costs
        heap, left, factors = st.running, st.left, self._factors
        while st.next_t is not None and st.next_t < until:
            t = st.next_t
            f, _, gid, _, base = heap[0]
            n = len(heap)
            if (left[gid] < 2 or st.waiting or (n > 1 and heap[1][0] == f) or (n > 2 and heap[2][0] == f)
                    or not (st.b > 0 and t > st.iter_start and st.run_cost <= t - st.iter_start + ITERATION_SLACK)):
                if stop_at_visible and st.finishes_a_group():
                    return
                self._complete(st, t, report=False)
                continue
            st.completions += 1
            st.iterations = f                       # _advance: every running request gains the k iterations
            st.iter_start = t
            heapq.heappop(heap)                     # _finish: the one request that reached its target
            st.live_base -= base
            left[gid] -= 1
            n -= 1
            if c.noise:                             # _reschedule: nothing to admit, the change's jitter
                if st.draws == len(factors):
                    self._draw_factors()
                st.factor = factors[st.draws]
                st.draws += 1
            st.a = c.tau_dec + c.beta_tok * n + c.beta_hist * (st.live_base + n * f)
            st.b = c.beta_hist * n
            k = heap[0][0] - f
            st.run_cost = st.factor * (k * st.a + st.b * k * (k - 1) / 2)
            when = t + st.run_cost
            st.next_t = t + (when - t)

    def _on_visible(self) -> None:
        """The planned completion: adopt the plan, finish the group(s), plan again; then report what happened
        (callbacks run with the engine consistent, so they may feed the control plane right away)."""
        self.batch, self._plan, self._wake = self._plan, None, None
        self._held = []
        self._complete(self.batch, self.loop.now, report=True)
        self._plan_ahead()
        self._report_reprefills()
        held, self._held = self._held, None
        for call, args in held:
            call(*args)

    def _report(self, call: Callable, *args) -> None:
        if self._held is None:
            call(*args)
        else:
            self._held.append((call, args))

    def _close_period(self, now: float) -> None:
        if self.busy_since < 0 or self.groups:
            return
        if now > self.busy_since:
            self.on_span(self.name, "generate", self.busy_since, now, {})
            # a profiling record (§5.1): every request that was there from the start, with its context then and
            # the tokens it generated in the period — all of them, or until the interrupt that ended the period
            work = [(prompt + held, end[i] - held) for prompt, start, end in self.period.values()
                    for i, held in start.items() if end[i] > held]
            if self.clean and work:
                p, r = np.array(work, dtype=np.int64).T
                self._report(self.on_record, self.name, p, r, now - self.busy_since)
        self.busy_since = -1.0
