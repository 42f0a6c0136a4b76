"""Emulated workers: the real Ray actors and control path, with execution replaced by model-timed sleeps.

Each actor owns the state a real worker would (a rollout engine's running requests, a trainer gang's chunk),
but where a real worker would compute it sleeps for the stage-time model's duration divided by ``time_scale``
(virtual seconds per wall second). Rollout replicas run the continuous-batching replica model
(:class:`~bidirl.perf.replica.BatchingEngine`) against the wall clock, so completions, interruptions and
prefixes behave exactly as in simulation while the driver, Ray scheduling and ``ray.wait`` loop are real.
This lets 16-512 virtual GPUs run on one machine and measures what the control path itself costs.

:class:`EmulatedDriver` is the pool driver with an :class:`EmulatedBackend` plugged in
(:mod:`bidirl.cluster.backend`): the backend places the actors and turns each command into timed calls.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Optional

from bidirl.cluster.backend import WorkerBackend
from bidirl.cluster.emulated_workers import EmulatedTrainer, RolloutHost
from bidirl.cluster.pool import ClusterError, PoolDriver
from bidirl.core import protocol as P
from bidirl.perf.replica import EngineGroup
from bidirl.perf.workload import GroupLengths
from bidirl.runtime.driver import switch_lane

#: rollout hosts (processes) per pool by default: replicas are spread over at most this many
HOSTS_PER_POOL = 8


@dataclass
class EmulatedDriver(PoolDriver):
    """Run a job on Ray with emulated, model-timed workers (``time_scale`` virtual s per wall s).

    Rollout replicas run on :class:`RolloutHost` actors, ``replicas_per_host`` each (default: as many as keep a
    pool on at most :data:`HOSTS_PER_POOL` processes), so 256 virtual GPUs take tens of processes, not hundreds.
    A host's death fails every replica on it; the driver restarts the host once and each replica comes back.
    The workers are :class:`EmulatedBackend`'s (``backend``).
    """
    time_scale: float = 20.0
    max_wall: float = 0.05
    replicas_per_host: Optional[int] = None

    label = "emulated"
    provenance = "emulated"

    def __post_init__(self):
        super().__post_init__()
        if self.kept_workers is not None:
            raise ValueError("EmulatedDriver.kept_workers: emulated workers start in a second; kept workers are "
                             "for engine runs (EngineDriver)")
        if self.replicas_per_host is not None and (isinstance(self.replicas_per_host, bool) or
                                                   not isinstance(self.replicas_per_host, int) or
                                                   self.replicas_per_host < 1):
            raise ValueError(f"EmulatedDriver.replicas_per_host must be an integer ≥ 1 (rollout replicas per "
                             f"process), got {self.replicas_per_host!r}")
        self.backend = EmulatedBackend(self)


class EmulatedBackend(WorkerBackend):
    """Emulated workers under the pool driver ``pool`` (an :class:`EmulatedDriver`, whose settings it reads): rollout
    replicas on hosts, a trainer gang as one actor, every operation a model-timed hold (module doc)."""

    def __init__(self, pool: EmulatedDriver):
        super().__init__(pool)
        self.time_scale = pool.time_scale
        self.lengths = GroupLengths.of(pool.config, pool.seed)
        self.hosts: list = []                 # [names of the replicas it runs], by host index
        self.host_of: dict = {}               # rollouter -> host index
        for replicas in (pool.topology.rollouters, pool.topology.aux_rollouters):
            k = pool.replicas_per_host or max(1, math.ceil(len(replicas) / HOSTS_PER_POOL))
            for i in range(0, len(replicas), k):
                self.host_of.update({w: len(self.hosts) for w in replicas[i:i + k]})
                self.hosts.append(list(replicas[i:i + k]))
        self.host_advancing: dict = {}        # host -> an advance call is in flight
        self.host_holds: dict = {}            # host -> {token: (finish, on_error)} of holds not yet ended
        self._tokens = itertools.count()
        self._respawned: set = set()          # hosts started afresh in the current failure (one per host)
        self._orphaned: list = []             # tolerant holds of a failed host, finished after the failure
        self.host_down: set = set()           # hosts discarded whose successor is not started yet
        self._actor_classes: dict = {}        # class -> ray.remote(class), made once per driver (_actor_class)

    def place(self):
        import ray

        # the virtual clock starts a second from now (see begin for a resumed run)
        self.pool.t0 = time.time() + 1.0 - self.pool.clock_start / self.time_scale
        self._respawned = set()
        for w in self.pool.topology.workers:
            self.spawn(w)
        # every worker is initialised up front and kept (auxiliaries passive)
        try:
            ray.get([a.set_clock.remote(self.pool.t0) for a in self.pool._all_actors()],
                    timeout=self.pool.start_timeout)
        except Exception as exc:
            raise ClusterError(f"a worker failed to start: {exc}") from None

    def _actor_class(self, cls):
        """``ray.remote(cls)``, made once per driver: Ray exports each class ``ray.remote`` makes anew, hashing its
        code (≈ 50 ms of the driver's CPU per worker started)."""
        import ray
        if cls not in self._actor_classes:
            self._actor_classes[cls] = ray.remote(cls)
        return self._actor_classes[cls]

    def spawn(self, worker: str) -> None:
        """A trainer gang is one emulated actor on its first slot; a rollouter runs on its host (started once
        per placement or failure) on the bundle of the host's first replica."""
        env, top = self.pool.plan.envelope, self.pool.topology
        g_r = env.rollout_gpus
        if P.worker_kind(worker) == P.TRAINER:
            bundle = g_r if P.is_primary(worker) else 0
            self.pool.actors[worker] = self._actor_class(EmulatedTrainer).options(**self.pool.slots.at(bundle)).remote(
                worker, self.pool.t0, self.time_scale)
            return
        h = self.host_of[worker]
        if h in self._respawned:
            return
        self._respawned.add(h)
        self.host_down.discard(h)
        names = self.hosts[h]
        seeds = []
        for w in names:
            i = int(w.rsplit("/", 1)[1])
            seeds.append([self.pool.seed, 3, i if P.is_primary(w) else len(top.rollouters) + i])
        first = int(names[0].rsplit("/", 1)[1])
        bundle = (0 if P.is_primary(names[0]) else g_r) + first * env.rollout_layout
        actor = self._actor_class(RolloutHost).options(**self.pool.slots.at(bundle)).remote(
            names, self.pool.truth.engine_costs(), self.pool.t0, self.time_scale, seeds)
        self.pool.actors.update({w: actor for w in names})
        self.host_advancing[h], self.host_holds[h] = False, {}

    def discard(self, worker: str) -> None:
        import ray
        h = self.host_of.get(worker)
        if h is not None:
            if h in self._respawned:
                return
            # the host's holds end with it: a tolerant one finishes once the failure is reported
            self._orphaned += [on_error for _, on_error in self.host_holds.pop(h, {}).values() if on_error]
            self.host_advancing[h] = False
            self.host_down.add(h)      # no advance is sent to it until its successor is spawned
        try:
            ray.kill(self.pool.actors[worker], no_restart=True)
        except Exception:
            pass

    def worker_failed(self, worker: str, error: str, fail) -> None:
        """A rollout host's process is shared by its replicas: they fail, and are restarted, together."""
        h = self.host_of.get(worker)
        self._respawned, self._orphaned = set(), []
        fail(worker, error)          # discards and restarts the worker (a host: once)
        for mate in (self.hosts[h] if h is not None else ()):
            if mate != worker and mate not in self.pool.failed:
                fail(mate, f"{error} (the process it shares with {worker})")
        orphaned, self._orphaned = self._orphaned, []
        for on_error in orphaned:
            on_error()

    def restarted(self, worker: str) -> None:
        if worker in self.host_of:
            self._ensure_advance(worker)       # holds sent while it was being restarted

    def restore(self, worker: str, then) -> None:
        """An emulated worker holds no weights: ready is restored."""
        self.pool._submit(worker, self.pool.actors[worker].set_clock.remote(self.pool.t0), lambda _: then())

    def begin(self):
        if self.pool.boundary is not None:
            # a resumed run's timeline goes on from its boundary when every worker is ready (start-up is not
            # part of it); a fresh run's clock started when the workers were placed
            import ray
            self.pool.t0 = time.time() - self.pool.clock_start / self.time_scale
            ray.get([a.set_clock.remote(self.pool.t0) for a in self.pool._all_actors()],
                    timeout=self.pool.start_timeout)
        time.sleep(max(0.0, self.pool.t0 + self.pool.clock_start / self.time_scale - time.time()))

    # rollout ------------------------------------------------------------------------------------
    def _rollout_report(self, worker, result):
        for kind, a, b, det in result["spans"]:
            self.pool.span(worker, kind, a, b, det)
        for t, state in result["finished"]:
            self.pool.feed(P.GroupFinished(t, worker, state))

    def _ensure_advance(self, worker):
        """Keep a host reporting while any replica on it is busy or any hold on it has not ended: one
        ``advance`` call in flight per host, whose report covers every replica on it."""
        h = self.host_of[worker]
        names = self.hosts[h]
        live = [w for w in names if w not in self.pool.failed]
        busy = any(self.pool.r_busy.get(w) for w in live)
        if h in self.host_down or self.host_advancing.get(h) or (not self.host_holds.get(h) and not busy):
            return
        self.host_advancing[h] = True
        starts = {w: self.pool.r_starts.get(w, 0) for w in live}

        def done(result):
            self.host_advancing[h] = False
            for w, report in result["replicas"].items():
                if w in starts and w not in self.pool.failed:
                    self.pool.r_busy[w] = self.pool._still_busy(w, report["busy"], starts[w])
                    self._rollout_report(w, report)
            holds = self.host_holds.get(h, {})
            for token, a, b in result["holds"]:
                if token in holds:
                    holds.pop(token)[0](a, b)
            self._ensure_advance(worker)
        self.pool._submit(names[0], self.pool.actors[names[0]].advance.remote(self.pool.max_wall), done)

    def generate(self, cmd: P.Generate):
        groups = [EngineGroup.from_task(t, *self.lengths(t.group_id), cmd.version) for t in cmd.tasks]
        self.pool.r_busy[cmd.worker] = True
        self.pool._count_start(cmd.worker)
        self.pool._submit(cmd.worker, self.pool.actors[cmd.worker].start.remote(cmd.worker, groups), lambda _: None)
        self._ensure_advance(cmd.worker)

    def interrupt(self, cmd: P.Interrupt):
        starts = self.pool.r_starts.get(cmd.worker, 0)

        def done(result):
            self._rollout_report(cmd.worker, result)
            self.pool.r_busy[cmd.worker] = self.pool._still_busy(cmd.worker, result["busy"], starts)
            self.pool.feed(P.GenerationStopped(result["t"], cmd.worker, tuple(result["stopped"])))
            self._ensure_advance(cmd.worker)
        self.pool._submit(cmd.worker, self.pool.actors[cmd.worker].interrupt.remote(
            cmd.worker, list(cmd.group_ids) if cmd.group_ids is not None else None), done)

    # trainer -------------------------------------------------------------------------------------
    def run_chunk(self, cmd: P.RunChunk):
        ch = cmd.chunk
        p = [self.lengths(g)[0] for g, _ in ch.samples]
        r = [self.lengths(g)[1][i] for g, i in ch.samples]
        seconds = self.pool.truth.chunk_time(ch.stage, p, r, self.pool.topology.gang_size(cmd.worker))
        self.pool._submit(cmd.worker, self.pool.actors[cmd.worker].run_chunk.remote(ch.chunk_id, seconds),
                          lambda result: self.pool._chunk_done(cmd, result["start"], result["end"]))

    def _hold(self, worker, seconds, finish, tolerate: bool = False):
        """A timed operation on ``worker``; with ``tolerate`` it ends even if the worker dies meanwhile (a
        switch or a sync goes on without it). A rollouter's runs on its host's loop (:meth:`RolloutHost.hold`)
        and ends in the host's report; a trainer gang's is a call that returns when it ends."""
        start = self.pool.now()
        on_error = (lambda: finish(start, self.pool.now())) if tolerate else None
        h = self.host_of.get(worker)
        if h is None:
            self.pool._submit(worker, self.pool.actors[worker].hold.remote(seconds),
                              lambda el: finish(start, start + el), on_error=on_error)
            return
        token = next(self._tokens)
        self.host_holds[h][token] = (finish, on_error)

        def sent(_):
            self._ensure_advance(worker)

        def lost():
            entry = self.host_holds.get(h, {}).pop(token, None)
            if entry is not None and entry[1] is not None:
                entry[1]()
        self.pool._submit(worker, self.pool.actors[worker].hold.remote(token, seconds), sent, on_error=lost)

    def switch(self, cmd: P.Switch):
        def finish(a, b):
            self.pool._measure((cmd.direction, "c_in" if cmd.phase == "in" else "c_out"), b - a)
            self.pool.record_switch(cmd, a, b)
            self.pool.feed(P.SwitchFinished(b, cmd.pool, cmd.to_role, b - a))
        self._hold(switch_lane(cmd.pool, cmd.to_role), cmd.expected, finish, tolerate=True)

    def sync_weights(self, cmd: P.SyncWeights):
        seconds = self.pool.config.weight_sync_time(rollout_layout=self.pool.plan.envelope.rollout_layout)
        intervals = {}

        def finish(worker):
            def f(a, b):
                intervals[worker] = (a, b)
                if len(intervals) == len(cmd.targets):
                    start, end = min(x for x, _ in intervals.values()), max(y for _, y in intervals.values())
                    self.pool.record_sync(cmd, start, end, intervals)
                    self.pool.feed(P.SyncFinished(end, cmd.version, cmd.targets, end - start))
            return f
        for w in cmd.targets:
            self._hold(w, seconds, finish(w), tolerate=True)

    def merge_gradients(self, cmd: P.MergeGradients):
        def finish(a, b):
            self.pool._measure((P.TRAINER_ON_ROLLOUT_POOL, "c_grad"), b - a)
            self.pool.record_merge(cmd, a, b)
            self.pool.feed(P.GradientsMerged(b, cmd.step, b - a))
        self._hold(P.PRIMARY_TRAINER, cmd.expected, finish)

    def optimizer_step(self, cmd: P.OptimizerStep):
        def finish(a, b):
            self.pool.record_optimizer(cmd, a, b)
            self.pool.feed(P.OptimizerStepped(b, cmd.step, cmd.version))
        self._hold(P.PRIMARY_TRAINER, self.pool.assembly.optimizer_step_time(cmd.final), finish)

    def refresh_weights(self, cmd: P.RefreshWeights):
        """The auxiliary gang receives the primaries' current weights: a hold on its actor for the transfer the
        scheduler charged (``cmd.expected``: :func:`bidirl.perf.costs.aux_weight_transfer_time`), after the chunks
        already sent to it (calls on one actor run in order), as an engine gang's load follows them."""
        def finish(a, b):
            self.pool.record_refresh(cmd, a, b)
            self.pool.feed(P.WeightsRefreshed(b, cmd.worker, cmd.step, cmd.version, cmd.updates, b - a))
        self._hold(cmd.worker, cmd.expected, finish)

    def summarize(self, out: dict) -> None:
        out["emulated"] = True
        out["time_scale"] = self.time_scale
