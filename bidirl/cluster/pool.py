"""The Ray half every Ray driver shares: start-up, one placement group over the pools, the ``ray.wait`` loop.

Pools map to one placement group over ``G`` GPU slots, split by bundle index: bundles ``[0, g_r)`` are the rollout
pool, ``[g_r, G)`` the trainer pool (Ray's start-up and the slots: :mod:`bidirl.cluster.slots`). On each pool the
primary workers and the auxiliary workers of the other role are started once, each holding half of the
bundle it sits on, and are kept: a hot switch changes which one works, never restarts a process (§3.2). Engine
workers may be kept from one run to the next as well (:mod:`bidirl.cluster.kept_workers`).

Every timed command becomes one or more actor calls; their completion becomes the matching event, fed to the
coordinator through :meth:`bidirl.runtime.driver.Driver.feed`. Workers record their own spans and return them with
their results. A call may also be a stream (a Ray ``ObjectRefGenerator``: a rollouter that runs free, whose engine
loop yields groups as they finish): the same ``ray.wait`` waits on it, and each value it yields is handled as it
arrives (:meth:`PoolDriver._submit_stream`).

**Failures** (:mod:`bidirl.cluster.recovery`). A worker whose actor dies — or a trainer rank whose collective
breaks because a peer died — is reported to the coordinator as ``WorkerFailed``; the driver gives the rest of it
up, starts it afresh on the same bundles (``WorkerBackend.spawn``), brings it to the state it serves
(``WorkerBackend.restore``) and reports ``WorkerRestarted``; the coordinator re-dispatches its lost work. A worker
is restarted at most ``max_restarts`` times in a row (no whole step completed between its failures). A worker
whose call raised an error of its own (an engine or reward error, its process alive: not a lost process, nor a
collective broken by a lost peer) ends the run with a :class:`WorkerError` naming the
worker, the call and the traceback: restarting would only fail again.

**Checkpoints** (:mod:`bidirl.runtime.checkpoints`). With ``checkpoint_dir`` the driver writes a checkpoint at step
boundaries (every ``checkpoint_every`` steps and after the last, keeping ``keep``): just before a step's
``SyncFinished`` is fed, when the run is quiescent. With ``resume`` it continues from a checkpoint: the control
plane is restored, the workers start fresh and the trainer loads its state, and the boundary event is fed
instead of ``Started``, so step numbers, the event log and the clock continue where they stopped
(:mod:`bidirl.cluster.resume`).

Trainer chunks go through a queue per gang (paper Table 2): a ``RunChunk`` for a gang that is busy waits in the
driver as ``queued`` — a ``CancelChunk`` then reclaims it and answers ``ChunkCancelled`` — and starts
(``ChunkStarted``) when the gang's previous chunk finishes.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from bidirl.cluster.backend import WorkerBackend
from bidirl.cluster.errors import ClusterError
from bidirl.cluster.kept_workers import KeptWorkers, Workers, ray_job
from bidirl.cluster import resume
from bidirl.cluster.recovery import MAX_RESTARTS, Restarts
from bidirl.cluster.worker_failures import WorkerFailures
from bidirl.core import protocol as P
from bidirl.results.run_result import RunResult
from bidirl.results.trace import EventLog
from bidirl.runtime import checkpoints
from bidirl.runtime.driver import Driver, RunListener, progress_bar
from bidirl.cluster.slots import RaySlots


class WorkInFlight(RunListener):
    """The Ray shell's record of what is in flight, kept from the protocol's traffic: the switch on each pool,
    the weight sync, which workers are passive (offloaded), and where each step's spans end in the log."""

    def on_event(self, d: "PoolDriver", event) -> None:
        d.loop_stats["events"] += 1
        if isinstance(event, P.SyncFinished):
            d.syncing = None
        elif isinstance(event, P.SwitchFinished):
            d.switching.pop(event.pool, None)

    def on_command(self, d: "PoolDriver", command) -> None:
        if isinstance(command, P.Switch):
            d.switching[command.pool] = command
            passive, active = d.switch_sides(command)
            d.passive.update({w: True for w in passive})
            d.passive.update({w: False for w in active})
        elif isinstance(command, P.SyncWeights):
            d.syncing = command

    def on_report(self, d: "PoolDriver", report) -> None:
        if isinstance(report, P.StepDone):
            d.step_marks.append((len(d.log.spans), len(d.log.decisions)))


class StepMetricsOutput(RunListener):
    """The run's output folder (``--out``, :mod:`bidirl.results.tracking`), written while the run goes on: a row
    of per-step metrics after every ``StepDone``, the rest when the run ends (:meth:`close`)."""

    def __init__(self, driver: "PoolDriver"):
        from bidirl.results import tracking
        pools = [p for p, n in driver.assembly.pool_gpus.items() if n > 0]
        self.metrics = tracking.LiveStepMetrics(tracking.RunOutput(driver.out_dir, driver.config), driver.config,
                                                pools)
        log = driver.log
        for k, (spans, decisions) in enumerate(driver.step_marks):      # a resumed run writes every step's row
            self.metrics.step_done(EventLog(spans=log.spans[:spans], steps=log.steps[:k + 1],
                                            decisions=log.decisions[:decisions]), driver.train_stats())

    def on_report(self, driver: "PoolDriver", report) -> None:
        if isinstance(report, P.StepDone):
            self.metrics.step_done(driver.log, driver.train_stats())

    def close(self, driver: "PoolDriver") -> None:
        """Write the rest of the output folder. A run that failed keeps its error: a problem writing the
        outputs then only warns."""
        try:
            self.metrics.close(driver.log, driver.train_stats(), driver.summary() if driver.finished else None)
        except Exception as exc:
            if driver.finished:
                raise
            warnings.warn(f"could not write the run's outputs to {driver.out_dir}: {exc}", RuntimeWarning,
                          stacklevel=2)


@dataclass
class PoolDriver(WorkerFailures, resume.Resumable, Driver):
    """What every Ray driver shares (module doc), with one :class:`~bidirl.cluster.backend.WorkerBackend` plugged in
    (``backend``) for what its kind of worker does: the drivers of each kind (``EmulatedDriver``, ``EngineDriver``)
    add their settings and plug their backend in; they override none of the pool driver's methods.

    ``out_dir``: the run's output folder (per-step metrics, TensorBoard, trace, summary; written as it runs);
    ``checkpoint_dir`` / ``checkpoint_every`` / ``keep``: write checkpoints (module doc); ``resume``: a checkpoint
    folder (or one ``step-*`` checkpoint) to continue from; ``max_restarts``: restarts allowed per worker in a row
    (:mod:`bidirl.cluster.recovery`)."""
    address: Optional[str] = None
    start_timeout: float = 120.0
    stall_timeout: float = 60.0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 1
    keep: int = 3
    resume: Optional[str] = None
    out_dir: Optional[str] = None
    max_restarts: int = MAX_RESTARTS
    kept_workers: Optional[KeptWorkers] = None

    label = "ray"
    #: every kind of worker brings an auxiliary trainer gang to the primaries' weights after each optimizer step
    #: that keeps the version (``backend.refresh_weights``), so the coordinator follows one rule for all Ray runs
    #: (:mod:`bidirl.core.aux_weights`), the simulator's
    refreshes_aux_weights = True

    def __post_init__(self):
        super().__post_init__()
        self.backend: Optional[WorkerBackend] = None     # plugged in by the driver of each kind of worker
        self.pending: dict = {}           # object ref -> (worker, incarnation, callback, on_error)
        self.streams: dict = {}           # ObjectRefGenerator -> (worker, incarnation, on_item, on_end)
        self.actors: dict = {}            # worker -> its actor
        self.gangs: dict = {}             # trainer gang -> its ranks' actors (engine runs)
        self.measured: dict = {}          # (direction | "start" | ..., which) -> [seconds]
        self.failed: set = set()          # workers reported to the coordinator as failed
        # the GPU slots: Ray's start-up, the placement group, where each actor goes (bidirl.cluster.slots)
        self.slots = RaySlots(self.config, lambda: self.backend.uses_gpus)
        self.t0 = time.time()
        self.progress = False
        self.r_busy: dict = {}            # rollouter -> whether it holds requests
        self.r_advancing: dict = {}       # rollouter -> whether a generation call (a slice or a stream) is in flight
        self.r_starts: dict = {}          # rollouter -> number of start calls sent to its current process
        self.r_calls: dict = {}           # rollouter -> {"starts", "advances"}: calls sent over the run (summary)
        self.chunk_queue: dict = {}       # gang -> deque of queued RunChunk commands
        self.chunk_running: dict = {}     # gang -> the RunChunk it executes
        self.restarts = Restarts(self.max_restarts)
        # whether each worker's pool has it offloaded (auxiliaries start so); a restarted worker is brought there
        self.passive: dict = {w: not P.is_primary(w) for w in self.topology.workers}
        self.switching: dict = {}         # pool -> the Switch in flight on it
        self.syncing: Optional[P.SyncWeights] = None     # the weight sync in flight
        self.step_marks: list = []        # (spans, decisions) in the log when each step finished
        self.step_stats: list = []        # per-step training statistics (engine runs: reward, loss, ...)
        self.final_weights = None         # the final actor weights, where the workers hold real ones
        self.clock_start = 0.0            # the timeline's time when this run starts (a resumed run continues it)
        self.boundary = None              # the step boundary a resumed run starts from (its SyncFinished)
        self.resumed_from: Optional[checkpoints.Checkpoint] = None
        if self.resume is not None:
            checkpoints.check_source(self.resume)        # before the writer creates a folder of that name
        if self.out_dir is not None:
            from bidirl.results.tracking import check_out_dir
            check_out_dir(self.out_dir)                  # before any worker starts
        self.output: Optional[StepMetricsOutput] = None  # the output folder's writer, opened when the run begins
        # side effects of the run hang on the protocol's traffic as listeners (bidirl.runtime.driver.RunListener)
        self.add_listener(WorkInFlight())
        self.writer = (checkpoints.CheckpointWriter(self.checkpoint_dir, self.checkpoint_every, self.keep)
                       if self.checkpoint_dir is not None else None)
        if self.writer is not None:
            self.add_listener(checkpoints.Checkpointing(self.writer))
        self.workers: Optional[Workers] = None       # the kept workers this run took (kept_workers)
        self._identity: Optional[checkpoints.RunIdentity] = None
        # wall time of the ray.wait loop: waiting for replies, and handling them (driver + coordinator)
        self.loop_stats: dict = {"wait_s": 0.0, "handle_s": 0.0, "replies": 0, "calls": 0, "events": 0}

    # ------------------------------------------------------------------------------------------
    # the GPU slots (bidirl.cluster.slots)
    # ------------------------------------------------------------------------------------------
    def _take_slots(self) -> None:
        """The run's placement group: the kept workers' (with them) when a kept set matches the job, else reserved."""
        if self.kept_workers is not None:
            self.workers = self.kept_workers.take(self.worker_shape())
        if self.workers is not None:
            self.slots.pg = self.workers.pg
            return
        self.slots.reserve(self.start_timeout)

    def worker_shape(self) -> dict:
        """What kept workers must have been started for to serve this run (layout and engine settings)."""
        return {"driver": self.label, "resource": self.slots.resource(), "bundle_cpus": self.slots.bundle_cpus(),
                **self.layout(),
                **self.backend.shape()}

    def now(self) -> float:
        """The run's clock: seconds since ``t0``, in the backend's virtual seconds (``time_scale``)."""
        return (time.time() - self.t0) * self.backend.time_scale

    # ------------------------------------------------------------------------------------------
    # calls in flight
    # ------------------------------------------------------------------------------------------
    def _submit(self, worker: str, ref, callback, on_error: Optional[Callable] = None):
        """Track a call on ``worker``'s current process: ``callback(value)`` when it completes. If the worker
        fails, or failed since the call was sent, the call is void: ``on_error()`` runs instead (for calls whose
        completion others wait on), and a failure of the current process restarts the worker."""
        self.pending[ref] = (worker, self.restarts.incarnation(worker), callback, on_error)
        self.loop_stats["calls"] += 1

    def _submit_stream(self, worker: str, stream, on_item, on_end) -> None:
        """Track a streaming call on ``worker``'s current process (a Ray ``ObjectRefGenerator``): ``on_item(value)``
        for each value it yields, in order, then ``on_end()``. If the worker fails, or failed since the call was
        sent, the stream is void (neither runs again), and a failure of the current process restarts the worker."""
        self.streams[stream] = (worker, self.restarts.incarnation(worker), on_item, on_end)
        self.loop_stats["calls"] += 1

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

    def _measure(self, key, seconds):
        self.measured.setdefault(key, []).append(seconds)

    def _alive(self, workers) -> list:
        return [w for w in workers if w not in self.failed]

    def switch_sides(self, cmd: P.Switch) -> tuple:
        """The workers a switch offloads (passive) and onloads (active): a pool's trainer gang and its rollouters."""
        rollouters = self.topology.aux_rollouters if cmd.pool == P.TRAINER_POOL else self.topology.rollouters
        trainer = P.trainer_gang(cmd.pool)
        if cmd.to_role == P.ROLLOUT:
            return [trainer], list(rollouters)
        return list(rollouters), [trainer]

    # ------------------------------------------------------------------------------------------
    # the commands: the backend does the work (bidirl.cluster.backend)
    # ------------------------------------------------------------------------------------------
    def do_Generate(self, cmd: P.Generate):
        self.backend.generate(cmd)

    def do_Interrupt(self, cmd: P.Interrupt):
        self.backend.interrupt(cmd)

    def do_StartStep(self, cmd: P.StartStep):
        self.backend.start_step(cmd)

    def do_Switch(self, cmd: P.Switch):
        self.backend.switch(cmd)

    def do_SyncWeights(self, cmd: P.SyncWeights):
        self.backend.sync_weights(cmd)

    def do_MergeGradients(self, cmd: P.MergeGradients):
        self.backend.merge_gradients(cmd)

    def do_OptimizerStep(self, cmd: P.OptimizerStep):
        self.backend.optimizer_step(cmd)

    def do_RefreshWeights(self, cmd: P.RefreshWeights):
        self.backend.refresh_weights(cmd)

    # ------------------------------------------------------------------------------------------
    # rollouters: the generation calls sent to each (the backend keeps a busy one generating)
    # ------------------------------------------------------------------------------------------
    def _count_start(self, worker: str) -> None:
        self.r_starts[worker] = self.r_starts.get(worker, 0) + 1
        self._count_call(worker, "starts")

    def _count_call(self, worker: str, kind: str) -> None:
        calls = self.r_calls.setdefault(worker, {"starts": 0, "advances": 0})
        calls[kind] += 1

    def _still_busy(self, worker: str, reported: bool, starts_before: int) -> bool:
        """Whether a rollouter is busy after a call that reported ``reported``: a start sent while the call was
        in flight runs after it on the actor, so the report cannot have seen its requests."""
        return bool(reported) or self.r_starts.get(worker, 0) != starts_before

    # ------------------------------------------------------------------------------------------
    # trainer gangs: a queue of chunks each (Table 2's queued / running / cancelled)
    # ------------------------------------------------------------------------------------------
    def do_RunChunk(self, cmd: P.RunChunk):
        self.chunk_queue.setdefault(cmd.worker, deque()).append(cmd)
        self._next_chunk(cmd.worker)

    def do_CancelChunk(self, cmd: P.CancelChunk):
        """A chunk still queued in the driver is released (``ChunkCancelled``); a running one finishes."""
        queue = self.chunk_queue.get(cmd.worker, ())
        for queued in list(queue):
            if queued.chunk.chunk_id == cmd.chunk_id:
                queue.remove(queued)
                self.feed(P.ChunkCancelled(self.now(), cmd.worker, cmd.chunk_id))
                return

    def _next_chunk(self, gang: str) -> None:
        queue = self.chunk_queue.get(gang)
        if gang in self.chunk_running or not queue or gang in self.failed:
            return
        cmd = self.chunk_running[gang] = queue.popleft()
        self.feed(P.ChunkStarted(self.now(), gang, cmd.chunk.chunk_id))
        self.backend.run_chunk(cmd)

    def _chunk_done(self, cmd: P.RunChunk, start: float, end: float) -> None:
        """The gang ran ``cmd`` over ``[start, end]``: record it, tell the coordinator, start the next chunk."""
        self.chunk_running.pop(cmd.worker, None)
        self.record_chunk(cmd, start, end)
        self.feed(P.ChunkFinished(max(end, self.now()), cmd.worker, cmd.chunk.chunk_id, end - start))
        self._next_chunk(cmd.worker)

    # ------------------------------------------------------------------------------------------
    def run(self, progress: bool = False, kill: Optional[Callable] = None) -> RunResult:
        """Run to the configured number of steps. ``kill(driver)`` is polled each loop (fault tests)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        self.progress = progress
        self._load_resume()
        self.slots.start(self.address)
        try:
            self._take_slots()
            self.backend.place()
            self.backend.begin()
            if self.out_dir is not None:
                self.output = self.add_listener(StepMetricsOutput(self))
            with progress_bar(self.steps, f"run {self.policy_name} ({self.label})", progress) as tick:
                tick(self.steps_done)
                if self.boundary is None:
                    self.feed(P.Started(self.now()))
                else:
                    # the coordinator expects (and its gates charge) what is left of the fresh workers' first-switch
                    # allocations from the boundary on, as the workers reserve them
                    self.feed(P.Resumed(self.clock_start, tuple(sorted(self.assembly.first_switch.items()))))
                    self.feed(self.boundary)
                    # workers that were being restarted when the checkpoint was written are fresh ones now
                    for w in self.coordinator.view().failed:
                        self.feed(P.WorkerRestarted(self.now(), w))
                while self.pending or self.streams:
                    t_wait = time.perf_counter()
                    ready, _ = ray.wait(list(self.pending) + list(self.streams), num_returns=1,
                                        timeout=self.stall_timeout)
                    t_ready = time.perf_counter()
                    self.loop_stats["wait_s"] += t_ready - t_wait
                    self.loop_stats["replies"] += len(ready)
                    if not ready:
                        raise ClusterError(f"no worker answered for {self.stall_timeout:.0f} s at step "
                                           f"{self.steps_done}; the job is stuck")
                    for ref in ready:
                        if ref in self.streams:
                            self._stream_ready(ref)
                            continue
                        worker, incarnation, callback, on_error = self.pending.pop(ref)
                        current = incarnation == self.restarts.incarnation(worker)
                        try:
                            value = ray.get(ref)
                        except (RayActorError, RayTaskError) as exc:
                            if current:
                                self._call_failed(worker, exc)
                            value, current = None, False
                        if not current:          # the worker failed: its calls are void
                            if on_error is not None:
                                on_error()
                            continue
                        callback(value)
                    self.loop_stats["handle_s"] += time.perf_counter() - t_ready
                    if kill is not None:
                        kill(self)
                    tick(self.steps_done)
        finally:
            self.shutdown()
        return self.result()

    def _stream_ready(self, stream) -> None:
        """A stream's next value (or its end) is ready: report it, and keep waiting for the next one."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        worker, incarnation, on_item, on_end = self.streams.pop(stream)
        current = incarnation == self.restarts.incarnation(worker)
        try:
            ref = next(stream)
        except StopIteration:
            if current:
                on_end()
            return
        try:
            value = ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            if current:
                self._call_failed(worker, exc)
            return
        if current:                    # else the worker failed: its calls are void
            self.streams[stream] = (worker, incarnation, on_item, on_end)
            on_item(value)

    def result(self, **extra) -> RunResult:
        if not self.finished:
            raise ClusterError(f"the run ended after {self.steps_done} of {self.steps} steps with no work left; "
                               "this is a scheduler bug — please report it with the event log")
        return super().result(weights=self.final_weights, **extra)

    def train_stats(self) -> list:
        """Per-step training statistics for the output folder's rows (engine runs: reward, loss, ...)."""
        return self.step_stats

    def shutdown(self):
        self.backend.close()
        self._stop_workers()
        if self.output is not None:
            output, self.output = self.output, None
            self.remove_listener(output)
            output.close(self)

    def _stop_workers(self):
        import ray
        if self.kept_workers is not None and self.finished and self.slots.pg is not None:
            self.kept_workers.give(Workers(self.slots.pg, dict(self.actors),
                                           {g: list(r) for g, r in self.gangs.items()}, self.worker_shape(), ray_job()))
            self.slots.pg = None
            return
        for a in self._all_actors():
            try:
                ray.kill(a)
            except Exception:
                pass
        try:
            self.slots.release()
        except Exception:
            pass

    def _all_actors(self) -> list:
        """Every actor of the run, once each (the rollouters, then each gang's ranks; a process several workers
        share counts once)."""
        every = list(self.actors.values()) + [r for ranks in self.gangs.values() for r in ranks]
        return list({id(a): a for a in every}.values())

    def rollout_calls(self) -> dict:
        """Generation calls sent over the run, in all and per rollouter: ``starts`` (one per ``Generate``),
        ``advances`` (slices or streams that kept the rollouters generating) and the engine ``steps`` their
        ``generate`` spans record (when they record them)."""
        steps: dict = {}
        for sp in self.log.spans:
            if sp.kind == "generate" and "steps" in sp.detail:
                steps[sp.worker] = steps.get(sp.worker, 0) + int(sp.detail["steps"])
        per = {w: dict(c, steps=steps.get(w, 0)) for w, c in sorted(self.r_calls.items())}
        total = {k: sum(c[k] for c in per.values()) for k in ("starts", "advances", "steps")}
        return dict(total, rollouters=per)

    def summary(self) -> dict:
        """The run summary plus ``costs``: measured C_in / C_out / C_grad per direction (medians)."""
        import numpy as np
        out = super().summary()
        costs = {}
        for (direction, which), values in sorted(self.measured.items()):
            costs.setdefault(direction, {})[which] = float(np.median(values))
        out["costs"] = costs
        out["recoveries"] = list(self.restarts.record)
        out["rollout_calls"] = self.rollout_calls()
        if self.resumed_from is not None:
            out["resumed_from"] = {"checkpoint": str(self.resumed_from.path), "step": self.resumed_from.step}
        if self.out_dir is not None:
            out["out_dir"] = str(self.out_dir)
        self.backend.summarize(out)
        return out
