"""How far the groups running on each rollouter have got, from the coordinator's own events (§5.1; Eq. 3's inputs).

A rollout replica advances every running request by one token per continuous-batching decode iteration (the
appendix's replica model, :class:`bidirl.perf.replica.BatchingEngine`), so what a request generated since its group
joined a worker is the number of decode iterations that worker ran since then. The coordinator sees no token counts
while a group generates; it knows when each group joined a worker's running set (the ``Generate`` it sent, one
prefill wave per command) and when it left (``GroupFinished``, ``GenerationStopped``, ``WorkerFailed``). Between two
such changes the set is fixed and each iteration costs a little more than the one before, the contexts growing by
a token each: the i-th costs ``a + b·i`` (``a`` the iteration at the contexts the interval starts with, ``b`` the
slope of the predictor's iteration time along the interval), so the iterations that fit in an interval are the
root of a quadratic. :meth:`DecodeProgress.iterations` replays a worker's changes since its running set was last
empty, interval after interval, each response leaving the load at the end :class:`ResponseEnds` gives it:
O(changes + ends), never O(iterations).

The iterations are counted over the load the worker actually had, not over its present load: a group that ran for
a minute beside forty others and now runs alone was decoded at the forty-group pace for that minute. A request
counts in its worker's load from its group's join to its group's leave; a response that finished earlier inside a
still-running group is not an event the coordinator sees; without ``lengths`` the load replayed is the heaviest
the events allow (the fewest tokens they allow, given the model), with them each response leaves it at its
expected end.

Pure state, fed by the coordinator: no clock is read (``t`` is the event's time), the same events give the same
numbers.
"""

from __future__ import annotations

import math

import numpy as np
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from bidirl.core.gates import RemainingLengths

#: iterations below which an interval's slope is not sampled along it (a shorter interval is timed at its start)
MIN_SECANT_ITERATIONS = 1.0


@dataclass(frozen=True)
class Change:
    """A change of one worker's running set at ``t``: the groups that joined it together (one ``Generate``: one
    prefill wave over their contexts), each with its prompt and the tokens each of its unfinished requests held,
    or the groups that left it."""
    t: float
    joined: tuple = ()          # ((group_id, prompt_len, (held, ...)), ...)
    left: tuple = ()            # (group_id, ...)


@dataclass
class DecodeProgress:
    """Each rollouter's changes since its running set was last empty, and the groups running there now."""
    changes: dict = field(default_factory=dict)      # worker -> [Change], oldest first
    running: dict = field(default_factory=dict)      # worker -> {group_id: None} of the groups there now

    def join(self, worker: str, t: float, groups: Sequence) -> None:
        """``groups`` (``(group_id, prompt_len, held)`` triples, ``held`` the tokens of each unfinished request)
        start on ``worker`` at ``t``, prefilling together."""
        groups = tuple((int(gid), int(prompt), tuple(int(h) for h in held)) for gid, prompt, held in groups)
        if not groups:
            return
        self.changes.setdefault(worker, []).append(Change(float(t), joined=groups))
        here = self.running.setdefault(worker, {})
        for gid, _, _ in groups:
            here[gid] = None

    def leave(self, worker: str, t: float, group_ids: Sequence) -> None:
        """``group_ids`` left ``worker`` at ``t`` (finished, stopped, or lost with it); ids not there are ignored
        (a late or duplicate report). The worker's log is dropped once nothing runs on it."""
        here = self.running.get(worker)
        if not here:
            return
        gone = tuple(g for g in (int(x) for x in group_ids) if g in here)
        if not gone:
            return
        for g in gone:
            del here[g]
        if not here:                        # an idle worker: nothing running can need its past
            del self.running[worker]
            self.changes.pop(worker, None)
            return
        self.changes[worker].append(Change(float(t), left=gone))

    def iterations(self, worker: str, now: float, iteration_time: Callable, prefill_time: Callable,
                   lengths: Optional[Callable] = None) -> dict:
        """``{group_id: decode iterations}`` the worker has run since each group now on it joined (its own
        prefill included in the wait), replaying the worker's changes up to ``now``.

        ``iteration_time(contexts)`` is one decode iteration over requests with these contexts and
        ``prefill_time(contexts)`` one prefill wave over them (the coordinator's predictor, scaled as the gate
        scales it). A join waits for its wave after any wave still running, and no request decodes meanwhile (the
        engine's scheduling step: :meth:`bidirl.perf.replica.BatchingEngine._reschedule`). ``lengths(held)``, if
        given, is the length each of a group's unfinished responses is taken to end at (``inf``: not before its
        group leaves): a request leaves the replayed load there instead of only with its group."""
        done = 0.0                          # decode iterations the worker ran since its log starts
        start = -math.inf                   # when its current iterations began (after the last prefill wave)
        live: dict = {}                     # group_id -> [(context − done at join, ``done`` when it ends)]
        since: dict = {}                    # group_id -> ``done`` when it joined
        for ch in self.changes.get(worker, ()):
            if ch.t > now:
                break
            done, start = _advance(live, done, start, ch.t, iteration_time)
            for gid in ch.left:
                live.pop(gid, None)
                since.pop(gid, None)
            if ch.joined:
                wave = [prompt + h for _, prompt, held in ch.joined for h in held]
                start = max(ch.t, start) + (prefill_time(wave) if wave else 0.0)
                for gid, prompt, held in ch.joined:
                    ends = lengths(held) if lengths is not None and held else (math.inf,) * len(held)
                    live[gid] = [(prompt + h - done, done + (e - h)) for h, e in zip(held, ends)]
                    since[gid] = done
        done, _ = _advance(live, done, start, now, iteration_time)
        return {gid: done - since[gid] for gid in self.running.get(worker, ()) if gid in since}


def _advance(live: dict, done: float, start: float, t: float, iteration_time: Callable) -> tuple:
    """The iterations that fit between ``start`` and ``t`` over the requests in ``live`` (their contexts are
    ``base + done``; each leaves the load once ``done`` reaches its end): ``(done, start)`` after them. Between two
    requests' ends the load is fixed; O(ends) per call."""
    while True:
        reqs = [r for group in live.values() for r in group if r[1] > done]
        if not reqs or t <= start:
            return done, max(start, t)      # nothing decodes, or a prefill wave still runs
        seconds = t - start
        at = [base + done for base, _ in reqs]
        a = iteration_time(at)
        if not a > 0:
            return done, t
        gap = min(end for _, end in reqs) - done        # iterations until the next request ends
        k = seconds / a                      # an upper bound: no later iteration is cheaper than the first
        b = 0.0
        span = min(k, gap)
        if span >= MIN_SECANT_ITERATIONS:
            # the slope along the interval (a secant over at most the iterations that fit: it averages any step in
            # the model's waves), then the count whose summed costs a·k + b·k(k−1)/2 fill the interval
            b = max(0.0, (iteration_time([c + span for c in at]) - a) / span)
            k = _iterations_in(seconds, a, b)
        if k < gap:
            return done + k, t
        start += a * gap + b * gap * (gap - 1) / 2          # the next end comes first: its iterations' time
        done += gap


def _iterations_in(seconds: float, a: float, b: float) -> float:
    """The k ≥ 0 with ``a·k + b·k(k−1)/2 = seconds``: iterations whose i-th costs ``a + b·i`` (i from 0)."""
    if b <= 0:
        return seconds / a
    half = a - b / 2
    return (-half + math.sqrt(half * half + 2 * b * seconds)) / b


@dataclass(frozen=True)
class ResponseEnds:
    """Where a group's unfinished responses are taken to end, from the same samples as the gate's remaining
    lengths (:class:`bidirl.core.gates.RemainingLengths`): the recent sample's lengths above a response's tokens,
    the prior's where none of the recent ones is, none (``inf``: it ends with its group) past both.

    The ``m`` unfinished responses of a group are dealt the conditional distribution's ``(j + ½)/m`` quantiles,
    the one holding the fewest tokens the lowest (ties in id order): ``m`` responses drawn from a distribution
    leave ``m·P(R > x)`` of them running at ``x`` in expectation, and these deterministic ends leave the nearest
    whole count (the midpoint rule on the survival function), so the replayed load thins as the expected one
    does and the same events always give the same ends."""
    recent: np.ndarray
    prior: np.ndarray

    def __init__(self, sample, prior=None):
        object.__setattr__(self, "recent", np.sort(np.asarray(sample, dtype=float).reshape(-1)))
        object.__setattr__(self, "prior", np.sort(np.asarray(prior if prior is not None else (), dtype=float)
                                                  .reshape(-1)))

    def __call__(self, held) -> tuple:
        g = [float(h) for h in held]
        m = len(g)
        if not m:
            return ()
        # the sample each response draws from and its first length above the response's tokens: the gate's own
        # choice (recent, else prior, else none); with no recent sample the prior is the one drawn from
        lengths = RemainingLengths.of(g, [False] * m, self.recent if self.recent.size else self.prior, self.prior)
        order = sorted(range(m), key=lambda i: (g[i], i))
        out = [math.inf] * m
        for rank, i in enumerate(order):
            if lengths.source[i] in (0, 1):
                sample, k = lengths.samples[lengths.source[i]], int(lengths.first[i])
                above = sample.size - k
                out[i] = float(sample[k + min(above - 1, int((rank + 0.5) / m * above))])
        return tuple(out)
