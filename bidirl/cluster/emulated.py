"""Emulated workers: the real Ray actors and control path, with execution replaced by model-timed sleeps.

Each actor owns the state a real worker would (a rollout engine's running requests, a trainer gang's chunk),
but where a real worker would compute it sleeps for the stage-time model's duration divided by ``time_scale``
(virtual seconds per wall second). Rollout replicas run the continuous-batching replica model
(:class:`~bidirl.perf.engine.BatchingEngine`) against the wall clock, so completions, interruptions and
prefixes behave exactly as in simulation while the driver, Ray scheduling and ``ray.wait`` loop are real.
This lets 16-512 virtual GPUs run on one machine and measures what the control path itself costs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from bidirl.cluster.pool import ClusterError, PoolDriver
from bidirl.core import protocol as P
from bidirl.execution import switch_lane
from bidirl.loop import EventLoop
from bidirl.perf.engine import BatchingEngine, EngineGroup
from bidirl.perf.workload import GroupLengths


class VirtualClock:
    """Virtual seconds since ``t0`` (a shared wall-clock origin) at ``scale`` virtual s per wall s."""

    def __init__(self, t0: float, scale: float):
        self.t0, self.scale = t0, scale

    def now(self) -> float:
        return (time.time() - self.t0) * self.scale

    def sleep_virtual(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.scale)


class EmulatedRollout:
    """A rollout replica emulated with the replica model. Driven by ``advance`` calls from the driver."""

    def __init__(self, name: str, engine_costs, t0: float, scale: float, seed):
        self.name, self.clock = name, VirtualClock(t0, scale)
        self.loop = EventLoop()
        self.finished, self.spans = [], []
        self.engine = BatchingEngine(name, engine_costs, self.loop, np.random.default_rng(seed),
                                     on_group=lambda w, st, el: self.finished.append((self.loop.now, st)),
                                     on_span=lambda w, kind, a, b, det: self.spans.append((kind, a, b, det)),
                                     on_record=lambda *a: None)

    def _catch_up(self) -> None:
        self.loop.run(until=self.clock.now())

    def _report(self, **extra) -> dict:
        out, self.finished = self.finished, []
        spans, self.spans = self.spans, []
        return {"finished": out, "busy": self.engine.busy, "spans": spans, "t": self.loop.now, **extra}

    def start(self, groups: list) -> int:
        """``groups``: :class:`~bidirl.perf.engine.EngineGroup` to add now."""
        self._catch_up()
        self.engine.add(*groups)
        return len(groups)

    def advance(self, max_wall: float) -> dict:
        """Sleep until the next completion (or ``max_wall``), then report what finished."""
        self._catch_up()
        target = min(self.loop.peek(), self.loop.now + max_wall * self.clock.scale)
        if math.isfinite(target):
            self.clock.sleep_virtual(target - self.clock.now())
        self._catch_up()
        return self._report()

    def interrupt(self, group_ids) -> dict:
        self._catch_up()
        return self._report(stopped=self.engine.interrupt(group_ids))

    def hold(self, seconds: float) -> float:
        """A timed state operation on this worker (weight load, offload, onload): returns virtual seconds."""
        t0 = self.clock.now()
        self.clock.sleep_virtual(seconds)
        return self.clock.now() - t0


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


@dataclass
class EmulatedDriver(PoolDriver):
    """Run a job on Ray with emulated, model-timed workers (``time_scale`` virtual s per wall s)."""
    time_scale: float = 20.0
    max_wall: float = 0.05

    label = "emulated"
    provenance = "emulated"

    def __post_init__(self):
        super().__post_init__()
        self.lengths = GroupLengths.of(self.config, self.seed)

    def _place(self):
        import ray

        env = self.plan.envelope
        g_r = env.rollout_gpus
        Rollout, Trainer = ray.remote(EmulatedRollout), ray.remote(EmulatedTrainer)
        costs = self.truth.engine_costs()
        top = self.topology
        self.t0 = time.time() + 1.0
        for i, w in enumerate(top.rollouters):
            self.actors[w] = Rollout.options(**self._at(i * env.rollout_layout)).remote(
                w, costs, self.t0, self.time_scale, [self.seed, 3, i])
        for j, w in enumerate(top.aux_rollouters):
            self.actors[w] = Rollout.options(**self._at(g_r + j * env.rollout_layout)).remote(
                w, costs, self.t0, self.time_scale, [self.seed, 3, len(top.rollouters) + j])
        self.actors[P.PRIMARY_TRAINER] = Trainer.options(**self._at(g_r)).remote(P.PRIMARY_TRAINER, self.t0,
                                                                                self.time_scale)
        if top.aux_trainer_replicas:
            self.actors[P.AUX_TRAINER] = Trainer.options(**self._at(0)).remote(P.AUX_TRAINER, self.t0,
                                                                              self.time_scale)
        # every worker is initialised up front and kept (auxiliaries passive)
        try:
            ray.get([a.hold.remote(0.0) for a in self.actors.values()], timeout=self.start_timeout)
        except Exception as exc:
            raise ClusterError(f"a worker failed to start: {exc}") from None

    def _begin(self):
        time.sleep(max(0.0, self.t0 - time.time()))

    def now(self) -> float:
        return (time.time() - self.t0) * self.time_scale

    # rollout ------------------------------------------------------------------------------------
    def _rollout_report(self, worker, result):
        for kind, a, b, det in result["spans"]:
            self.span(worker, kind, a, b, det)
        for t, state in result["finished"]:
            self.feed(P.GroupFinished(t, worker, state))

    def _advance_call(self, worker):
        return self.actors[worker].advance.remote(self.max_wall)

    def _advanced(self, worker, result, starts_before):
        self.r_busy[worker] = self._still_busy(worker, result["busy"], starts_before)
        self._rollout_report(worker, result)

    def do_Generate(self, cmd: P.Generate):
        groups = [EngineGroup.from_task(t, *self.lengths(t.group_id), cmd.version) for t in cmd.tasks]
        self.r_busy[cmd.worker] = True
        self._count_start(cmd.worker)
        self._submit(cmd.worker, self.actors[cmd.worker].start.remote(groups), lambda _: None)
        self._ensure_advance(cmd.worker)

    def do_Interrupt(self, cmd: P.Interrupt):
        starts = self.r_starts.get(cmd.worker, 0)

        def done(result):
            self._rollout_report(cmd.worker, result)
            self.r_busy[cmd.worker] = self._still_busy(cmd.worker, result["busy"], starts)
            self.feed(P.GenerationStopped(result["t"], cmd.worker, tuple(result["stopped"])))
            self._ensure_advance(cmd.worker)
        self._submit(cmd.worker, self.actors[cmd.worker].interrupt.remote(
            list(cmd.group_ids) if cmd.group_ids is not None else None), done)

    # trainer -------------------------------------------------------------------------------------
    def _run_chunk(self, cmd: P.RunChunk):
        ch = cmd.chunk
        p = [self.lengths(g)[0] for g, _ in ch.samples]
        r = [self.lengths(g)[1][i] for g, i in ch.samples]
        seconds = self.truth.chunk_time(ch.stage, p, r, self.topology.gang_size(cmd.worker))
        self._submit(cmd.worker, self.actors[cmd.worker].run_chunk.remote(ch.chunk_id, seconds),
                     lambda result: self._chunk_done(cmd, result["start"], result["end"]))

    def _hold(self, worker, seconds, finish):
        start = self.now()
        self._submit(worker, self.actors[worker].hold.remote(seconds), lambda el: finish(start, start + el))

    def do_Switch(self, cmd: P.Switch):
        def finish(a, b):
            self._measure((cmd.direction, "c_in" if cmd.phase == "in" else "c_out"), b - a)
            self.record_switch(cmd, a, b)
            self.feed(P.SwitchFinished(b, cmd.pool, cmd.to_role, b - a))
        self._hold(switch_lane(cmd.pool, cmd.to_role), cmd.expected, finish)

    def do_SyncWeights(self, cmd: P.SyncWeights):
        seconds = self.config.weight_sync_time()
        intervals = {}

        def finish(worker):
            def f(a, b):
                intervals[worker] = (a, b)
                if len(intervals) == len(cmd.targets):
                    start, end = min(x for x, _ in intervals.values()), max(y for _, y in intervals.values())
                    self.record_sync(cmd, start, end, intervals)
                    self.feed(P.SyncFinished(end, cmd.version, cmd.targets, end - start))
            return f
        for w in cmd.targets:
            self._hold(w, seconds, finish(w))

    def do_MergeGradients(self, cmd: P.MergeGradients):
        def finish(a, b):
            self._measure((P.TRAINER_ON_ROLLOUT_POOL, "c_grad"), b - a)
            self.record_merge(cmd, a, b)
            self.feed(P.GradientsMerged(b, cmd.step, b - a))
        self._hold(P.PRIMARY_TRAINER, cmd.expected, finish)

    def do_OptimizerStep(self, cmd: P.OptimizerStep):
        def finish(a, b):
            self.record_optimizer(cmd, a, b)
            self.feed(P.OptimizerStepped(b, cmd.step, cmd.version))
        self._hold(P.PRIMARY_TRAINER, self.assembly.optimizer_time(), finish)

    def summary(self) -> dict:
        out = super().summary()
        out["emulated"] = True
        out["time_scale"] = self.time_scale
        return out
