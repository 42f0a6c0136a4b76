"""The simulation driver: executes the control plane's commands on a virtual clock.

Rollout replicas are :class:`~bidirl.perf.replica.BatchingEngine` instances (continuous batching, KV-limited);
trainer chunks take the predictor's time; syncs and gradient merges take the configured costs; a switch takes
its direction's steady cost plus, the first time, what is left of the pinned allocation of the trainer engine that
yields its pool after the engine reserved it in the background since the run's start
(:class:`bidirl.perf.costs.SwitchTimes`, the driver's ``switch_times``: the truth, whatever the coordinator's profiler
charges); every duration
carries seeded log-normal jitter. Workload lengths come from
:class:`~bidirl.perf.workload.GroupLengths`, drawn per group id, so every policy sees the same prompts and
the same response lengths for the same seed.

The coordinator's events are delivered through the event loop (never re-entrantly), so one seed gives one
event order and one event log.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from bidirl.core import protocol as P
from bidirl.perf.replica import BatchingEngine, EngineGroup
from bidirl.perf.workload import GroupLengths
from bidirl.results.run_result import RunResult
from bidirl.runtime.driver import Driver, progress_bar
from bidirl.runtime.loop import EventLoop

#: seconds to move a chunk's inputs to a worker (Table 2's "queued" phase, when a chunk can still be cancelled)
CHUNK_TRANSFER = 0.005


@dataclass
class SimDriver(Driver):
    loop: Optional[EventLoop] = None
    jitter: float = 0.03            # σ of the seeded log-normal noise on every duration (0: the models exactly)

    provenance = "simulated"
    refreshes_aux_weights = True     # an auxiliary gang's refresh is charged its transfer (do_RefreshWeights)

    def __post_init__(self):
        super().__post_init__()
        self.loop = self.loop or EventLoop()
        self.rng = np.random.default_rng([self.seed, 1])
        self.lengths = GroupLengths.of(self.config, self.seed)
        if not (self.jitter >= 0 and math.isfinite(self.jitter)):
            raise ValueError(f"SimDriver.jitter must be a finite σ ≥ 0, got {self.jitter!r}")
        engine_costs = dataclasses.replace(self.truth.engine_costs(), noise=self.jitter)
        self.engines = {}
        for name in self.topology.rollouters + self.topology.aux_rollouters:
            self.engines[name] = BatchingEngine(name, engine_costs, self.loop,
                                                np.random.default_rng([self.seed, 3, len(self.engines)]),
                                                self._group_done, self._generate_span, self._record)
        self.chunk_jobs: dict = {}             # chunk_id -> {"cmd", "arrives", "started", "cancelled"}
        self.gang_queue: dict = {}             # gang -> jobs sent to it and not started, in order
        self.gang_busy: set = set()            # gangs running a chunk
        self.sync_time = self.config.weight_sync_time(rollout_layout=self.plan.envelope.rollout_layout)
        self.optimizer_times = {final: self.assembly.optimizer_step_time(final) for final in (True, False)}
        self._started = False
        self._feeding = 0                      # feeds under way (an engine report inside one goes through the loop)

    # ------------------------------------------------------------------------------------------
    def _jitter(self, seconds: float) -> float:
        if seconds <= 0:
            return 0.0
        return float(seconds * math.exp(self.rng.normal(0.0, self.jitter))) if self.jitter else float(seconds)

    def _emit(self, event) -> None:
        """Deliver an event to the coordinator through the loop (priority 0: before engine steps)."""
        self.loop.schedule(0.0, lambda: self.feed(event), priority=0)

    def _deliver(self, event) -> None:
        """An engine's report: fed now when it comes from the engine's own loop event (the engine is consistent
        and nothing else can run at this instant before the events it would emit), through the loop when it
        comes from a command the coordinator is issuing (never feed it re-entrantly)."""
        if self._feeding:
            self._emit(event)
        else:
            self.feed(event)

    def feed(self, event) -> None:
        self._feeding += 1
        try:
            super().feed(event)
        finally:
            self._feeding -= 1

    def _after(self, seconds: float, done) -> None:
        """Run ``done(t0)`` ``seconds`` from now (``t0``: now), ahead of engine steps at the same instant."""
        t0 = self.loop.now
        self.loop.schedule(seconds, lambda: done(t0), priority=0)

    # engine callbacks ----------------------------------------------------------------------------
    def _group_done(self, worker, state, _elapsed):
        self._deliver(P.GroupFinished(self.loop.now, worker, state))

    def _generate_span(self, worker, kind, start, end, detail):
        self.span(worker, kind, start, end, detail)

    def _record(self, worker, prompt_lens, response_lens, elapsed):
        self._deliver(P.RolloutRecord(self.loop.now, worker, tuple(np.asarray(prompt_lens, np.int64).tolist()),
                                      tuple(np.asarray(response_lens, np.int64).tolist()), elapsed))

    # command handlers ------------------------------------------------------------------------------
    def do_Generate(self, cmd: P.Generate):
        self.engines[cmd.worker].add(*(EngineGroup.from_task(t, *self.lengths(t.group_id), cmd.version)
                                       for t in cmd.tasks))

    def do_Interrupt(self, cmd: P.Interrupt):
        states = self.engines[cmd.worker].interrupt(cmd.group_ids)
        self._emit(P.GenerationStopped(self.loop.now, cmd.worker, tuple(states)))

    def do_RunChunk(self, cmd: P.RunChunk):
        """The chunk's inputs move to the gang (``CHUNK_TRANSFER``, Table 2's queued phase, overlapping whatever the
        gang runs); it starts once they arrived and the gang is free: a gang runs its chunks one at a time.

        Only an arrival that can start the chunk is a loop event: a chunk sent to a gang that is busy, or that has
        chunks queued ahead of it, is started by the finish before it (its inputs arrived by then) or by a wake at
        its arrival (they had not)."""
        job = {"cmd": cmd, "arrives": self.loop.now + CHUNK_TRANSFER, "started": False, "cancelled": False}
        self.chunk_jobs[cmd.chunk.chunk_id] = job
        queue = self.gang_queue.setdefault(cmd.worker, [])
        queue.append(job)
        if cmd.worker not in self.gang_busy and len(queue) == 1:
            self._after(CHUNK_TRANSFER, lambda _t0: self._next_chunk(cmd.worker))

    def _next_chunk(self, gang: str) -> None:
        queue = self.gang_queue.get(gang)
        if gang in self.gang_busy or not queue:
            return
        if queue[0]["arrives"] > self.loop.now:        # a free gang waits for the inputs of its next chunk
            self.loop.schedule_at(queue[0]["arrives"], lambda: self._next_chunk(gang), priority=0)
            return
        job = queue.pop(0)
        job["started"] = True
        cmd = job["cmd"]
        ch = cmd.chunk
        self.gang_busy.add(gang)
        # the trainer sees the lengths generated, which equal the drawn targets once a group completed
        p, r = self.lengths.sample_lengths(ch.samples)
        duration = self._jitter(self.truth.chunk_time(ch.stage, p, r, self.topology.gang_size(gang)))
        self.feed(P.ChunkStarted(self.loop.now, gang, ch.chunk_id))

        def finish(t0):
            self.gang_busy.discard(gang)
            self.record_chunk(cmd, t0, self.loop.now)
            self.feed(P.ChunkFinished(self.loop.now, gang, ch.chunk_id, self.loop.now - t0))
            self._next_chunk(gang)
        self._after(duration, finish)

    def do_CancelChunk(self, cmd: P.CancelChunk):
        job = self.chunk_jobs.get(cmd.chunk_id)
        if job is not None and not job["started"] and not job["cancelled"]:
            job["cancelled"] = True
            self.gang_queue[cmd.worker].remove(job)
            self._emit(P.ChunkCancelled(self.loop.now, cmd.worker, cmd.chunk_id))

    def do_Switch(self, cmd: P.Switch):
        """The switch takes what :attr:`switch_times` says (steady cost, plus what is left at its start of the first
        switch's pinned allocation, which :meth:`record_switch` marks), not what the coordinator expects."""
        steady, alloc = self.switch_times.take(cmd.direction, cmd.phase, self.loop.now)

        def done(t0):
            self.record_switch(cmd, t0, self.loop.now, alloc)
            self.feed(P.SwitchFinished(self.loop.now, cmd.pool, cmd.to_role, self.loop.now - t0))
        self._after(self._jitter(steady) + alloc, done)

    def do_SyncWeights(self, cmd: P.SyncWeights):
        def done(t0):
            self.record_sync(cmd, t0, self.loop.now)
            self.feed(P.SyncFinished(self.loop.now, cmd.version, cmd.targets, self.loop.now - t0))
        self._after(self._jitter(self.sync_time), done)

    def do_MergeGradients(self, cmd: P.MergeGradients):
        def done(t0):
            self.record_merge(cmd, t0, self.loop.now)
            self.feed(P.GradientsMerged(self.loop.now, cmd.step, self.loop.now - t0))
        self._after(self._jitter(cmd.expected), done)

    def do_OptimizerStep(self, cmd: P.OptimizerStep):
        """One optimizer update per command (:meth:`~bidirl.runtime.assemble.Assembly.optimizer_step_time`: a
        mini-batch's, or the local update's ``final`` one with its once-per-update costs)."""
        def done(t0):
            self.record_optimizer(cmd, t0, self.loop.now)
            self.feed(P.OptimizerStepped(self.loop.now, cmd.step, cmd.version))
        self._after(self._jitter(self.optimizer_times[cmd.final]), done)

    def do_RefreshWeights(self, cmd: P.RefreshWeights):
        """The auxiliary gang receives the primaries' current weights: the transfer the scheduler charged
        (:func:`bidirl.perf.costs.aux_weight_transfer_time`, what the switch in's weight transfer takes too)."""
        def done(t0):
            self.record_refresh(cmd, t0, self.loop.now)
            self.feed(P.WeightsRefreshed(self.loop.now, cmd.worker, cmd.step, cmd.version, cmd.updates,
                                         self.loop.now - t0))
        self._after(self._jitter(cmd.expected), done)

    # ------------------------------------------------------------------------------------------
    # running: all at once, or in slices (live views)
    # ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin the run; then call :meth:`advance` repeatedly (a notebook can draw between calls)."""
        if not self._started:
            self._started = True
            self._emit(P.Started(0.0))

    @property
    def done(self) -> bool:
        return (self.finished and not any(e.busy for e in self.engines.values())) or self.loop.empty

    @property
    def now(self) -> float:
        return self.loop.now

    def advance(self, seconds: float = math.inf, max_events: int = 10**9) -> int:
        """Process events up to ``seconds`` of simulated time from now (or ``max_events``); returns steps done."""
        self.start()
        until = self.loop.now + seconds
        n = 0
        while not self.done and self.loop.peek() <= until and n < max_events:
            self.loop.step()
            n += 1
        if not self.done and n < max_events:
            self.loop.run(until=until)       # nothing left before ``until``: the clock moves there
        return self.steps_done

    def run(self, progress: bool = False) -> RunResult:
        self.start()
        with progress_bar(self.steps, f"simulate {self.policy_name}", progress) as tick:
            while not self.done:
                self.loop.step()
                tick(self.steps_done)
        return self.result()

    def result(self, **extra) -> RunResult:
        return super().result(events_processed=self.loop.processed, **extra)


def advance_together(drivers: dict, slice_seconds: float):
    """Advance several simulations in lockstep, ``slice_seconds`` of simulated time at a time.

    Returns a generator: after each slice it yields the total number of steps done, so a caller (a live view)
    can draw between slices; it ends once every driver is done. ``drivers`` maps labels to :class:`SimDriver`;
    bad input is refused here, before anything runs.
    """
    if not slice_seconds > 0:
        raise ValueError(f"slice_seconds must be > 0 (simulated seconds per slice), got {slice_seconds}")
    for label, d in drivers.items():
        if not isinstance(d, SimDriver):
            raise ValueError(f"drivers[{label!r}] is a {type(d).__name__}; pass a bidirl.sim.SimDriver")

    def slices():
        for d in drivers.values():
            d.start()              # an unstarted driver has an empty event heap and reads as done
        while not all(d.done for d in drivers.values()):
            for d in drivers.values():
                if not d.done:
                    d.advance(slice_seconds)
            yield sum(d.steps_done for d in drivers.values())
    return slices()
