"""The Ray half every Ray driver shares: start-up, one placement group over the pools, the ``ray.wait`` loop.

Pools map to one placement group over ``G`` GPU slots — the logical resource ``gpu_slot`` on a machine
without GPUs, ``GPU`` on real hardware — reserved once (placement groups cannot be resized) and split by
bundle index: bundles ``[0, g_r)`` are the rollout pool, ``[g_r, G)`` the trainer pool. On each pool the
primary workers and the auxiliary workers of the other role are started once, each holding half of the
bundle it sits on, and are kept: a hot switch changes which one works, never restarts a process (§3.2).

Every timed command becomes one or more actor calls; their completion becomes the matching event, fed to the
coordinator through :meth:`bidirl.execution.Driver.feed`. Workers record their own spans and return them with
their results. A worker whose actor dies is reported to the coordinator as ``WorkerFailed``; auxiliary work
is recovered on the primaries.

Trainer chunks go through a queue per gang (paper Table 2): a ``RunChunk`` for a gang that is busy waits in the
driver as ``queued`` — a ``CancelChunk`` then reclaims it and answers ``ChunkCancelled`` — and starts
(``ChunkStarted``) when the gang's previous chunk finishes.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from bidirl.core import protocol as P
from bidirl.execution import Driver, RunResult, progress_bar


class ClusterError(RuntimeError):
    """The cluster cannot run the job as configured (resources, worker start-up, a failed primary)."""


def root_cause(exc: Exception) -> str:
    """The innermost error message of a failed actor construction or call (one line)."""
    cause = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
    text = str(cause if cause is not None else exc)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln
    return lines[-1] if lines else type(exc).__name__


@dataclass
class PoolDriver(Driver):
    """What every Ray driver shares (module doc). Subclasses place their workers (``_place``), run a chunk
    on a gang (``_run_chunk``), keep a rollouter generating (``_advance_call`` / ``_advanced``) and handle the
    remaining commands (``do_<Command>``)."""
    address: Optional[str] = None
    start_timeout: float = 120.0
    stall_timeout: float = 60.0

    label = "ray"

    def __post_init__(self):
        super().__post_init__()
        self.pending: dict = {}           # object ref -> (worker, callback, on_error)
        self.actors: dict = {}
        self.measured: dict = {}          # (direction | "start" | ..., which) -> [seconds]
        self.failed: set = set()          # workers reported to the coordinator as failed
        self.pg = None
        self.t0 = time.time()
        self.progress = False
        self.r_busy: dict = {}            # rollouter -> whether it holds requests
        self.r_advancing: dict = {}       # rollouter -> whether a generation call is in flight
        self.r_starts: dict = {}          # rollouter -> number of start calls sent (see _still_busy)
        self.chunk_queue: dict = {}       # gang -> deque of queued RunChunk commands
        self.chunk_running: dict = {}     # gang -> the RunChunk it executes

    # ------------------------------------------------------------------------------------------
    # Ray start-up and placement
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

    def _begin(self):
        """Called after placement, right before ``Started``."""

    def now(self) -> float:
        return time.time() - self.t0

    # ------------------------------------------------------------------------------------------
    # calls in flight
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

    def _measure(self, key, seconds):
        self.measured.setdefault(key, []).append(seconds)

    def _alive(self, workers) -> list:
        return [w for w in workers if w not in self.failed]

    def _worker_failed(self, worker: str, exc: Exception):
        """A call on ``worker`` raised because its actor died: tell the coordinator (once)."""
        self.r_busy[worker] = self.r_advancing[worker] = False
        self.chunk_queue.pop(worker, None)
        self.chunk_running.pop(worker, None)
        if worker not in self.failed:
            self.failed.add(worker)
            self.feed(P.WorkerFailed(self.now(), worker, str(exc).splitlines()[0]))

    # ------------------------------------------------------------------------------------------
    # rollouters: one generation call in flight per busy rollouter
    # ------------------------------------------------------------------------------------------
    def _count_start(self, worker: str) -> None:
        self.r_starts[worker] = self.r_starts.get(worker, 0) + 1

    def _still_busy(self, worker: str, reported: bool, starts_before: int) -> bool:
        """Whether a rollouter is busy after a call that reported ``reported``: a start sent while the call was
        in flight runs after it on the actor, so the report cannot have seen its requests."""
        return bool(reported) or self.r_starts.get(worker, 0) != starts_before

    def _ensure_advance(self, worker: str):
        """Keep a busy rollouter generating: one ``_advance_call`` in flight, reported to ``_advanced``."""
        if self.r_advancing.get(worker) or not self.r_busy.get(worker) or worker in self.failed:
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
        self._run_chunk(cmd)

    def _run_chunk(self, cmd: P.RunChunk) -> None:
        """Start ``cmd`` on its gang; call :meth:`_chunk_done` when it has run."""
        raise NotImplementedError

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
        self._start_ray()
        try:
            self._reserve()
            self._place()
            self._begin()
            with progress_bar(self.steps, f"run {self.policy_name} ({self.label})", progress) as tick:
                self.feed(P.Started(self.now()))
                while self.pending:
                    ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=self.stall_timeout)
                    if not ready:
                        raise ClusterError(f"no worker answered for {self.stall_timeout:.0f} s at step "
                                           f"{self.steps_done}; the job is stuck")
                    for ref in ready:
                        worker, callback, on_error = self.pending.pop(ref)
                        try:
                            value = ray.get(ref)
                        except (RayActorError, RayTaskError) as exc:
                            died = isinstance(exc, RayActorError)
                            if not died and P.is_primary(worker):
                                raise ClusterError(f"worker {worker} failed: {root_cause(exc)}") from exc
                            # an auxiliary worker that died or whose call failed (e.g. a collective broken by a
                            # dead peer) is given up: the coordinator recovers its work on the primaries
                            self._worker_failed(worker, exc)
                            if on_error is not None:
                                on_error()
                            continue
                        callback(value)
                    if kill is not None:
                        kill(self)
                    tick(self.steps_done)
        finally:
            self.shutdown()
        return self.result()

    def result(self, **extra) -> RunResult:
        if not self.finished:
            raise ClusterError(f"the run ended after {self.steps_done} of {self.steps} steps with no work left; "
                               "this is a scheduler bug — please report it with the event log")
        return super().result(**extra)

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

    def summary(self) -> dict:
        """The run summary plus ``costs``: measured C_in / C_out / C_grad per direction (medians)."""
        import numpy as np
        out = super().summary()
        costs = {}
        for (direction, which), values in sorted(self.measured.items()):
            costs.setdefault(direction, {})[which] = float(np.median(values))
        out["costs"] = costs
        return out
