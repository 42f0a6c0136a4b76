"""The control plane: event handlers that turn driver events into commands (paper §3-§5).

The coordinator owns the rollout buffer and staleness rule (:mod:`~bidirl.core.buffer`,
:mod:`~bidirl.core.staleness`), one lease per pool (:mod:`~bidirl.core.lease`), the trainer's chunk queue
(:mod:`~bidirl.core.chunks`) and the online profiler (:mod:`~bidirl.core.profiler`); the decisions themselves
are the pure functions of :mod:`~bidirl.core.gates`. The class is split by concern: this module holds its state,
the protocol entry point, the event handlers and the weight sync; :mod:`~bidirl.core.rollout_side` the rollout
dispatch and Rollouter-on-TrainerPool; :mod:`~bidirl.core.trainer_side` the step's chunks and
Trainer-on-RolloutPool; :mod:`~bidirl.core.lending` lending, revoking and yielding a pool. It has no clock, threads, sleeps or Ray: a driver calls
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

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from bidirl.core import protocol as P
from bidirl.core.buffer import RolloutBuffer
from bidirl.core.chunks import TrainerStep
from bidirl.core.lease import Lease, PoolLease
from bidirl.core.lending import Lending
from bidirl.core.phase import Phase
from bidirl.core.policies import Policy
from bidirl.core.profiler import ProfileRecord, Profiler
from bidirl.core.progress import DecodeProgress
from bidirl.core.rollout_side import RolloutSide
from bidirl.core.schedule import Reproducibility
from bidirl.core.staleness import StalenessRule
from bidirl.core.trainer_side import TrainerSide

TOR = P.TRAINER_ON_ROLLOUT_POOL


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
    mini_batch_prompts: Optional[int] = None   # groups per optimizer update (None: one per local update)
    # seconds of an auxiliary trainer gang's weight refresh after an optimizer step that kept the version
    # (bidirl.core.aux_weights); None: the gang is never refreshed, so it runs only the segments on the version's weights
    aux_refresh_seconds: Optional[float] = None
    reproducible: bool = False     # batches, versions and chunks fixed by rule, not by timing (bidirl.core.schedule)
    # indices (0-based, in decision order) of gate decisions taken the other way: a counterfactual that measures the
    # gates (bidirl.experiments.gate_regret); empty in every run that is not such a measurement
    flipped_decisions: frozenset = frozenset()


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
class Coordinator(RolloutSide, TrainerSide, Lending):
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
    decode: DecodeProgress = field(default_factory=DecodeProgress)  # when groups joined and left each rollouter
    decisions_made: int = 0                           # gate decisions so far (Settings.flipped_decisions counts them)

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
        if "decode" not in state:          # written before progress was replayed: the groups running then read as
            self.decode = DecodeProgress()  # just started (no tokens grown) until they leave their workers
        if "repro" not in state:
            self.repro = Reproducibility.of(self.settings, self.topology, self.policy)
        self.__dict__.setdefault("decisions_made", 0)   # written before decisions were counted

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

    def _on_Resumed(self, ev: P.Resumed):
        """The resumed run's workers reserve their first switches' pinned buffers from ``ev.t``: expect, and let
        the gates charge, what is left of them from then on (``Profiler.charged``)."""
        self.profiler.first_switch = {(direction, "c_" + phase): float(seconds)
                                      for (direction, phase), seconds in ev.first_switch if seconds > 0}
        self.profiler.loaded_at = float(ev.t)

    def _on_GroupFinished(self, ev: P.GroupFinished):
        self.decode.leave(ev.worker, ev.t, (ev.group.group_id,))
        self._commit(ev.group)
        self.aux_assigned.discard(ev.group.group_id)
        # with an asynchronous driver a group can complete while an Interrupt to migrate it is in flight:
        # there is nothing left to move, and the interrupt's answer will not list it
        self.migrating.discard(ev.group.group_id)
        self._after_rollout_change()

    def _on_GenerationStopped(self, ev: P.GenerationStopped):
        self.stopping.discard(ev.worker)
        self.decode.leave(ev.worker, ev.t, [g.group_id for g in ev.groups])
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
                self.step.aux_weights, self.step.aux_refreshing = None, False   # and holds no weights now
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
        step = self.step
        mini_batch = step is not None and step.optimizing and self.phase is Phase.CONSUMING
        if step is None or ev.step != step.step or not (self.phase is Phase.FINISHING or mini_batch):
            return                                    # a merge of an attempt rolled back meanwhile
        step.aux_unsent.clear()
        step.aux_update_chunks.clear()                # merged: the next mini-batch's optimizer step has none
        self.profiler.observe_cost(TOR, "c_grad", ev.elapsed)
        self._optimizer_step(step)

    def _on_OptimizerStepped(self, ev: P.OptimizerStepped):
        step = self.step
        if step is not None and step.optimizing:
            # an optimizer mini-batch's step: the next mini-batch's segment opens (a step rolled back meanwhile
            # starts over instead, :meth:`_restart_step`)
            if self.phase is Phase.CONSUMING and ev.step == step.step:
                step.optimizing = False
                step.advance_segment()
                self._schedule_chunks()
            return
        if self.phase is not Phase.FINISHING:
            return                         # an update of an attempt rolled back meanwhile (it starts over)
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
            self.decode.leave(w, ev.t, self.buffer.running_on(w))
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
        if self.phase is Phase.FINISHING and self.merge_log and self.merge_log[-1][0] == step.step:
            self.merge_log.pop()             # this attempt's merge only: a streamed step's earlier local updates stay
        self.phase = Phase.ROLLING_BACK
        step.lose(side)                      # lost with the gang's processes
        self._revoke(P.ROLLOUT_POOL, "the step was rolled back")

    def _restart_step(self):
        """Start a rolled-back step over: the same batch, new chunks, once the primary gang is back."""
        old = self.step
        if P.PRIMARY_TRAINER in self.failed or old.live():
            return
        self.phase = Phase.CONSUMING
        self.step = self._trainer_step(old.step, list(old.groups))
        self._out.append(P.StartStep(old.step, self.trainer_version, tuple(old.groups), self.local_update))
        self._schedule_chunks()
        self._consider_trainer_on_rollout_pool()

    # =============================================================================================
    # sync
    # =============================================================================================
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
