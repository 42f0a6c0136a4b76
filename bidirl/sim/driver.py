"""The simulation driver: executes the control plane's commands on a virtual clock.

Rollout replicas are :class:`~bidirl.sim.engine.EngineSim` instances (continuous batching, KV-limited);
trainer chunks take the trainer model's time; switches, syncs and gradient merges take the configured
costs; every duration carries seeded log-normal jitter. Workload lengths come from
:func:`bidirl.perf.workload.sample_lengths`, drawn per group id, so every policy sees the same prompts
and the same response lengths for the same seed.

The coordinator's events are delivered through the event loop (never re-entrantly), so one seed gives one
event order and one event log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bidirl import config as cfgmod
from bidirl.core import protocol as P
from bidirl.core.coordinator import Coordinator
from bidirl.sim.engine import EngineSim, SimGroup
from bidirl.trace import EventLog, Span

CHUNK_TRANSFER = 0.005     # seconds to move a chunk's inputs to a worker (the Table 2 "queued" phase)


@dataclass
class SimResult:
    """What one simulation produced: the event log, the coordinator's final state and the summary."""
    policy: str
    config: cfgmod.JobConfig
    log: EventLog
    summary_dict: dict
    events_processed: int
    coordinator: Optional[Coordinator] = None

    def summary(self) -> dict:
        return dict(self.summary_dict)

    @property
    def events(self):
        return self.log.spans_df()


@dataclass
class SimDriver:
    config: cfgmod.JobConfig
    policy_name: str
    seed: int
    steps: int
    loop: object = None
    log: EventLog = field(default_factory=EventLog)

    def __post_init__(self):
        from bidirl import control
        from bidirl.sim.loop import EventLoop

        self.loop = self.loop or EventLoop()
        self.control = cp = control.build(self.config, self.policy_name, steps=self.steps, seed=self.seed)
        self.plan, self.topology, self.models, self.coordinator = cp.plan, cp.topology, cp.models, cp.coordinator
        self.rng = np.random.default_rng([self.seed, 1])
        self._length_cache = {}
        self.engines = {}
        engine_costs = self.models.engine_costs()
        for w_name in self.topology.rollouters + self.topology.aux_rollouters:
            self.engines[w_name] = EngineSim(w_name, engine_costs, self.loop,
                                             np.random.default_rng([self.seed, 3, len(self.engines)]),
                                             self._group_done, self._span, self._record)
        self.chunk_jobs = {}                   # chunk_id -> {"worker", "started", "cancelled"}
        self.sync_time = self.config.weight_sync_time()
        self.optimizer_time = cp.optimizer_time()

    # ------------------------------------------------------------------------------------------
    def _jitter(self, seconds: float, sigma: float = 0.03) -> float:
        return float(seconds * math.exp(self.rng.normal(0.0, sigma))) if seconds > 0 else 0.0

    def _lengths(self, gid: int):
        if gid not in self._length_cache:
            from bidirl.control import group_lengths
            self._length_cache[gid] = group_lengths(self.config, self.seed, gid)
        return self._length_cache[gid]

    def _role(self, worker: str) -> str:
        return "primary" if P.is_primary(worker) else "auxiliary"

    def _span(self, worker, kind, start, end, detail, step=None, version=None):
        c = self.coordinator
        self.log.add_span(Span(worker=worker, pool=P.worker_pool(worker), role=self._role(worker), kind=kind,
                               start=float(start), end=float(end),
                               step=len(c.steps) if step is None else step,
                               version=c.trainer_version if version is None else version, detail=detail))

    def _emit(self, event) -> None:
        """Deliver an event to the coordinator through the loop (priority 0: before engine steps)."""
        self.loop.schedule(0.0, lambda: self._execute(self.coordinator.handle(event)), priority=0)

    def _emit_at(self, delay: float, make_event) -> None:
        self.loop.schedule(delay, lambda: self._execute(self.coordinator.handle(make_event())), priority=0)

    # engine callbacks ----------------------------------------------------------------------------
    def _group_done(self, worker, state, elapsed):
        self._emit(P.GroupFinished(self.loop.now, worker, state, elapsed))

    def _record(self, worker, prompt_lens, response_lens, elapsed):
        self._emit(P.RolloutRecord(self.loop.now, {"worker": worker, "prompt_lens": prompt_lens,
                                                  "response_lens": response_lens, "elapsed": elapsed}))

    # command execution ------------------------------------------------------------------------------
    def _execute(self, commands) -> None:
        for cmd in commands:
            getattr(self, "_do_" + type(cmd).__name__)(cmd)

    def _do_Generate(self, cmd: P.Generate):
        eng = self.engines[cmd.worker]
        for task in cmd.tasks:
            prompt, targets = self._lengths(task.group_id)
            if task.resume is not None:
                gen = list(task.resume.generated)
                version = min(task.resume.version, cmd.version)
            else:
                gen, version = [0] * len(targets), cmd.version
            eng.add(SimGroup(task.group_id, prompt, targets, gen, version))

    def _do_Interrupt(self, cmd: P.Interrupt):
        states = self.engines[cmd.worker].interrupt(cmd.group_ids)
        self._emit(P.GenerationStopped(self.loop.now, cmd.worker, tuple(states)))

    def _gang(self, worker: str) -> int:
        return self.topology.trainer_replicas if P.is_primary(worker) else self.topology.aux_trainer_replicas

    def _do_RunChunk(self, cmd: P.RunChunk):
        ch = cmd.chunk
        # the trainer sees the lengths generated, which equal the drawn targets once a group completed
        lengths = [self._lengths(g) for g, _ in ch.samples]
        p = [pl for pl, _ in lengths]
        r = [targets[i] for (_, targets), (_, i) in zip(lengths, ch.samples)]
        d = self._gang(cmd.worker)
        duration = self._jitter(self.models.chunk_time(ch.stage, p, r, d))
        job = {"worker": cmd.worker, "started": False, "cancelled": False}
        self.chunk_jobs[ch.chunk_id] = job

        def start():
            if job["cancelled"]:
                return
            job["started"] = True
            t0 = self.loop.now
            self._execute(self.coordinator.handle(P.ChunkStarted(t0, cmd.worker, ch.chunk_id)))

            def finish():
                self._span(cmd.worker, "chunk", t0, self.loop.now,
                           {"stage": ch.stage, "chunk_id": ch.chunk_id, "samples": len(ch.samples)},
                           step=ch.step)
                self._execute(self.coordinator.handle(
                    P.ChunkFinished(self.loop.now, cmd.worker, ch.chunk_id, self.loop.now - t0)))
            self.loop.schedule(duration, finish, priority=0)
        self.loop.schedule(CHUNK_TRANSFER, start, priority=0)

    def _do_CancelChunk(self, cmd: P.CancelChunk):
        job = self.chunk_jobs.get(cmd.chunk_id)
        if job is not None and not job["started"]:
            job["cancelled"] = True
            self._emit(P.ChunkCancelled(self.loop.now, cmd.worker, cmd.chunk_id))

    def _pool_lane(self, pool: str, to_role: str) -> str:
        """The lane a switch is drawn on: the gang or first replica of the role taking the pool."""
        if to_role == "trainer":
            return P.TRAINER_POOL + "/trainer" if pool == P.TRAINER_POOL else P.ROLLOUT_POOL + "/trainer"
        return (self.topology.rollouters if pool == P.ROLLOUT_POOL else self.topology.aux_rollouters)[0]

    def _do_Switch(self, cmd: P.Switch):
        duration = self._jitter(cmd.expected)
        t0 = self.loop.now
        lane = self._pool_lane(cmd.pool, cmd.to_role)

        def done():
            self._span(lane, "switch_in" if cmd.phase == "in" else "switch_out", t0, self.loop.now,
                       {"direction": cmd.direction})
            self._execute(self.coordinator.handle(P.SwitchFinished(self.loop.now, cmd.pool, cmd.to_role,
                                                                   self.loop.now - t0)))
        self.loop.schedule(duration, done, priority=0)

    def _do_SyncWeights(self, cmd: P.SyncWeights):
        duration = self._jitter(self.sync_time)
        t0 = self.loop.now

        def done():
            for w in cmd.targets:
                self._span(w, "sync", t0, self.loop.now, {"version": cmd.version})
            self._span(P.TRAINER_POOL + "/trainer", "sync", t0, self.loop.now, {"version": cmd.version})
            self._execute(self.coordinator.handle(P.SyncFinished(self.loop.now, cmd.version, cmd.targets,
                                                                 self.loop.now - t0)))
        self.loop.schedule(duration, done, priority=0)

    def _do_MergeGradients(self, cmd: P.MergeGradients):
        duration = self._jitter(cmd.expected)
        t0 = self.loop.now

        def done():
            self._span(P.TRAINER_POOL + "/trainer", "grad_merge", t0, self.loop.now,
                       {"chunks": len(cmd.chunk_ids)}, step=cmd.step)
            self._execute(self.coordinator.handle(P.GradientsMerged(self.loop.now, cmd.step, self.loop.now - t0)))
        self.loop.schedule(duration, done, priority=0)

    def _do_OptimizerStep(self, cmd: P.OptimizerStep):
        duration = self._jitter(self.optimizer_time)
        t0 = self.loop.now

        def done():
            self._span(P.TRAINER_POOL + "/trainer", "optimizer", t0, self.loop.now, {}, step=cmd.step)
            self._execute(self.coordinator.handle(P.OptimizerStepped(self.loop.now, cmd.step, cmd.version)))
        self.loop.schedule(duration, done, priority=0)

    # ------------------------------------------------------------------------------------------
    # incremental use (live views) -------------------------------------------------------------
    def start(self) -> None:
        """Begin the run; then call :meth:`advance` repeatedly (a notebook can draw between calls)."""
        if getattr(self, "_started", False):
            return
        self._started = True
        self._emit(P.Started(0.0))

    @property
    def done(self) -> bool:
        c = self.coordinator
        return (c.finished and not any(e.busy for e in self.engines.values())) or not self.loop._heap

    def advance(self, seconds: float = float("inf"), max_events: int = 10**9) -> int:
        """Process events up to ``seconds`` of simulated time from now (or ``max_events``); returns steps done."""
        self.start()
        until = self.loop.now + seconds
        n = 0
        while not self.done and self.loop.peek() <= until and n < max_events:
            self.loop.step()
            n += 1
        if not self.done and self.loop.peek() > until:
            self.loop.now = until
        self._sync_records()
        return len(self.coordinator.steps)

    def _sync_records(self) -> None:
        c = self.coordinator
        for s in c.steps[len(self.log.steps):]:
            self.log.add_step(s)
        for d in c.decisions[len(self.log.decisions):]:
            self.log.add_decision(d)

    def result(self) -> SimResult:
        """Finish bookkeeping once :attr:`done`; raises if the run stalled before its last step."""
        c = self.coordinator
        if not c.finished:
            raise RuntimeError(f"simulation stalled after {len(c.steps)} of {self.steps} steps "
                               f"(policy {self.policy_name}); this is a scheduler bug — please report it")
        self._sync_records()
        return self._result()

    def run(self, progress: bool = False) -> SimResult:
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.steps, desc=f"simulate {self.policy_name}", leave=False)
        self.start()
        seen = 0
        while not self.done:
            self.loop.step()
            if bar is not None and len(self.coordinator.steps) != seen:
                bar.update(len(self.coordinator.steps) - seen)
                seen = len(self.coordinator.steps)
        if bar is not None:
            bar.close()
        return self.result()

    def _result(self) -> SimResult:
        from bidirl import metrics
        summary = metrics.summary(self.log, policy=self.policy_name, staleness=self.config.rl.staleness,
                                  pool_gpus=self.control.pool_gpus, gpus_per_worker=self.control.gpus_per_worker(),
                                  samples=self.coordinator.sample_counts())
        return SimResult(self.policy_name, self.config, self.log, summary, self.loop.processed, self.coordinator)
