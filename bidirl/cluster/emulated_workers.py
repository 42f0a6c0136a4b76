"""The emulated workers' actors: rollout replicas on a host process, and trainer gangs, timed by the stage-time models.

Each actor owns the state a real worker would (a rollout engine's running requests, a trainer gang's chunk), but
where a real worker would compute it sleeps for the model's duration divided by the time scale (virtual seconds
per wall second); :class:`~bidirl.cluster.emulated.EmulatedDriver` places and drives them.

This module is what each actor's process imports, so it imports only what the actors use (numpy, the replica
model, the event loop): not the driver's side (``bidirl.cluster.pool`` and its pandas), which would add ≈ 0.5 s of
CPU to every emulated worker's start (a run of the 16-GPU ``a6000-default`` job starts eighteen).
"""

from __future__ import annotations

import time

import numpy as np

from bidirl.perf.replica import BatchingEngine
from bidirl.runtime.loop import EventLoop


class VirtualClock:
    """Virtual seconds since ``t0`` (a shared wall-clock origin) at ``scale`` virtual s per wall s."""

    def __init__(self, t0: float, scale: float):
        self.t0, self.scale = t0, scale

    def now(self) -> float:
        return (time.time() - self.t0) * self.scale

    def sleep_virtual(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.scale)


class RolloutHost:
    """Rollout replicas emulated in one process (one Ray actor): the replica model of each, on one event loop in
    virtual time advanced to the wall clock.

    One process per replica does not scale: a Ray worker process costs ~70 MB and a second of start-up, so 256
    virtual GPUs would need 256 processes. A host runs ``names`` replicas, and one ``advance`` call reports every
    completion on all of them, so the driver's round trips grow with hosts, not replicas. Timed state operations
    on a replica (a weight load, an offload or onload in a switch) are events on the same loop
    (:meth:`hold`): they run side by side with the other replicas' generation, as on separate GPUs, and are
    reported by ``advance`` when they end.

    The methods are ``async`` so that Ray runs the actor as an async actor: a ``start``, ``interrupt`` or ``hold``
    arriving while ``advance`` waits for the next completion wakes it at once, rather than queueing behind it.
    """

    def __init__(self, names, engine_costs, t0: float, scale: float, seeds):
        self.clock = VirtualClock(t0, scale)
        self.loop = EventLoop()
        self.engines, self.finished, self.spans = {}, {}, {}
        self.holds_done: list = []
        self._wake = None
        for name, seed in zip(names, seeds):
            self.finished[name], self.spans[name] = [], []
            self.engines[name] = BatchingEngine(
                name, engine_costs, self.loop, np.random.default_rng(seed),
                on_group=lambda w, st, el, name=name: self.finished[name].append((self.loop.now, st)),
                on_span=lambda w, kind, a, b, det, name=name: self.spans[name].append((kind, a, b, det)),
                on_record=lambda *a: None)

    def _catch_up(self) -> None:
        self.loop.run(until=self.clock.now())

    def _wake_advance(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _report(self, names=None, **extra) -> dict:
        replicas = {}
        for name in (self.engines if names is None else names):
            finished, self.finished[name] = self.finished[name], []
            spans, self.spans[name] = self.spans[name], []
            replicas[name] = {"finished": finished, "spans": spans, "busy": self.engines[name].busy}
        holds, self.holds_done = self.holds_done, []
        return {"replicas": replicas, "holds": holds, "t": self.loop.now, **extra}

    async def start(self, name: str, groups: list) -> int:
        """Add :class:`~bidirl.perf.replica.EngineGroup` s to replica ``name`` now."""
        self._catch_up()
        self.engines[name].add(*groups)
        self._wake_advance()
        return len(groups)

    async def interrupt(self, name: str, group_ids) -> dict:
        """Stop groups on replica ``name`` now: the replica's report, with ``stopped`` (their states)."""
        self._catch_up()
        stopped = self.engines[name].interrupt(group_ids)
        self._wake_advance()
        return {**self._report([name])["replicas"][name], "t": self.loop.now, "stopped": stopped}

    async def hold(self, token, seconds: float) -> float:
        """Start a timed operation of ``seconds`` (virtual) now; ``advance`` reports ``(token, start, end)`` when
        it ends. Returns its start."""
        self._catch_up()
        start = self.loop.now
        self.loop.schedule(max(0.0, seconds), lambda: self.holds_done.append((token, start, self.loop.now)))
        self._wake_advance()
        return start

    async def advance(self, max_wall: float) -> dict:
        """Wait until the next completion or hold end (at most ``max_wall`` wall seconds, or until a call
        arrives), then report what finished on every replica."""
        import asyncio
        self._catch_up()
        if not self._has_news():
            target = min(self.loop.peek(), self.loop.now + max_wall * self.clock.scale)
            wait = max(0.0, (target - self.clock.now()) / self.clock.scale)
            self._wake = asyncio.Event()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass
            finally:
                self._wake = None
            self._catch_up()
        return self._report()

    def _has_news(self) -> bool:
        return bool(self.holds_done) or any(self.finished.values())

    async def set_clock(self, t0: float) -> None:
        self.clock.t0 = t0


class EmulatedTrainer:
    """A trainer gang emulated by sleeping for the trainer model's chunk time."""

    def __init__(self, name: str, t0: float, scale: float):
        self.name, self.clock = name, VirtualClock(t0, scale)

    def run_chunk(self, chunk_id: int, seconds: float) -> dict:
        start = self.clock.now()
        self.clock.sleep_virtual(seconds)
        return {"chunk_id": chunk_id, "start": start, "end": self.clock.now()}

    def hold(self, seconds: float) -> float:
        t0 = self.clock.now()
        self.clock.sleep_virtual(seconds)
        return self.clock.now() - t0

    def set_clock(self, t0: float) -> None:
        self.clock.t0 = t0
