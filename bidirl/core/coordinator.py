"""The control plane: event handlers that turn driver events into commands (paper §3-§5).

The coordinator owns the rollout buffer and staleness rule (:mod:`~bidirl.core.buffer`,
:mod:`~bidirl.core.staleness`), one lease per pool (:mod:`~bidirl.core.lease`), the trainer's chunk queue
(:mod:`~bidirl.core.chunks`) and the online profiler (:mod:`~bidirl.core.profiler`); the decisions themselves
are the pure functions of :mod:`~bidirl.core.gates`. It has no clock, threads, sleeps or Ray: a driver calls
:meth:`Coordinator.handle` with an event and executes the commands returned, in order (the messages are in
:mod:`~bidirl.core.protocol`).

Life of a training step ``k`` (trainer holds version ``v = k``):

1. *wait* — until the buffer can form a batch under the staleness rule. While the trainer pool idles,
   **Rollouter-on-TrainerPool** may lend it to auxiliary rollouters (admission Eq. 3, dispatch Eq. 4);
   the lease is revoked when the batch is ready or the auxiliaries finish their share, complete groups stay
   committed, incomplete ones go back to primary rollouters with their prefixes.
2. *consume* — ``StartStep``, then stage-ordered chunks on the primary trainers. While the rollout pool
   idles (rollouters blocked by the run-ahead bound), **Trainer-on-RolloutPool** may lend it to auxiliary
   trainers (Algorithm 2: DrainPrefix, admission, LazyPull, TailWindow + JointTailSplit); auxiliary
   actor-update gradients are merged in chunk order (C_grad) before the primary's optimizer step.
3. *sync* — the new version goes to the primary rollouters; with partial rollout they are interrupted
   first and their unfinished groups resume afterwards from their prefixes, without it the sync waits for
   in-flight generation to finish. Then ``StepDone``.
"""

from __future__ import annotations

import enum
import functools
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from bidirl.core import gates
from bidirl.core import protocol as P
from bidirl.core.buffer import RolloutBuffer
from bidirl.core.chunks import TrainerStep
from bidirl.core.lease import Lease, PoolLease
from bidirl.core.policies import Policy
from bidirl.core.profiler import ProfileRecord, Profiler
from bidirl.core.schedule import SCHEDULE_RULE, Reproducibility
from bidirl.core.staleness import StalenessRule, check_batch

ROT, TOR = P.ROLLOUT_ON_TRAINER_POOL, P.TRAINER_ON_ROLLOUT_POOL


class Phase(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting"          # for a batch
    CONSUMING = "consuming"      # running the step's chunks
    FINISHING = "finishing"      # gradient merge and optimizer step
    SYNCING = "syncing"          # pushing the new weights
    ROLLING_BACK = "rolling_back"  # the primary trainer failed mid-step: the step starts over once it is back
    DONE = "done"


@dataclass(frozen=True)
class Topology:
    """Replica counts induced by the planner's envelope (§4): who can run on which pool."""
    rollout_replicas: int          # d_r: primary rollouters on the rollout pool
    trainer_replicas: int          # d_t: primary trainer replicas on the trainer pool
    aux_rollout_replicas: int      # rollout replicas the trainer pool can host (g_t / ρ_r)
    aux_trainer_replicas: int      # trainer replicas the rollout pool can host (g_r / ρ_t)
    trainer_layout: int = 1        # ρ_t: devices per trainer replica

    @functools.cached_property
    def rollouters(self) -> tuple:
        return tuple(P.rollouter(P.ROLLOUT_POOL, i) for i in range(self.rollout_replicas))

    @functools.cached_property
    def aux_rollouters(self) -> tuple:
        return tuple(P.rollouter(P.TRAINER_POOL, i) for i in range(self.aux_rollout_replicas))

    @functools.cached_property
    def rollouter_set(self) -> frozenset:
        return frozenset(self.rollouters)

    @functools.cached_property
    def aux_rollouter_set(self) -> frozenset:
        return frozenset(self.aux_rollouters)

    @functools.cached_property
    def trainers(self) -> tuple:
        """The trainer gangs: the primary one, and the auxiliary one if the rollout pool can host it."""
        return (P.PRIMARY_TRAINER,) + ((P.AUX_TRAINER,) if self.aux_trainer_replicas else ())

    @functools.cached_property
    def workers(self) -> tuple:
        return self.rollouters + self.aux_rollouters + self.trainers

    def gang_size(self, worker: str) -> int:
        """Replicas of a trainer gang."""
        return self.trainer_replicas if P.is_primary(worker) else self.aux_trainer_replicas


@dataclass(frozen=True)
class Settings:
    batch: int                     # B_p groups per step
    group_size: int
    staleness: float
    partial_rollout: bool
    stages: tuple
    micro_batch_per_device: int                 # s_max, samples per device per chunk: the trainer's micro-batch
    tail_window: int
    steps: int
    chunks_in_flight: int = 1      # chunks kept sent to each gang (the asynchronous chunk pipeline, §6)
    optimizer_seconds: float = 0.0 # predicted optimizer step (overlaps C_out when a window ends with the step)
    max_tokens_per_micro_batch: Optional[int] = None  # token-budget micro-batches (None: s_max samples per device)
    sequence_parallel: int = 1     # Ulysses degree: a chunk holds one micro-batch per sequence-parallel group
    updates_per_sync: int = 1      # streaming consumption: local updates of batch / updates_per_sync groups per step
    reproducible: bool = False     # batches, versions and chunks fixed by rule, not by timing (bidirl.core.schedule)


@dataclass(frozen=True)
class CoordinatorView:
    """A read-only snapshot for widgets, tests and run summaries (plain data; see :meth:`Coordinator.view`)."""
    phase: str
    finished: bool
    steps_done: int
    trainer_version: int
    rollout_version: int
    leases: dict                   # pool -> lease state name
    failed: tuple
    samples: dict                  # generated, consumed, buffered, lost, duplicated (samples = responses)
    calibration: dict              # the online profiler's factors and charged switch costs
    profile: tuple                 # the online profiler's records (ProfileRecord: observed next to predicted)
    batches: tuple                 # (step, version, group ids) of every consumed batch
    merge_log: tuple               # (step, [(segment, first unit) of each chunk in merge order])
    reproducibility: dict = field(default_factory=dict)  # the mode, whether the run was, what made it depend on timing


@dataclass
class Coordinator:
    """``predictor`` predicts raw stage times: ``chunk_time(stage, prompt_lens, response_lens, d)`` and
    ``rollout_time(prompt_lens, response_lens, d)``; ``prior`` is a (prompt_lens, response_lens) sample of
    the workload used until the profiler has seen real responses."""
    settings: Settings
    topology: Topology
    policy: Policy
    predictor: Any
    profiler: Profiler
    prior: tuple

    # state --------------------------------------------------------------------------------------
    trainer_version: int = 0
    rollout_version: int = 0
    phase: Phase = Phase.STARTING
    steps_done: int = 0
    step: Optional[TrainerStep] = None
    step_start: float = 0.0
    consume_start: float = 0.0
    local_update: int = 0                             # streaming: the step's local update under way (0-based)
    step_groups: list = field(default_factory=list)   # streaming: the groups the step's local updates consumed
    evaluated: set = field(default_factory=set)       # (direction, step, idle window) opportunities decided
    idle_windows: dict = field(default_factory=lambda: {P.ROLLOUT_POOL: 0, P.TRAINER_POOL: 0})  # per pool
    stopping: set = field(default_factory=set)        # rollout workers with an Interrupt in flight
    aux_assigned: set = field(default_factory=set)    # groups sent to auxiliary rollouters this window
    migrating: set = field(default_factory=set)       # groups being moved from primaries to auxiliaries
    window_sent: dict = field(default_factory=dict)   # pool -> work items sent to its guests in the open window
    no_work: dict = field(default_factory=dict)       # pool -> why its revoked window sent its guests nothing
    dropping: set = field(default_factory=set)        # groups to discard when their interrupt answers
    sync_wanted: bool = False
    failed: set = field(default_factory=set)
    samples_generated: int = 0
    batches: list = field(default_factory=list)       # (step, version, [group ids])
    merge_log: list = field(default_factory=list)     # (step, [(segment, first unit) in merge order])

    def __post_init__(self):
        s = self.settings
        self.rule = StalenessRule(s.staleness, s.batch)
        self.buffer = RolloutBuffer(self.rule)
        self.repro = Reproducibility.of(s, self.topology, self.policy)
        self.leases = {pool: PoolLease(pool) for pool in P.POOLS}
        self._chunk_ids = itertools.count()
        self._out: list = []
        self._now = 0.0

    def __setstate__(self, state: dict) -> None:
        """Unpickle (a checkpoint's control plane); one written before the reproducible mode existed was out of it."""
        self.__dict__.update(state)
        if "repro" not in state:
            self.repro = Reproducibility.of(self.settings, self.topology, self.policy)

    # =============================================================================================
    # the protocol entry point and the read-only view
    # =============================================================================================
    def handle(self, event) -> list:
        """Feed one event; returns the commands and reports for the driver, in order."""
        self._out = []
        self._now = event.t
        method = getattr(self, "_on_" + type(event).__name__, None)
        if method is None:
            raise TypeError(f"the coordinator does not handle {type(event).__name__}")
        method(event)
        self._yield_revoked()
        out, self._out = self._out, []
        return out

    def view(self) -> CoordinatorView:
        """Plain data about where the run stands (the only state outside the protocol anyone may read)."""
        c = self.buffer.counts()
        g = self.settings.group_size
        consumed, buffered = c["consumed"] * g, c["complete"] * g
        return CoordinatorView(
            phase=self.phase.value, finished=self.phase is Phase.DONE, steps_done=self.steps_done,
            trainer_version=self.trainer_version, rollout_version=self.rollout_version,
            leases={pool: lease.state.value for pool, lease in self.leases.items()},
            failed=tuple(sorted(self.failed)),
            samples={"generated": self.samples_generated, "consumed": consumed, "buffered": buffered,
                     "lost": self.samples_generated - consumed - buffered,
                     "duplicated": self.buffer.duplicates * g},
            calibration=self.profiler.summary(), profile=tuple(self.profiler.records),
            batches=tuple((s, v, tuple(ids)) for s, v, ids in self.batches),
            merge_log=tuple((s, tuple(order)) for s, order in self.merge_log),
            reproducibility=self.repro.summary())

    # =============================================================================================
    # event handlers
    # =============================================================================================
    def _on_Started(self, ev: P.Started):
        self.phase = Phase.WAITING
        self.step_start = ev.t
        self._dispatch_rollouts()
        self._try_start_step()

    def _on_GroupFinished(self, ev: P.GroupFinished):
        self._commit(ev.group)
        self.aux_assigned.discard(ev.group.group_id)
        # with an asynchronous driver a group can complete while an Interrupt to migrate it is in flight:
        # there is nothing left to move, and the interrupt's answer will not list it
        self.migrating.discard(ev.group.group_id)
        self._after_rollout_change()

    def _on_GenerationStopped(self, ev: P.GenerationStopped):
        self.stopping.discard(ev.worker)
        for g in ev.groups:
            if g.complete:
                self._commit(g)
            elif g.group_id in self.dropping:
                self.dropping.discard(g.group_id)
                self.buffer.drop(g.group_id)
            else:
                self.buffer.park(g)
        handing_over = self.leases[P.TRAINER_POOL].lent
        moved = []
        for g in ev.groups:
            gid = g.group_id
            if gid in self.migrating:
                self.migrating.discard(gid)
                if handing_over and not g.complete:
                    moved.append(gid)
                    continue
            self.aux_assigned.discard(gid)
        self._send_to_aux_rollouters(moved)
        self._after_rollout_change()

    def _on_RolloutRecord(self, ev: P.RolloutRecord):
        pred = self.predictor.rollout_time(ev.prompt_lens, ev.response_lens, 1)
        self.profiler.record(ProfileRecord(ev.t, "r", P.worker_role(ev.worker), P.worker_pool(ev.worker),
                                           {"prompt_lens": tuple(ev.prompt_lens),
                                            "response_lens": tuple(ev.response_lens)}, 1, ev.elapsed, pred))

    def _on_ChunkStarted(self, ev: P.ChunkStarted):
        if self.step is not None and ev.chunk_id in self.step.chunks:
            self.step.started(ev.chunk_id, ev.t)

    def _on_ChunkCancelled(self, ev: P.ChunkCancelled):
        if self.step is not None and ev.chunk_id in self.step.chunks:
            self.step.cancel(ev.chunk_id)
        self._schedule_chunks()

    def _on_ChunkFinished(self, ev: P.ChunkFinished):
        step = self.step
        rec = step.chunks[ev.chunk_id]
        p, r = step.lens(rec.units)
        d = self._gang(rec.side)
        pred = self.predictor.chunk_time(rec.chunk.stage, p, r, d)
        self.profiler.record(ProfileRecord(ev.t, "t", rec.side, P.worker_pool(ev.worker),
                                           {"stage": rec.chunk.stage, "prompt_lens": tuple(p),
                                            "response_lens": tuple(r)}, d, ev.elapsed, pred))
        step.finish(ev.chunk_id)
        self._schedule_chunks()

    def _on_SwitchFinished(self, ev: P.SwitchFinished):
        lease = self.leases[ev.pool]
        lending = lease.state is Lease.SWITCHING_IN
        self.profiler.observe_cost(P.DIRECTION_OF_POOL[ev.pool], "c_in" if lending else "c_out", ev.elapsed,
                                    ev.t)
        lease.fire("switched")
        if not lending:
            self.idle_windows[ev.pool] += 1           # the pool is its own again: a new idle window may follow
            if ev.pool == P.ROLLOUT_POOL and self.step is not None:
                self.step.aux_unsent.clear()          # the auxiliary gang sent its window before it switched out
        if lending:
            if ev.pool == P.TRAINER_POOL:
                self._start_aux_rollout()
            else:
                self._start_aux_training()
        elif ev.pool == P.TRAINER_POOL:
            self._try_start_step()
        else:
            self._dispatch_rollouts()
            self._maybe_sync()

    def _on_GradientsMerged(self, ev: P.GradientsMerged):
        if self.step is None or ev.step != self.step.step or self.phase is not Phase.FINISHING:
            return                                    # a merge of an attempt rolled back meanwhile
        self.step.aux_unsent.clear()
        self.profiler.observe_cost(TOR, "c_grad", ev.elapsed)
        self._out.append(P.OptimizerStep(self.step.step, self._update_version(), self.step.update_merge_order()))

    def _on_OptimizerStepped(self, ev: P.OptimizerStepped):
        if not self._last_local():         # a streamed step's local update: on to the next one, no sync yet
            self.local_update += 1
            self.step = None
            self.phase = Phase.WAITING
            self._try_start_step()
            return
        self.trainer_version = ev.version
        self.sync_wanted = True
        self.phase = Phase.SYNCING
        if self.policy.drop_stale:
            self._drop_stale()
        if self._interrupts_at_sync():
            self._interrupt_all(self._active_rollouters(P.ROLLOUT_POOL))
        self._maybe_sync()

    def _interrupts_at_sync(self) -> bool:
        """Partial rollout's interrupt at a sync: not in the reproducible mode, where every group finishes on the
        version it started on (where a sync cuts a response would follow timing)."""
        return self.settings.partial_rollout and not self.settings.reproducible

    def _waited(self, held: str, wait: Optional[tuple]) -> None:
        """Report a wait the reproducible mode imposed once it ends (a ``rule_wait`` span on the primary trainer)."""
        if wait is not None and wait[1] > wait[0]:
            self._out.append(P.RuleWaited(P.PRIMARY_TRAINER, held, *wait))

    def _completion_batch_ready(self) -> bool:
        """Whether the default rule (oldest complete groups, the look-ahead) would have a batch now."""
        s = self.settings
        size = s.batch // s.updates_per_sync
        room = s.batch - size * (self.local_update + 1)
        return self.buffer.select_batch(self.trainer_version, "lookahead", size=size, room=room) is not None

    def _drop_stale(self):
        """Unfinished groups too old for any future batch (tag < v_t − ceil(s)) are discarded at the sync, their
        slots refilled with fresh prompts (the ROLL model, bidirl.sim.baselines); parked ones now, running ones
        when their interrupt answers."""
        oldest = self.trainer_version - self.rule.max_lag
        running = {}
        for gid, rec in list(self.buffer.groups.items()):
            if rec.version >= oldest or rec.status == "complete":
                continue
            if rec.status == "partial":
                self.buffer.drop(gid)
            else:
                self.dropping.add(gid)
                running.setdefault(rec.worker, []).append(gid)
        if not self.settings.partial_rollout:          # otherwise every running group is interrupted anyway
            for w, gids in sorted(running.items()):
                if w not in self.stopping:
                    self.stopping.add(w)
                    self._out.append(P.Interrupt(w, tuple(sorted(gids))))

    def _on_SyncFinished(self, ev: P.SyncFinished):
        self.rollout_version = ev.version
        self.profiler.recalibrate(self.predictor)
        st = self.step
        # the step's groups: a streamed step's local batches together; without streaming the step's own (so a
        # checkpoint written before streaming consumption existed resumes too)
        groups = self.step_groups if self.settings.updates_per_sync > 1 else st.groups
        self._out.append(P.StepDone(P.StepRecord(
            step=st.step, start=self.step_start, end=ev.t, tokens=sum(g.tokens for g in groups),
            samples=sum(len(g.generated) for g in groups), wait=self.consume_start - self.step_start,
            consume=ev.t - self.consume_start, version=ev.version)))
        self.step, self.step_groups, self.local_update = None, [], 0
        self.steps_done += 1
        if self.steps_done >= self.settings.steps:
            self.phase = Phase.DONE
            self._out.append(P.RunDone(ev.t))
            self._interrupt_all(self._active_rollouters(P.ROLLOUT_POOL))
            return
        self.phase = Phase.WAITING
        self.step_start = ev.t
        self._dispatch_rollouts()
        self._try_start_step()

    def _on_WorkerFailed(self, ev: P.WorkerFailed):
        """A worker died; the driver restarts it (``WorkerRestarted``) and nothing it held is lost.

        * A rollouter's groups wait to resume from their last known state (the prefix generated since they
          were last parked is lost with the process, and regenerated with the same tokens: sampling is
          position-keyed) on the other rollouters of its pool, or on it once it is back; an auxiliary
          rollouter's lease is revoked.
        * An auxiliary trainer gang's chunks, running ones included, go back to the queue; its lease is revoked.
          It keeps its window's update-chunk gradients on its own devices until the window ends (§5.2), so if it
          finished one since it last handed its window over (``aux_unsent``), those are lost with it and the
          step rolls back to its start, as for the primary gang (Table 2: a finished chunk is not recoverable).
        * The primary trainer gang keeps the step's update-chunk gradients on its ranks, so a failure mid-step
          rolls the step back to its start (:meth:`_roll_back_step`); between steps nothing is lost.
        """
        w = ev.worker
        self.failed.add(w)
        if P.worker_kind(w) == P.ROLLOUT:
            for gid in self.buffer.running_on(w):
                self.aux_assigned.discard(gid)
                self.migrating.discard(gid)
                if gid in self.dropping:
                    self.dropping.discard(gid)
                    self.buffer.drop(gid)
                else:
                    self.buffer.lose(gid)
            self.stopping.discard(w)
            if not P.is_primary(w):
                self._revoke(P.TRAINER_POOL, "an auxiliary rollouter failed")
        elif P.is_primary(w):
            self._roll_back_step(P.PRIMARY)
        else:
            if self.step is not None and self.step.aux_unsent:
                self._roll_back_step(P.AUXILIARY)
            elif self.step is not None:
                self.step.recover(P.AUXILIARY)
            self._revoke(P.ROLLOUT_POOL, "the auxiliary trainer gang failed")
        self._after_rollout_change()
        self._schedule_chunks()

    def _on_WorkerRestarted(self, ev: P.WorkerRestarted):
        """A failed worker is back: it takes work again (a rolled-back step starts over on the primary gang)."""
        self.failed.discard(ev.worker)
        self._after_rollout_change()
        self._schedule_chunks()

    def _roll_back_step(self, side: str):
        """A trainer gang that held gradients of the step failed while the step consumed its batch (or merged
        and applied it): the primary gang, or an auxiliary one with a window not handed over. Those gradients
        are lost, so the step starts over with the same batch once the primary gang is back and no chunk of the
        lost attempt still runs on the other gang (:meth:`_restart_step`). The auxiliaries' lease is revoked;
        the optimizer step never happened (``OptimizerStepped`` is sent only after it is safe)."""
        step = self.step
        if step is None or self.phase not in (Phase.CONSUMING, Phase.FINISHING):
            return
        self.phase = Phase.ROLLING_BACK
        self.merge_log = [m for m in self.merge_log if m[0] != step.step]
        step.lose(side)                      # lost with the gang's processes
        self._revoke(P.ROLLOUT_POOL, "the step was rolled back")

    def _restart_step(self):
        """Start a rolled-back step over: the same batch, new chunks, once the primary gang is back."""
        old = self.step
        if P.PRIMARY_TRAINER in self.failed or old.live():
            return
        self.phase = Phase.CONSUMING
        self.step = self._trainer_step(old.step, list(old.groups))
        self._out.append(P.StartStep(old.step, self.trainer_version, tuple(old.groups)))
        self._schedule_chunks()
        self._consider_trainer_on_rollout_pool()

    # =============================================================================================
    # rollout side
    # =============================================================================================
    def _commit(self, group: P.GroupState) -> None:
        if self.buffer.commit(group):
            self.samples_generated += len(group.generated)
            self.profiler.observe_group(group.prompt_len, group.generated)

    def _alive(self, workers) -> list:
        if not self.failed:                  # the common case: a copy at C speed (a scan per event at scale)
            return list(workers)
        return [w for w in workers if w not in self.failed]

    def _active_rollouters(self, pool: str) -> list:
        """Rollouters that may take work on ``pool``: primaries while they own it, auxiliaries while lent."""
        if pool == P.ROLLOUT_POOL:
            return self._alive(self.topology.rollouters) if self.leases[pool].primary else []
        return self._alive(self.topology.aux_rollouters) if self.leases[pool].lent else []

    def _interrupt_all(self, workers) -> None:
        for w in workers:
            if self.buffer.running_count(w) and w not in self.stopping:
                self.stopping.add(w)
                self._out.append(P.Interrupt(w, None))

    def _dispatch_rollouts(self):
        """Resume parked groups (oldest tag first), then admit new ones up to the run-ahead bound."""
        # nothing starts while the new weights are on their way (a worker that is back waits for the sync too); in
        # the reproducible mode the groups of the version still held run before the sync is sent
        if self.phase is Phase.DONE:
            return
        if (self.phase is Phase.SYNCING or self.sync_wanted) and not (self.settings.reproducible and self.sync_wanted):
            return
        fresh = self._admissible()
        if not fresh and not self.buffer.partial:       # nothing to start: no event pays for the worker list
            return
        workers = self._active_rollouters(P.ROLLOUT_POOL)
        if self.stopping:
            workers = [w for w in workers if w not in self.stopping]
        if not workers:
            return
        parked = [gid for gid in self.buffer.partial_ids() if gid not in self.migrating]
        if not parked and not fresh:
            return
        # the least-loaded worker first (ties: the first listed), one group at a time
        load = [(self.buffer.running_count(w), i, w) for i, w in enumerate(workers)]
        heapq.heapify(load)
        tasks = {w: [] for w in workers}

        def least_loaded():
            n, i, w = load[0]
            heapq.heapreplace(load, (n + 1, i, w))
            return w

        for gid in parked:
            w = least_loaded()
            tasks[w].append(P.GroupTask(gid, self.buffer.resume(gid, w, self._now)))
        for _ in range(fresh):
            w = least_loaded()
            tasks[w].append(P.GroupTask(self.buffer.admit(self.rollout_version, w, self._now)))
        for w in workers:
            if tasks[w]:
                self._out.append(P.Generate(w, tuple(tasks[w]), self.rollout_version))

    def _admissible(self) -> int:
        """New groups that may start now: the run-ahead bound, and the policy's in-flight cap if it has one."""
        n = self.buffer.admissible(self.rollout_version)
        if self.policy.max_in_flight is not None:
            n = min(n, max(0, self.policy.max_in_flight - self.buffer.in_flight()))
        return n

    def _rollout_pool_idle(self) -> bool:
        if not self.leases[P.ROLLOUT_POOL].primary:
            return False
        busy = self.buffer.any_running(self.topology.rollouter_set) or self.stopping
        return not busy and not self.buffer.partial and not self._admissible()

    def _after_rollout_change(self):
        if self.phase is Phase.DONE:
            return
        if self.leases[P.TRAINER_POOL].lent:
            aux_busy = self.buffer.any_running(self.topology.aux_rollouter_set)
            ready = self._batch() is not None
            if ready or (not aux_busy and not self.migrating and not self.aux_assigned):
                self._revoke(P.TRAINER_POOL, "the primaries completed the batch before any group moved")
        self._dispatch_rollouts()
        self._maybe_sync()
        self._try_start_step()
        if self.phase is Phase.CONSUMING:
            self._consider_trainer_on_rollout_pool()

    # ---- Rollouter-on-TrainerPool ------------------------------------------------------------
    def _consider_rollout_on_trainer_pool(self):
        """Eq. 3 (:func:`bidirl.core.gates.rollout_gate`) once per idle window of the trainer pool: when the step
        starts waiting, and again each time a lease comes back while the trainer still waits."""
        key = (ROT, self.trainer_version, self.idle_windows[P.TRAINER_POOL])
        if (not self.policy.rollout_on_trainer_pool or key in self.evaluated or self.phase is not Phase.WAITING
                or not self.leases[P.TRAINER_POOL].primary or not self.topology.aux_rollout_replicas):
            return
        q = self.buffer.deficit(self.trainer_version)
        if q <= 0:
            return
        self.evaluated.add(key)
        costs = self.profiler.costs[ROT]
        primaries = self._alive(self.topology.rollouters)
        d_p, d_a = len(primaries), len(self._alive(self.topology.aux_rollouters))
        scales = self.profiler.scales

        def replica_time(context, remaining, prefill):
            return scales[("r", P.PRIMARY)] * self.predictor.replica_time(context, remaining, prefill)

        def replica_times(request_sets):
            return [scales[("r", P.PRIMARY)] * t for t in self._many("replica_times", "replica_time", request_sets)]

        groups = self._rollout_work()
        gate = gates.rollout_gate(groups, primaries, d_a, gates.rollout_dispatch(q, d_p, d_a), replica_time,
                                  self.profiler.response_sample(self.prior), costs, self.policy.gated,
                                  replica_times=replica_times)
        self._decide(ROT, gate.admitted, gate.gain, gate.cost,
                     {"deficit": q, "load": len(groups), "q_a": gate.q_a, "d_p": d_p, "d_a": d_a,
                      "t_no": gate.t_primary, "t_joint": gate.t_joint, "step": self.trainer_version})

    def _rollout_work(self) -> list:
        """Every unfinished group on (or waiting for) the primary rollouters, with its estimated progress: the
        prefix it came back with, plus one token per predicted decode iteration of its worker since it started."""
        needed = {r.group_id for r in self.buffer.needed()}
        prompt = self.profiler.typical_prompt(self.prior)
        mine = {}
        for gid, rec in self.buffer.groups.items():
            if rec.status == "partial" or (rec.status == "running" and rec.worker and P.is_primary(rec.worker)):
                mine[gid] = rec
        context = {}
        for rec in mine.values():
            st = rec.state
            p = st.prompt_len if st is not None else prompt
            held = st.generated if st is not None else (0,) * self.settings.group_size
            done = st.done if st is not None else (False,) * self.settings.group_size
            context[rec.group_id] = (p, held, done)
        lives = {w: [] for w in self.topology.rollouters}       # each rollouter's unfinished requests' contexts
        for gid, rec in mine.items():
            if rec.worker in lives:
                p, hs, ds = context[gid]
                lives[rec.worker] += [p + h for h, d in zip(hs, ds) if not d]
        busy = [w for w, live in lives.items() if live]
        per_token = dict.fromkeys(lives, 0.0)
        prefill = dict.fromkeys(lives, 0.0)
        per_token.update(zip(busy, self._many("iteration_times", "iteration_time", [lives[w] for w in busy])))
        # the KV cache of the groups (re)started together is rebuilt before they decode
        prefill.update(zip(busy, self._many("replica_times", "replica_time",
                                            [(lives[w], [0] * len(lives[w]), [True] * len(lives[w])) for w in busy])))
        out = []
        for gid, rec in mine.items():
            p, held, done = context[gid]
            grown = 0
            if rec.status == "running" and per_token.get(rec.worker):
                grown = int(max(0.0, self._now - rec.started - prefill[rec.worker]) / per_token[rec.worker])
                held = tuple(h if d else h + grown for h, d in zip(held, done))
            out.append(gates.GroupWork(gid, rec.worker if rec.status == "running" else None, p, held, done,
                                       gid in needed, (rec.version, -gid), prefilling=grown == 0))
        return out

    def _many(self, batched: str, single: str, items: list) -> list:
        """The predictor's ``batched`` method on ``items`` where it has one (one vectorised pass), else its
        ``single`` method item by item (the same numbers either way)."""
        many = getattr(self.predictor, batched, None)
        if many is not None:
            return many(items)
        one = getattr(self.predictor, single)
        return [one(*item) if isinstance(item, tuple) else one(item) for item in items]

    def _start_aux_rollout(self):
        """Eq. 4: Q_a = round(d_a / (d_p + d_a) · Q_r) groups go to the auxiliary rollouters."""
        q = self.buffer.deficit(self.trainer_version)
        d_a = len(self._active_rollouters(P.TRAINER_POOL))
        q_a = gates.rollout_dispatch(q, len(self._alive(self.topology.rollouters)), d_a) if d_a else 0
        if q_a <= 0 or self._batch() is not None:
            self._revoke(P.TRAINER_POOL, "the primaries had completed the batch when the switch in ended"
                         if self._batch() is not None else
                         f"Eq. 4 gave the borrowed pool no group when the switch in ended (deficit {q})")
            return
        # the groups the batch waits for move, parked ones first, then those with the least progress (latest
        # admitted) among the ones running on primaries — the order the gate assumed (gates.rollout_gate)
        needed = [r for r in self.buffer.needed() if r.group_id not in self.migrating]
        order = lambda r: (r.version, -r.group_id)  # noqa: E731
        parked = sorted((r for r in needed if r.status == "partial"), key=order)
        running = sorted((r for r in needed if r.status == "running" and r.worker and P.is_primary(r.worker)
                          and r.worker not in self.stopping), key=order)
        movers = (parked + running)[:q_a]
        self._send_to_aux_rollouters([r.group_id for r in movers if r.status == "partial"])
        by_worker = {}
        for r in movers:
            if r.status == "running":
                by_worker.setdefault(r.worker, []).append(r.group_id)
        for w, gids in sorted(by_worker.items()):
            self.migrating.update(gids)
            self.aux_assigned.update(gids)
            self.stopping.add(w)
            self._out.append(P.Interrupt(w, tuple(sorted(gids))))
        if self.aux_assigned or self.migrating:
            self.window_sent[P.TRAINER_POOL] = self.window_sent.get(P.TRAINER_POOL, 0) + len(movers)
        else:
            self._revoke(P.TRAINER_POOL, "no group the batch waits for was parked or running on a primary")

    def _send_to_aux_rollouters(self, gids: list):
        """Hand groups to the auxiliary rollouters, each to the least-loaded one (dispatch by capacity, Eq. 4)."""
        workers = self._active_rollouters(P.TRAINER_POOL)
        if not workers or not gids:
            return
        tasks = {w: [] for w in workers}
        load = [(self.buffer.running_count(w), i, w) for i, w in enumerate(workers)]   # least loaded first
        heapq.heapify(load)
        for gid in gids:
            n, i, w = load[0]
            heapq.heapreplace(load, (n + 1, i, w))
            tasks[w].append(P.GroupTask(gid, self.buffer.resume(gid, w, self._now)))
            self.aux_assigned.add(gid)
        for w in workers:
            if tasks[w]:
                self._out.append(P.Generate(w, tuple(tasks[w]), self.rollout_version))

    # =============================================================================================
    # trainer side
    # =============================================================================================
    def _gang(self, side: str) -> int:
        return self.topology.trainer_replicas if side == P.PRIMARY else self.topology.aux_trainer_replicas

    def _chunk_time(self, stage, p, r, d, side) -> float:
        return self.profiler.scales[("t", side)] * self.predictor.chunk_time(stage, p, r, d)

    def _span_times(self, stage, prompt_lens, response_lens, starts, stops, d, side) -> list:
        """:meth:`_chunk_time` of the chunks ``[start, stop)`` of these samples, in one call (used where the
        predictor offers ``span_times``)."""
        scale = self.profiler.scales[("t", side)]
        return [scale * t for t in self.predictor.span_times(stage, prompt_lens, response_lens, starts, stops, d)]

    def _span_bounds(self, stage, prompt_lens, response_lens, starts, stops, d, side) -> list:
        """Lower bounds of :meth:`_chunk_time` for the chunks ``[start, stop)`` of these samples (the tail split's
        search prunes with them; used where the predictor offers ``span_time_bounds``)."""
        scale = self.profiler.scales[("t", side)]
        return [scale * t for t in self.predictor.span_time_bounds(stage, prompt_lens, response_lens, starts, stops,
                                                                  d)]

    def _batch(self) -> Optional[list]:
        """The next batch: the step's whole batch, or with streaming consumption (``updates_per_sync`` = U) the
        next local update's ``B/U`` groups, the step still having room for the rest of its local batches."""
        s = self.settings
        rule = SCHEDULE_RULE if s.reproducible else self.policy.batch_rule
        if s.updates_per_sync == 1:
            return self.buffer.select_batch(self.trainer_version, rule)
        size = s.batch // s.updates_per_sync
        return self.buffer.select_batch(self.trainer_version, rule, size=size,
                                        room=s.batch - size * (self.local_update + 1))

    def _last_local(self) -> bool:
        """Whether the local update under way is the step's last (always, without streaming consumption)."""
        return self.local_update + 1 >= self.settings.updates_per_sync

    def _update_version(self) -> int:
        """The version the optimizer step produces: the next one at the step's last local update; a streamed
        step's earlier local updates change the trainer's weights without a new version (no sync until the
        step ends: veRL fully-async's ``trigger_parameter_sync_step``)."""
        return self.trainer_version + 1 if self._last_local() else self.trainer_version

    def _try_start_step(self):
        if self.phase is not Phase.WAITING:
            return
        batch = self._batch()
        if batch is None:
            if self.settings.reproducible:      # the rule's batch is not complete: does a timing-led one wait?
                self._waited("batch", self.repro.trainer_waits(self._now, self._completion_batch_ready()))
            self._consider_rollout_on_trainer_pool()
            return
        if self.settings.reproducible:
            self._waited("batch", self.repro.trainer_waits(self._now, False))
        lease = self.leases[P.TRAINER_POOL]
        if not lease.primary:
            self._revoke(P.TRAINER_POOL, "the batch was complete: the trainer takes its pool back")
            return
        groups = self.buffer.consume(batch)
        first = self.local_update == 0
        self.step_groups = list(groups) if first else self.step_groups + list(groups)
        if self.policy.enforce_staleness and self._last_local():     # the step's whole batch obeys the rule
            check_batch(self.rule, [g.version for g in self.step_groups], self.trainer_version)
        self.batches.append((self.steps_done, self.trainer_version, [g.group_id for g in groups]))
        if first:
            self.consume_start = self._now
        self.phase = Phase.CONSUMING
        self.step = self._trainer_step(self.steps_done, groups)
        self._out.append(P.StartStep(self.step.step, self.trainer_version, tuple(groups)))
        warm = getattr(self.predictor, "warm_chunk_times", None)
        s_budget = self.settings.max_tokens_per_micro_batch
        if warm is not None and s_budget is None:  # the chunks lazy pull cuts on the primaries, in one pass
            d = self._gang(P.PRIMARY)
            for stage in self.step.stages:
                warm(stage, self.step.prompt_lens, self.step.response_lens, d, self.step.chunk_units(d))
        self._schedule_chunks()
        self._consider_trainer_on_rollout_pool()

    def _trainer_step(self, index: int, groups: list) -> TrainerStep:
        """The chunk queue of step ``index`` over ``groups`` (chunk ids from the run's counter; a plain
        callable, so the coordinator pickles into a checkpoint)."""
        s = self.settings
        return TrainerStep(step=index, version=self.trainer_version, groups=groups, stages=s.stages,
                           micro_batch_per_device=s.micro_batch_per_device,
                           next_chunk_id=functools.partial(next, self._chunk_ids), rho=self.topology.trainer_layout,
                           max_tokens_per_micro_batch=s.max_tokens_per_micro_batch,
                           sequence_parallel=s.sequence_parallel,
                           grid=self.topology.trainer_replicas if s.reproducible else None)

    def _schedule_chunks(self):
        step = self.step
        if step is not None and self.phase is Phase.ROLLING_BACK:
            self._restart_step()
            return
        if step is None or self.phase is not Phase.CONSUMING:
            return
        while step.segment_done and step.advance_segment():
            pass
        if step.done:
            if P.PRIMARY_TRAINER not in self.failed:     # the merge and update run on the primary gang
                self._finish_step()
            return
        aux_on = self.leases[P.ROLLOUT_POOL].lent
        sides = [(P.PRIMARY, P.PRIMARY_TRAINER)] + ([(P.AUXILIARY, P.AUX_TRAINER)] if aux_on else [])
        if aux_on and not self.policy.model_split:
            self._split_segment_proportionally(step)
        if aux_on and self.policy.model_split and self.policy.tail_reclaim:
            self._reclaim_tail(step)
        if step.reclaiming:
            return                           # the split waits for the reclaimed chunks' answers
        if aux_on and self.policy.model_split and step.in_tail_window(
                self._gang(P.PRIMARY), self._gang(P.AUXILIARY), self.settings.tail_window):
            step.plan_tail(self._gang(P.PRIMARY), self._gang(P.AUXILIARY),
                           self._ready_in(P.PRIMARY), self._ready_in(P.AUXILIARY) + self._yield_lag(step),
                           self._chunk_time,
                           self._span_times if hasattr(self.predictor, "span_times") else None,
                           self._span_bounds if hasattr(self.predictor, "span_time_bounds") else None)
        for side, worker in sides:
            if worker in self.failed:
                continue                     # being restarted: it pulls again when it is back
            # lazy pull, several chunks deep: the next chunk's inputs move while the current one runs (§6)
            while len(step.live(side)) < self.settings.chunks_in_flight:
                rec = step.pull(side, self._gang(side), worker)
                if rec is None:
                    break
                p, r = step.lens(rec.units)
                rec.predicted = self._chunk_time(rec.chunk.stage, p, r, self._gang(side), side)
                self._out.append(P.RunChunk(worker, rec.chunk, self.trainer_version))
                if side == P.AUXILIARY:
                    self.window_sent[P.ROLLOUT_POOL] = self.window_sent.get(P.ROLLOUT_POOL, 0) + 1
        if aux_on and not step.live(P.AUXILIARY) and not step.has_work(P.AUXILIARY) \
                and step.segment_index == len(step.segments) - 1:
            self._revoke(P.ROLLOUT_POOL, "the split of the step's remaining chunks left none to the borrowed pool"
                         + (" (JointTailSplit)" if self.policy.model_split else " (proportional)"))

    def _split_segment_proportionally(self, step) -> None:
        """The opportunistic ablation's "one-shot DP-proportional assignment" (§7.3) of the window's whole remaining
        work U': each segment the window reaches is split by data-parallel capacity when it opens, as the first
        one was when the switch in ended (:meth:`_start_aux_training`), instead of being lazily pulled."""
        if not step.tail_plan and step.pending and not step.live():
            step.plan_proportional(self._gang(P.PRIMARY), self._gang(P.AUXILIARY))

    def _reclaim_tail(self, step) -> None:
        """TailWindow's reclaim (:meth:`~bidirl.core.chunks.TrainerStep.tail_reclaim`): cancel the chunks sent
        but not started, on either gang, so JointTailSplit re-chunks them with the rest of the tail (§5.2;
        Table 2: queued chunks are recoverable). Their units come back with ``ChunkCancelled``."""
        for rec in step.tail_reclaim(self._gang(P.PRIMARY), self._gang(P.AUXILIARY), self.settings.tail_window):
            gang = P.PRIMARY_TRAINER if rec.side == P.PRIMARY else P.AUX_TRAINER
            self._out.append(P.CancelChunk(gang, rec.chunk.chunk_id))

    def _yield_lag(self, step) -> float:
        """What the auxiliary side's completion costs the step beyond the primary side's, when the window ends
        with the step (its last segment): after the auxiliaries' last chunk the rollout pool switches back (C_out)
        before the weight sync can start, while after the primaries' last chunk the step merges the auxiliary
        gradients and takes its optimizer step (C_grad + optimizer), overlapping that switch. The step ends at
        ``max(t_p + g, t_a + max(g, C_out))`` with ``g = C_grad + optimizer``, so JointTailSplit minimises
        ``max(t_p, t_a + max(0, C_out − g))``: the lag is added to the auxiliary side's ready time (the same
        overlap :func:`bidirl.core.gates.trainer_gate` charges). 0 before the last segment (the window goes on)."""
        if step.segment_index != len(step.segments) - 1:
            return 0.0
        costs = self.profiler.charged(TOR, self._now)
        return max(0.0, costs.c_out - costs.c_grad - self.settings.optimizer_seconds)

    def _ready_in(self, side: str) -> float:
        """Predicted seconds from now until ``side`` has run every chunk it was sent."""
        ready = 0.0
        for c in self.step.live(side):
            if c.started is not None:
                ready += max(0.0, c.started + c.predicted - self._now)
            else:
                ready += c.predicted
        return ready

    def _finish_step(self):
        step = self.step
        self.phase = Phase.FINISHING
        self.merge_log.append((step.step, list(step.merge_positions)))
        self._revoke(P.ROLLOUT_POOL, "the primaries finished the step's chunks")
        if step.aux_update_chunks:
            aux = set(step.aux_update_chunks)
            aux_ids = tuple(c for c in step.merge_order if c in aux)
            self._out.append(P.MergeGradients(step.step, aux_ids, self.profiler.costs[TOR].c_grad))
        else:
            self._out.append(P.OptimizerStep(step.step, self._update_version(), step.update_merge_order()))

    # ---- Trainer-on-RolloutPool --------------------------------------------------------------
    def _consider_trainer_on_rollout_pool(self):
        """Algorithm 2, lines 1-6 (:func:`bidirl.core.gates.trainer_gate`) when the rollout pool idles."""
        step = self.step
        key = (TOR, self.trainer_version, self.idle_windows[P.ROLLOUT_POOL])
        if (not self.policy.trainer_on_rollout_pool or step is None or key in self.evaluated
                or self.phase is not Phase.CONSUMING or not self.topology.aux_trainer_replicas
                or P.AUX_TRAINER in self.failed or not self._rollout_pool_idle()):
            return
        stages, samples = step.remaining_work()
        if not stages:
            return
        self.evaluated.add(key)

        def run_time(first, end, d):
            idx = samples[first:end]
            return self._chunk_time(stages[first], [step.prompt_lens[k] for k in idx],
                                    [step.response_lens[k] for k in idx], d, P.PRIMARY)

        budget = self.settings.max_tokens_per_micro_batch
        chunk_len = None
        if budget is not None:
            tokens = [step.tokens[k] for k in samples]

            def chunk_len(first, end, d):
                return P.packed_chunk_len(tokens, first, end, *P.packed_groups(
                    d * self.topology.trainer_layout, budget, self.settings.sequence_parallel))
        gate = gates.trainer_gate(stages, run_time, self._gang(P.PRIMARY), self._gang(P.AUXILIARY),
                                  self.settings.micro_batch_per_device, self.profiler.costs[TOR], self.policy.gated,
                                  rho=self.topology.trainer_layout, optimizer=self.settings.optimizer_seconds,
                                  chunk_len=chunk_len, sequence_parallel=self.settings.sequence_parallel)
        self._decide(TOR, gate.admitted, gate.gain, gate.cost,
                     {"t_no": gate.t_no, "t_borrow": gate.t_borrow, "units": len(stages),
                      "drained": gate.drained, "step": self.trainer_version})

    def _start_aux_training(self):
        """The switch in ended: the auxiliary gang starts pulling (Algorithm 2's lazy pull, §5.2). The gate admitted
        the window for the step's whole remaining workload U, later segments included, so a window that opens while
        the primaries run the current segment's last chunks waits at the segment barrier and pulls from the next
        segment when it opens (as :meth:`_schedule_chunks` keeps a window open across a barrier); it is given back
        only when no unassigned chunk is left in the step."""
        step = self.step
        if step is None or self.phase is not Phase.CONSUMING or not self._window_has_work(step) \
                or P.AUX_TRAINER in self.failed:
            self._revoke(P.ROLLOUT_POOL,        # (a gang that failed during the switch gives the pool back)
                         "the auxiliary trainer gang failed" if P.AUX_TRAINER in self.failed else
                         "no chunk of the step was left unassigned when the switch in ended")
            return
        if not self.policy.model_split and step.pending:
            step.plan_proportional(self._gang(P.PRIMARY), self._gang(P.AUXILIARY))
        self._schedule_chunks()

    @staticmethod
    def _window_has_work(step) -> bool:
        """Whether a Trainer-on-RolloutPool window opening now can still get a chunk of ``step``: units of the
        current segment not yet sent, or a later segment (opened at the barrier)."""
        return bool(step.pending) or step.segment_index < len(step.segments) - 1

    # =============================================================================================
    # leases and sync
    # =============================================================================================
    def _decide(self, direction: str, admitted: bool, gain: float, cost: float, detail: dict) -> None:
        """Report a borrowing decision; if admitted, lend the pool (lease: lend, ``Switch`` in)."""
        self._out.append(P.Decided(P.Decision(t=self._now, direction=direction, admitted=admitted,
                                              predicted_gain=gain, cost=cost, detail=detail)))
        if admitted:
            pool = P.BORROWED_POOL[direction]
            self.window_sent[pool] = 0
            self.leases[pool].fire("lend")
            expected = self.profiler.charged(direction, self._now).c_in
            self._out.append(P.Switch(pool, P.GUEST_ROLE[pool], direction, "in", expected,
                                      self._role_version(P.GUEST_ROLE[pool])))

    def _role_version(self, role: str) -> int:
        """The actor version a role's workers run: rollouters the synced one, trainers the trainer's."""
        return self.rollout_version if role == P.ROLLOUT else self.trainer_version

    def _revoke(self, pool: str, why: str):
        """Preempt-and-yield (§3.2): auxiliaries stop taking work, return what is recoverable, then yield. ``why``
        is kept for the switch out when the window sent its guests no work (``Switch.no_work``)."""
        if not self.leases[pool].lent:
            return
        if not self.window_sent.get(pool, 0):
            self.no_work[pool] = why
        self.leases[pool].fire("revoke")
        if pool == P.TRAINER_POOL:
            self._interrupt_all(self._alive(self.topology.aux_rollouters))
        elif self.step is not None:
            for c in self.step.live(P.AUXILIARY):
                if c.status == "queued":
                    self._out.append(P.CancelChunk(P.AUX_TRAINER, c.chunk.chunk_id))
            self.step.release_plan()
        self._maybe_switch_out(pool)

    def _maybe_switch_out(self, pool: str):
        """Yield a revoked pool once nothing of the auxiliaries runs on it (lease: yield, ``Switch`` out)."""
        if not self.leases[pool].revoking:
            return
        if pool == P.TRAINER_POOL:
            aux = self._alive(self.topology.aux_rollouters)
            if any(self.buffer.running_count(w) for w in aux) or any(w in self.stopping for w in
                                                                  self.topology.aux_rollouters):
                return
            self.aux_assigned.clear()
        elif self.step is not None and self.step.live(P.AUXILIARY) and P.AUX_TRAINER not in self.failed:
            return
        self.leases[pool].fire("yield")
        home = P.HOME_ROLE[pool]
        direction = P.DIRECTION_OF_POOL[pool]
        self._out.append(P.Switch(pool, home, direction, "out", self.profiler.charged(direction, self._now).c_out,
                                  self._role_version(home), no_work=self.no_work.pop(pool, "")))

    def _yield_revoked(self):
        for pool in P.POOLS:
            self._maybe_switch_out(pool)

    def _maybe_sync(self):
        """After the optimizer step: push the new weights once primaries have stopped or drained."""
        self._yield_revoked()
        if self.phase is Phase.CONSUMING and self.step is not None:
            self._schedule_chunks()
        if not self.sync_wanted or not self.leases[P.ROLLOUT_POOL].primary:
            return
        rollouters = self._alive(self.topology.rollouters)
        if self._interrupts_at_sync():
            # a primary that was stopping for some of its groups only (a migration) when the step ended may still
            # run others: they park for the sync too (weights change only on an idle engine)
            self._interrupt_all(rollouters)
        if any(w in self.stopping for w in rollouters):
            return
        if not self._interrupts_at_sync() and any(self.buffer.running_count(w) for w in rollouters):
            self._waited("sync", self.repro.sync_waits(self._now, self.settings.reproducible
                                                       and self.settings.partial_rollout))
            return
        if self.settings.reproducible and (self.buffer.in_flight() or self._admissible()):
            # every group admitted on this version finishes on it before the weights change (parked ones too)
            self._waited("sync", self.repro.sync_waits(self._now, True))
            self._dispatch_rollouts()
            return
        self._waited("sync", self.repro.sync_waits(self._now, False))
        self.sync_wanted = False
        self._out.append(P.SyncWeights(self.trainer_version, tuple(rollouters)))
