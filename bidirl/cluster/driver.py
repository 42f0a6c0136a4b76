"""The Ray driver: the same coordinator as the simulator, fed by completions of Ray calls (``ray.wait``).

Pools map to one placement group over ``G`` GPU slots — the logical resource ``gpu_slot`` on a machine
without GPUs, ``GPU`` on real hardware — reserved once (placement groups cannot be resized) and split by
bundle index: bundles ``[0, g_r)`` are the rollout pool, ``[g_r, G)`` the trainer pool. On each pool the
primary workers and the auxiliary workers of the other role are started once, each holding half of the
bundle it sits on, and are kept: a hot switch changes which one works, never restarts a process (§3.2).

Every timed command becomes one actor call; its completion becomes the matching event. Workers record
their own spans and return them with their results. A worker whose actor dies is reported to the
coordinator as ``WorkerFailed``; auxiliary work is recovered on the primaries.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from bidirl import config as cfgmod
from bidirl.core import protocol as P
from bidirl.trace import EventLog, Span


class ClusterError(RuntimeError):
    """The cluster cannot run the job as configured (resources, worker start-up)."""


@dataclass
class RunResult:
    policy: str
    config: cfgmod.JobConfig
    log: EventLog
    summary_dict: dict
    coordinator: object = None
    weights: object = None          # engine runs: the final actor weights (state_dict)

    def summary(self) -> dict:
        return dict(self.summary_dict)


@dataclass
class PoolDriver:
    """What every Ray driver shares: the control plane, Ray start-up, the one placement group over the
    GPU slots, the ``ray.wait`` loop that turns call completions into events, spans and the result.

    Subclasses place their workers (``_place``) and execute the coordinator's commands (``_do_<Command>``).
    """
    config: cfgmod.JobConfig
    policy_name: str
    steps: int
    seed: int
    address: Optional[str] = None
    start_timeout: float = 120.0
    stall_timeout: float = 60.0
    log: EventLog = field(default_factory=EventLog)
    on_event: Optional[Callable] = None           # called with each event (live views)

    label = "ray"

    def __post_init__(self):
        from bidirl import control
        self.control = cp = control.build(self.config, self.policy_name, steps=self.steps, seed=self.seed)
        self.topology, self.models, self.coordinator = cp.topology, cp.models, cp.coordinator
        self.pending: dict = {}
        self.actors: dict = {}
        self.measured: dict = {}
        self.pg = None
        self.t0 = time.time()
        self.progress = False
        self.r_busy: dict = {}            # rollouter -> whether it holds requests
        self.r_advancing: dict = {}       # rollouter -> whether a generation call is in flight
        self.r_starts: dict = {}          # rollouter -> number of start calls sent (see _still_busy)

    # ------------------------------------------------------------------------------------------
    def _resource(self) -> str:
        return "gpu_slot"

    def _start_ray(self):
        import ray
        G = self.config.cluster.gpus
        # The metrics agent is not needed here and, on a loaded small machine, its start-up can time out.
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, namespace="bidirl", log_to_driver=False)
            else:
                ray.init(num_cpus=max(4, os.cpu_count() or 1), **self._local_slots(G),
                         include_dashboard=False, log_to_driver=False, namespace="bidirl")
        have = ray.cluster_resources().get(self._resource(), 0)
        if have < G:
            raise ClusterError(f"the Ray cluster offers {have:g} '{self._resource()}' resources but cluster.gpus "
                               f"is {G}; start Ray with resources={{'{self._resource()}': {G}}} or lower cluster.gpus")

    def _local_slots(self, gpus: int) -> dict:
        """``ray.init`` arguments that give an embedded local Ray its GPU slots: logical ``gpu_slot`` units."""
        return {"resources": {"gpu_slot": float(gpus)}}

    def _reserve(self):
        """One placement group of ``G`` bundles: ``[0, g_r)`` the rollout pool, ``[g_r, G)`` the trainer pool."""
        import ray
        from ray.util.placement_group import placement_group

        G, res = self.config.cluster.gpus, self._resource()
        self.pg = placement_group([{res: 1.0, "CPU": 0.1}] * G, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.start_timeout)
        except Exception as exc:
            raise ClusterError(f"could not reserve {G} GPU slots within {self.start_timeout:.0f} s ({exc}); "
                               "check the cluster's free resources") from None

    def _at(self, bundle: int, share: float = 0.5, cpus: float = 0.05) -> dict:
        """Actor options that place it on ``bundle`` holding ``share`` of its GPU slot."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return {"num_cpus": cpus, "resources": {self._resource(): share},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}

    def _place(self):
        raise NotImplementedError

    def now(self) -> float:
        return time.time() - self.t0

    # ------------------------------------------------------------------------------------------
    def _submit(self, worker: str, ref, callback, on_error: Optional[Callable] = None):
        """Track a call on ``worker``: ``callback(value)`` when it completes; if the worker's actor died,
        the coordinator is told and ``on_error()`` runs (for calls whose completion others wait on)."""
        self.pending[ref] = (worker, callback, on_error)

    def _when_all(self, calls: list, callback, tolerate: bool = False):
        """Call ``callback(values)`` once every ``(worker, ref)`` call has completed (at once if there are none).

        With ``tolerate`` a call whose worker died counts as done with value ``None`` (the coordinator is told
        of the failure and recovers); otherwise such a call never completes and neither does ``callback``.
        """
        if not calls:
            callback([])
            return
        values, left = [None] * len(calls), [len(calls)]

        def one(i):
            def done(value=None):
                values[i] = value
                left[0] -= 1
                if left[0] == 0:
                    callback(values)
            return done
        for i, (worker, ref) in enumerate(calls):
            self._submit(worker, ref, one(i), on_error=one(i) if tolerate else None)

    def _feed(self, event):
        if self.on_event is not None:
            self.on_event(event)
        for cmd in self.coordinator.handle(event):
            getattr(self, "_do_" + type(cmd).__name__)(cmd)

    def _span(self, worker, kind, start, end, detail, step=None):
        c = self.coordinator
        self.log.add_span(Span(worker=worker, pool=P.worker_pool(worker),
                               role="primary" if P.is_primary(worker) else "auxiliary", kind=kind,
                               start=float(start), end=float(max(start, end)),
                               step=len(c.steps) if step is None else step, version=c.trainer_version,
                               detail=detail))

    def _count_start(self, worker: str) -> None:
        self.r_starts[worker] = self.r_starts.get(worker, 0) + 1

    def _still_busy(self, worker: str, reported: bool, starts_before: int) -> bool:
        """Whether a rollouter is busy after a call that reported ``reported``: a start sent while the call was
        in flight runs after it on the actor, so the report cannot have seen its requests."""
        return bool(reported) or self.r_starts.get(worker, 0) != starts_before

    def _measure(self, key, seconds):
        self.measured.setdefault(key, []).append(seconds)

    def _worker_failed(self, worker: str, exc: Exception):
        """A call on ``worker`` raised because its actor died: tell the coordinator (once)."""
        self.r_busy[worker] = self.r_advancing[worker] = False
        if worker not in self.coordinator.failed:
            self._feed(P.WorkerFailed(self.now(), worker, str(exc).splitlines()[0]))

    def _begin(self):
        """Called after placement, right before ``Started``."""

    # rollouters: one generation call in flight per busy rollouter ---------------------------------
    def _ensure_advance(self, worker: str):
        """Keep a busy rollouter generating: one ``_advance_call`` in flight, reported to ``_advanced``."""
        if self.r_advancing.get(worker) or not self.r_busy.get(worker) or worker in self.coordinator.failed:
            return
        self.r_advancing[worker] = True
        starts = self.r_starts.get(worker, 0)

        def done(result):
            self.r_advancing[worker] = False
            self._advanced(worker, result, starts)
            self._ensure_advance(worker)
        self._submit(worker, self._advance_call(worker), done)

    def _advance_call(self, worker: str):
        """Submit one generation slice on ``worker``; returns its object ref."""
        raise NotImplementedError

    def _advanced(self, worker: str, result, starts_before: int) -> None:
        """Report a generation slice's result (``starts_before``: for :meth:`_still_busy`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    def run(self, progress: bool = False, kill: Optional[Callable] = None) -> RunResult:
        """Run to the configured number of steps. ``kill(driver)`` is polled each loop (fault tests)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        self.progress = progress
        self._start_ray()
        bar = None
        c = self.coordinator
        try:
            self._reserve()
            self._place()
            self._begin()
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=self.steps, desc=f"run {self.policy_name} ({self.label})", leave=False)
            self._feed(P.Started(self.now()))
            seen = 0
            while self.pending:
                ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=self.stall_timeout)
                if not ready:
                    raise ClusterError(f"no worker answered for {self.stall_timeout:.0f} s at step {len(c.steps)}; "
                                       "the job is stuck")
                for ref in ready:
                    worker, callback, on_error = self.pending.pop(ref)
                    try:
                        value = ray.get(ref)
                    except (RayActorError, RayTaskError) as exc:
                        died = isinstance(exc, RayActorError)
                        if not died and P.is_primary(worker):
                            raise ClusterError(f"worker {worker} failed: {_root_cause(exc)}") from exc
                        # an auxiliary worker that died or whose call failed (e.g. a collective broken by a
                        # dead peer) is given up: the coordinator recovers its work on the primaries
                        self._worker_failed(worker, exc)
                        if on_error is not None:
                            on_error()
                        continue
                    callback(value)
                if kill is not None:
                    kill(self)
                if bar is not None and len(c.steps) != seen:
                    bar.update(len(c.steps) - seen)
                    seen = len(c.steps)
        finally:
            if bar is not None:
                bar.close()
            self.shutdown()
        if not c.finished:
            raise ClusterError(f"the run ended after {len(c.steps)} of {self.steps} steps with no work left; "
                               "this is a scheduler bug — please report it with the event log")
        for s in c.steps:
            self.log.add_step(s)
        for d in c.decisions:
            self.log.add_decision(d)
        return self._result()

    def shutdown(self):
        import ray
        from ray.util.placement_group import remove_placement_group
        for a in self._all_actors():
            try:
                ray.kill(a)
            except Exception:
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    def _all_actors(self) -> list:
        return list(self.actors.values())

    def _summary(self) -> dict:
        import numpy as np

        from bidirl import metrics
        summary = metrics.summary(self.log, policy=self.policy_name, staleness=self.config.rl.staleness,
                                  pool_gpus=self.control.pool_gpus, gpus_per_worker=self.control.gpus_per_worker(),
                                  samples=self.coordinator.sample_counts())
        costs = {}
        for (direction, which), values in sorted(self.measured.items()):
            costs.setdefault(direction, {})[which] = float(np.median(values))
        summary["costs"] = costs
        # the online profiler's state at the end (§5.1): measured-over-predicted stage-time factors and the
        # switch costs the scheduler now charges
        prof = self.coordinator.profiler
        summary["calibration"] = {
            "scales": {f"{'rollout' if k == 'r' else 'trainer'}/{side}": v for (k, side), v in prof.scales.items()},
            "records": len(prof.records),
            "switch_costs": {d: dict(vars(c)) for d, c in prof.costs.items()}}
        return summary


@dataclass
class RayDriver(PoolDriver):
    """Run ``config`` on Ray with emulated, model-timed workers (``time_scale`` virtual s per wall s)."""
    emulate: bool = True
    time_scale: float = 20.0
    max_wall: float = 0.05

    label = "emulated"

    def __post_init__(self):
        if not self.emulate:
            raise ClusterError("RayDriver drives emulated workers; engine workers are driven by "
                               "bidirl.cluster.engine_driver.EngineDriver (run(..., emulate=False))")
        super().__post_init__()
        self.sync_left = 0
        self._lengths = {}

    def _place(self):
        import ray

        from bidirl.cluster.emulated import EmulatedRollout, EmulatedTrainer

        env = self.control.plan.envelope
        g_r = env.rollout_gpus
        Rollout = ray.remote(EmulatedRollout)
        Trainer = ray.remote(EmulatedTrainer)
        costs = self.models.engine_costs()
        top = self.topology
        self.t0 = time.time() + 1.0
        for i, w in enumerate(top.rollouters):
            self.actors[w] = Rollout.options(**self._at(i * env.rollout_layout)).remote(
                w, costs, self.t0, self.time_scale, [self.seed, 3, i])
        for j, w in enumerate(top.aux_rollouters):
            self.actors[w] = Rollout.options(**self._at(g_r + j * env.rollout_layout)).remote(
                w, costs, self.t0, self.time_scale, [self.seed, 3, len(top.rollouters) + j])
        self.actors["trainer_pool/trainer"] = Trainer.options(**self._at(g_r)).remote("trainer_pool/trainer", self.t0,
                                                                                     self.time_scale)
        if top.aux_trainer_replicas:
            self.actors["rollout_pool/trainer"] = Trainer.options(**self._at(0)).remote("rollout_pool/trainer",
                                                                                       self.t0, self.time_scale)
        # every worker is initialised up front and kept (auxiliaries passive)
        try:
            ray.get([a.hold.remote(0.0) for a in self.actors.values()], timeout=self.start_timeout)
        except Exception as exc:
            raise ClusterError(f"a worker failed to start: {exc}") from None

    def _begin(self):
        time.sleep(max(0.0, self.t0 - time.time()))

    def now(self) -> float:
        return (time.time() - self.t0) * self.time_scale

    def _group_lengths(self, gid):
        if gid not in self._lengths:
            from bidirl.control import group_lengths
            self._lengths[gid] = group_lengths(self.config, self.seed, gid)
        return self._lengths[gid]

    # rollout ------------------------------------------------------------------------------------
    def _rollout_report(self, worker, result):
        for kind, a, b, det in result.get("spans", []):
            self._span(worker, kind, a, b, det)
        for t, state, elapsed in result.get("finished", []):
            self._feed(P.GroupFinished(t, worker, state, elapsed))

    def _advance_call(self, worker):
        return self.actors[worker].advance.remote(self.max_wall)

    def _advanced(self, worker, result, starts_before):
        self.r_busy[worker] = self._still_busy(worker, result["busy"], starts_before)
        self._rollout_report(worker, result)

    def _do_Generate(self, cmd: P.Generate):
        tasks = [(t.group_id, *self._group_lengths(t.group_id), t.resume) for t in cmd.tasks]
        self.r_busy[cmd.worker] = True
        self._count_start(cmd.worker)
        self._submit(cmd.worker, self.actors[cmd.worker].start.remote(tasks, cmd.version), lambda _: None)
        self._ensure_advance(cmd.worker)

    def _do_Interrupt(self, cmd: P.Interrupt):
        starts = self.r_starts.get(cmd.worker, 0)

        def done(result):
            self._rollout_report(cmd.worker, result)
            self.r_busy[cmd.worker] = self._still_busy(cmd.worker, result["busy"], starts)
            self._feed(P.GenerationStopped(result["t"], cmd.worker, tuple(result["stopped"])))
            self._ensure_advance(cmd.worker)
        self._submit(cmd.worker, self.actors[cmd.worker].interrupt.remote(
            list(cmd.group_ids) if cmd.group_ids is not None else None), done)

    # trainer -------------------------------------------------------------------------------------
    def _do_RunChunk(self, cmd: P.RunChunk):
        ch = cmd.chunk
        p = [self._group_lengths(g)[0] for g, _ in ch.samples]
        r = [self._group_lengths(g)[1][i] for g, i in ch.samples]
        d = self.topology.trainer_replicas if P.is_primary(cmd.worker) else self.topology.aux_trainer_replicas
        seconds = self.models.chunk_time(ch.stage, p, r, d)
        self._feed(P.ChunkStarted(self.now(), cmd.worker, ch.chunk_id))

        def done(result):
            self._span(cmd.worker, "chunk", result["start"], result["end"],
                       {"stage": ch.stage, "chunk_id": ch.chunk_id, "samples": len(ch.samples)}, step=ch.step)
            self._feed(P.ChunkFinished(result["end"], cmd.worker, ch.chunk_id, result["end"] - result["start"],
                                       result["payload"]))
        self._submit(cmd.worker, self.actors[cmd.worker].run_chunk.remote(ch.chunk_id, seconds), done)

    def _do_CancelChunk(self, cmd: P.CancelChunk):
        """Chunks are handed to an actor only when it can start them, so nothing is queued to reclaim."""

    def _hold(self, worker, seconds, finish):
        start = self.now()
        self._submit(worker, self.actors[worker].hold.remote(seconds), lambda el: finish(start, start + el))

    def _do_Switch(self, cmd: P.Switch):
        lane = "trainer_pool/trainer" if cmd.pool == P.TRAINER_POOL else self.topology.rollouters[0]

        def finish(a, b):
            self._measure((cmd.direction, "c_in" if cmd.phase == "in" else "c_out"), b - a)
            self._span(lane, "switch_in" if cmd.phase == "in" else "switch_out", a, b, {"direction": cmd.direction})
            self._feed(P.SwitchFinished(b, cmd.pool, cmd.to_role, b - a))
        self._hold(lane, cmd.expected, finish)

    def _do_SyncWeights(self, cmd: P.SyncWeights):
        self.sync_left = len(cmd.targets)
        seconds = self.config.weight_sync_time()
        ends = []

        def finish(worker):
            def f(a, b):
                self._span(worker, "sync", a, b, {"version": cmd.version})
                ends.append((a, b))
                self.sync_left -= 1
                if self.sync_left == 0:
                    start, end = min(x for x, _ in ends), max(y for _, y in ends)
                    self._feed(P.SyncFinished(end, cmd.version, cmd.targets, end - start))
            return f
        for w in cmd.targets:
            self._hold(w, seconds, finish(w))

    def _do_MergeGradients(self, cmd: P.MergeGradients):
        def finish(a, b):
            self._measure(("trainer_on_rollout_pool", "c_grad"), b - a)
            self._span("trainer_pool/trainer", "grad_merge", a, b, {"chunks": len(cmd.chunk_ids)}, step=cmd.step)
            self._feed(P.GradientsMerged(b, cmd.step, b - a))
        self._hold("trainer_pool/trainer", cmd.expected, finish)

    def _do_OptimizerStep(self, cmd: P.OptimizerStep):
        def finish(a, b):
            self._span("trainer_pool/trainer", "optimizer", a, b, {}, step=cmd.step)
            self._feed(P.OptimizerStepped(b, cmd.step, cmd.version))
        self._hold("trainer_pool/trainer", self.control.optimizer_time(), finish)

    def _result(self) -> RunResult:
        summary = self._summary()
        summary["emulated"] = True
        summary["time_scale"] = self.time_scale
        return RunResult(self.policy_name, self.config, self.log, summary, self.coordinator)


def _root_cause(exc: Exception) -> str:
    """The innermost error message of a failed actor construction or call (one line)."""
    cause = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
    text = str(cause if cause is not None else exc)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln
    return lines[-1] if lines else type(exc).__name__


def run(config, policy: Optional[str] = None, *, steps: Optional[int] = None, seed: Optional[int] = None,
        emulate: bool = False, address: Optional[str] = None, time_scale: float = 20.0,
        model_dir: Optional[str] = None, progress: bool = False) -> RunResult:
    """Run a job on Ray (embedded local Ray unless ``address`` names a cluster).

    Engine workers (vLLM rollouters, torch trainers: :class:`~bidirl.cluster.engine_driver.EngineDriver`)
    by default; ``emulate=True`` runs model-timed workers (:class:`RayDriver`) at ``time_scale``.
    """
    cfg = cfgmod.load(config)
    policy = policy or cfg.scheduler.policy
    from bidirl.core.policies import get_policy
    try:
        get_policy(policy)
    except ValueError as exc:
        raise cfgmod.ConfigError("scheduler.policy", str(exc), "the Ray runtime runs the core policies") from None
    if time_scale <= 0:
        raise cfgmod.ConfigError("time_scale", f"must be > 0, got {time_scale}", "use e.g. 20 (virtual s per wall s)")
    steps = cfg.workload.steps if steps is None else int(steps)
    seed = cfg.seed if seed is None else int(seed)
    if not emulate:
        from bidirl.cluster.engine_driver import run_engines
        return run_engines(cfg, policy, steps=steps, seed=seed, address=address, progress=progress,
                           model_dir=model_dir)
    return RayDriver(cfg, policy, steps, seed, emulate=True, time_scale=time_scale, address=address).run(progress)
