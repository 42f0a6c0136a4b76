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
at any instant leaves each request with exactly the tokens decoded by then (a true prefix).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from bidirl.core.protocol import GroupState, GroupTask


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

    def done(self, i: int) -> bool:
        return self.generated[i] >= self.targets[i]

    def state(self) -> GroupState:
        return GroupState(self.group_id, self.prompt_len, tuple(self.generated),
                          tuple(self.done(i) for i in range(len(self.targets))), self.version)


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
    running: list = field(default_factory=list)  # (gid, idx)
    waiting: deque = field(default_factory=deque)
    epoch: int = 0
    iter_start: float = 0.0
    factor: float = 1.0
    busy_since: float = -1.0
    started_at: dict = field(default_factory=dict)
    clean: bool = True
    period: dict = field(default_factory=dict)   # (gid, i) -> [context at the period's start, tokens then, now]

    # ------------------------------------------------------------------------------------------
    def add(self, *groups: EngineGroup) -> None:
        """Queue ``groups`` now; the requests admitted in one scheduling step share one prefill wave."""
        now = self.loop.now
        self._advance(now)
        if self.busy_since < 0:
            self.busy_since, self.clean, self.period = now, True, {}
        elif now > self.busy_since:
            self.clean = False                  # joined a busy period: the period is no clean measurement
        for group in groups:
            self.groups[group.group_id] = group
            self.started_at[group.group_id] = now
            for i in range(len(group.targets)):
                if not group.done(i):
                    self.waiting.append((group.group_id, i))
                    held = group.generated[i]
                    self.period[(group.group_id, i)] = [group.prompt_len + held, held, held]
        self._reschedule(now)

    def interrupt(self, group_ids=None) -> list:
        """Stop the listed groups (all if None) now; returns their states (prefixes kept exactly)."""
        now = self.loop.now
        self._advance(now)
        ids = list(self.groups) if group_ids is None else [g for g in group_ids if g in self.groups]
        if len(ids) < len(self.groups):
            self.clean = False                  # part of the work leaves mid-period
        out = []
        for gid in ids:
            g = self.groups.pop(gid)
            self.started_at.pop(gid, None)
            self._tokens_at_end(g)
            out.append(g.state())
        drop = set(ids)
        self.running = [r for r in self.running if r[0] not in drop]
        self.waiting = deque(r for r in self.waiting if r[0] not in drop)
        self._reschedule(now)
        return out

    def _tokens_at_end(self, group: EngineGroup) -> None:
        for i, n in enumerate(group.generated):
            if (group.group_id, i) in self.period:
                self.period[(group.group_id, i)][2] = n

    @property
    def busy(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------------------------------
    def _iteration_terms(self):
        n = len(self.running)
        live = sum(self.groups[g].prompt_len + self.groups[g].generated[i] for g, i in self.running)
        c = self.costs
        return n, c.tau_dec + c.beta_tok * n + c.beta_hist * live, c.beta_hist * n

    def _cost(self, j: int, a: float, b: float) -> float:
        """Seconds for j iterations whose i-th costs a + b·i (times this epoch's jitter)."""
        return self.factor * (j * a + b * j * (j - 1) / 2)

    def _iterations_by(self, seconds: float, a: float, b: float) -> int:
        if seconds <= 0:
            return 0
        s = seconds / self.factor
        if b <= 0:
            return int(s // a)
        # largest j with b/2 j^2 + (a - b/2) j - s <= 0
        A, B = b / 2, a - b / 2
        j = int((-B + math.sqrt(B * B + 4 * A * s)) / (2 * A))
        while j > 0 and self._cost(j, a, b) > seconds + 1e-12:
            j -= 1
        while self._cost(j + 1, a, b) <= seconds + 1e-12:
            j += 1
        return j

    def _advance(self, now: float) -> None:
        if not self.running or now <= self.iter_start:
            return
        _, a, b = self._iteration_terms()
        remaining = min(self.groups[g].targets[i] - self.groups[g].generated[i] for g, i in self.running)
        j = min(self._iterations_by(now - self.iter_start, a, b), remaining)
        for g, i in self.running:
            self.groups[g].generated[i] += j
        self.iter_start = now

    def _reschedule(self, now: float) -> None:
        self.epoch += 1
        self._finish_requests()
        # admit waiting requests while the KV budget and max_seqs allow
        live = sum(self.groups[g].prompt_len + self.groups[g].generated[i] for g, i in self.running)
        admitted = []
        while self.waiting and len(self.running) < self.costs.max_seqs:
            g, i = self.waiting[0]
            need = self.groups[g].prompt_len + self.groups[g].generated[i] + 1
            if self.running and live + need > self.costs.kv_tokens:
                break
            self.waiting.popleft()
            self.running.append((g, i))
            admitted.append(self.groups[g].prompt_len + self.groups[g].generated[i])
            live += need
        self.factor = float(np.exp(self.rng.normal(0.0, self.costs.noise))) if self.costs.noise else 1.0
        start = max(now, self.iter_start)      # a prefill still in progress delays what follows it
        if admitted:
            c = self.costs
            start += self.factor * (c.tau_pre + c.alpha_pre * c.prefill_flops(np.asarray(admitted)))
        self.iter_start = start
        if not self.running:
            self._close_period(now)
            return
        _, a, b = self._iteration_terms()
        k = min(self.groups[g].targets[i] - self.groups[g].generated[i] for g, i in self.running)
        when = start + self._cost(k, a, b)
        epoch = self.epoch
        self.loop.schedule(when - now, lambda: self._on_completion(epoch), priority=2)

    def _on_completion(self, epoch: int) -> None:
        if epoch != self.epoch:
            return                       # superseded by a later change
        now = self.loop.now
        self._advance(now)
        self._reschedule(now)

    def _finish_requests(self) -> None:
        """Drop finished requests from the running set; report groups whose every response is done."""
        done_groups = []
        still = []
        for g, i in self.running:
            grp = self.groups[g]
            if grp.generated[i] < grp.targets[i]:
                still.append((g, i))
            elif g not in done_groups:
                done_groups.append(g)
        self.running = still
        now = self.loop.now
        for gid in done_groups:
            grp = self.groups[gid]
            if any(grp.generated[i] < grp.targets[i] for i in range(len(grp.targets))):
                continue
            del self.groups[gid]
            start = self.started_at.pop(gid, now)
            self._tokens_at_end(grp)
            self.on_group(self.name, grp.state(), now - start)

    def _close_period(self, now: float) -> None:
        if self.busy_since < 0 or self.groups:
            return
        if now > self.busy_since:
            self.on_span(self.name, "generate", self.busy_since, now, {})
            # a profiling record (§5.1): every request that was there from the start, with its context then and
            # the tokens it generated in the period — all of them, or until the interrupt that ended the period
            work = [(ctx, end - held) for ctx, held, end in self.period.values() if end > held]
            if self.clean and work:
                p, r = np.array(work, dtype=np.int64).T
                self.on_record(self.name, p, r, now - self.busy_since)
        self.busy_since = -1.0
