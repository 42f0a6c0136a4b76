"""The control plane: one state machine that turns driver events into commands (DESIGN.md; paper §3-§5).

It owns the rollout buffer and staleness rule, pool ownership and leases, the trainer's chunk queue, the two
borrowing directions and the online profiler. It has no clock, threads, sleeps or Ray: a driver calls
:meth:`Coordinator.handle` with an event and executes the commands returned, in order.

Life of a training step ``k`` (trainer holds version ``v = k``):

1. *wait* — until the buffer can form a batch under the staleness rule. While the trainer pool idles,
   **Rollouter-on-TrainerPool** may lend it to auxiliary rollouters (admission Eq. 3, dispatch Eq. 4);
   the lease is revoked when the batch is ready or the auxiliaries finish their share, complete groups stay
   committed, incomplete ones go back to primary rollouters with their prefixes.
2. *consume* — stage-ordered chunks on the primary trainers. While the rollout pool idles (rollouters
   blocked by the run-ahead bound), **Trainer-on-RolloutPool** may lend it to auxiliary trainers
   (Algorithm 2: DrainPrefix, admission, LazyPull, TailWindow + JointTailSplit); auxiliary actor-update
   gradients are merged in chunk order (C_grad) before the primary's optimizer step.
3. *sync* — the new version goes to the primary rollouters; with partial rollout they are interrupted
   first and their unfinished groups resume afterwards from their prefixes, without it the sync waits for
   in-flight generation to finish.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from bidirl.core import protocol as P
from bidirl.core.buffer import RolloutBuffer
from bidirl.core.chunks import TrainerStep
from bidirl.core.policies import Policy
from bidirl.core.profiler import ProfileRecord, Profiler
from bidirl.core.staleness import StalenessRule, check_batch
from bidirl.trace import Decision, StepRecord

ROT, TOR = "rollout_on_trainer_pool", "trainer_on_rollout_pool"
PRIMARY_TRAINER, AUX_TRAINER = "trainer_pool/trainer", "rollout_pool/trainer"


@dataclass(frozen=True)
class Topology:
    """Replica counts induced by the planner's envelope (§4): who can run on which pool."""
    rollout_replicas: int          # d_r: primary rollouters on the rollout pool
    trainer_replicas: int          # d_t: primary trainer replicas on the trainer pool
    aux_rollout_replicas: int      # rollout replicas the trainer pool can host (g_t / ρ_r)
    aux_trainer_replicas: int      # trainer replicas the rollout pool can host (g_r / ρ_t)

    @property
    def rollouters(self) -> tuple:
        return tuple(f"rollout_pool/rollouter/{i}" for i in range(self.rollout_replicas))

    @property
    def aux_rollouters(self) -> tuple:
        return tuple(f"trainer_pool/rollouter/{i}" for i in range(self.aux_rollout_replicas))


@dataclass(frozen=True)
class Settings:
    batch: int                     # B_p groups per step
    group_size: int
    staleness: float
    partial_rollout: bool
    stages: tuple
    max_chunk: int
    tail_window: int
    steps: int


@dataclass
class Coordinator:
    """``models`` predicts raw stage times: ``chunk_time(stage, prompt_lens, response_lens, d)`` and
    ``rollout_time(prompt_lens, response_lens, d)``; ``prior`` is a (prompt_lens, response_lens) sample of
    the workload used until the profiler has seen real responses."""
    settings: Settings
    topology: Topology
    policy: Policy
    models: Any
    profiler: Profiler
    prior: tuple

    # state --------------------------------------------------------------------------------------
    trainer_version: int = 0
    rollout_version: int = 0
    phase: str = "starting"        # starting | waiting | consuming | finishing | syncing | done
    owner: dict = field(default_factory=lambda: {P.ROLLOUT_POOL: "primary", P.TRAINER_POOL: "primary"})
    step: Optional[TrainerStep] = None
    steps: list = field(default_factory=list)
    decisions: list = field(default_factory=list)
    step_start: float = 0.0
    consume_start: float = 0.0
    evaluated: set = field(default_factory=set)       # (direction, step) opportunities already decided
    stopping: set = field(default_factory=set)        # rollout workers with an Interrupt in flight
    aux_assigned: set = field(default_factory=set)    # groups sent to auxiliary rollouters this window
    migrating: set = field(default_factory=set)       # groups being moved from primaries to auxiliaries
    revoking: set = field(default_factory=set)        # pools whose lease is being given back
    sync_wanted: bool = False
    merge_wanted: bool = False
    failed: set = field(default_factory=set)
    samples_generated: int = 0
    batches: list = field(default_factory=list)       # (step, version, [group ids])
    merge_log: list = field(default_factory=list)     # (step, [(segment, first unit) in merge order])

    def __post_init__(self):
        s = self.settings
        self.rule = StalenessRule(s.staleness, s.batch)
        self.buffer = RolloutBuffer(self.rule)
        self._chunk_ids = itertools.count()
        self._out: list = []
        self._now = 0.0

    # =============================================================================================
    # public
    # =============================================================================================
    def handle(self, event) -> list:
        """Feed one event; returns the commands the driver must execute, in order."""
        self._out = []
        self._now = event.t
        method = getattr(self, "_on_" + type(event).__name__, None)
        if method is None:
            raise TypeError(f"the coordinator does not handle {type(event).__name__}")
        method(event)
        for pool in list(self.revoking):
            self._maybe_switch_out(pool)
        out, self._out = self._out, []
        return out

    @property
    def finished(self) -> bool:
        return self.phase == "done"

    def sample_counts(self) -> dict:
        c = self.buffer.counts()
        consumed = c["consumed"] * self.settings.group_size
        buffered = (c["complete"]) * self.settings.group_size
        generated = self.samples_generated
        return {"generated": generated, "consumed": consumed, "buffered": buffered,
                "lost": generated - consumed - buffered,
                "duplicated": self.buffer.duplicates * self.settings.group_size}

    # =============================================================================================
    # events
    # =============================================================================================
    def _on_Started(self, ev: P.Started):
        self.phase = "waiting"
        self.step_start = ev.t
        self._dispatch_rollouts()
        self._try_start_step()

    def _on_GroupFinished(self, ev: P.GroupFinished):
        g = ev.group
        if self.buffer.commit(g):
            self.samples_generated += len(g.generated)
            self.profiler.observe_group(g.prompt_len, g.generated)
        self.aux_assigned.discard(g.group_id)
        # with an asynchronous driver a group can complete while an Interrupt to migrate it is in flight:
        # there is nothing left to move, and the interrupt's answer will not list it
        self.migrating.discard(g.group_id)
        self._after_rollout_change()

    def _on_GenerationStopped(self, ev: P.GenerationStopped):
        self.stopping.discard(ev.worker)
        for g in ev.groups:
            if g.complete:
                if self.buffer.commit(g):
                    self.samples_generated += len(g.generated)
                    self.profiler.observe_group(g.prompt_len, g.generated)
            else:
                self.buffer.park(g)
        handing_over = self.owner[P.TRAINER_POOL] == "auxiliary" and P.TRAINER_POOL not in self.revoking
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
        r = ev.record
        pred = self.models.rollout_time(r["prompt_lens"], r["response_lens"], 1)
        self.profiler.record(ProfileRecord(ev.t, "r", "primary" if P.is_primary(r["worker"]) else "auxiliary",
                                           P.worker_pool(r["worker"]),
                                           {"requests": len(r["response_lens"])}, 1, r["elapsed"], pred))

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
        pred = self.models.chunk_time(rec.chunk.stage, p, r, d)
        self.profiler.record(ProfileRecord(ev.t, "t", rec.side, P.worker_pool(ev.worker),
                                           {"stage": rec.chunk.stage, "units": len(rec.units)}, d, ev.elapsed, pred))
        step.finish(ev.chunk_id, ev.payload)
        self._schedule_chunks()

    def _on_SwitchFinished(self, ev: P.SwitchFinished):
        pool = ev.pool
        direction = ROT if pool == P.TRAINER_POOL else TOR
        lent = (pool == P.TRAINER_POOL) == (ev.to_role == "rollout")
        self.profiler.observe_cost(direction, "c_in" if lent else "c_out", ev.elapsed)
        if lent:
            self.owner[pool] = "auxiliary"
            if pool == P.TRAINER_POOL:
                self._start_aux_rollout()
            else:
                self._start_aux_training()
        else:
            self.owner[pool] = "primary"
            self.revoking.discard(pool)
            if pool == P.TRAINER_POOL:
                self._try_start_step()
            else:
                self._dispatch_rollouts()
                self._maybe_sync()

    def _on_GradientsMerged(self, ev: P.GradientsMerged):
        self.profiler.observe_cost(TOR, "c_grad", ev.elapsed)
        self.merge_wanted = False
        self._out.append(P.OptimizerStep(self.step.step, self.trainer_version + 1))

    def _on_OptimizerStepped(self, ev: P.OptimizerStepped):
        self.trainer_version = ev.version
        self.sync_wanted = True
        self.phase = "syncing"
        if self.settings.partial_rollout:
            for w in self._active_rollouters(P.ROLLOUT_POOL):
                if self.buffer.running_on(w) and w not in self.stopping:
                    self.stopping.add(w)
                    self._out.append(P.Interrupt(w, None, "sync"))
        self._maybe_sync()

    def _on_SyncFinished(self, ev: P.SyncFinished):
        self.rollout_version = ev.version
        self.profiler.recalibrate()
        st = self.step
        self.steps.append(StepRecord(step=st.step, start=self.step_start, end=ev.t,
                                     tokens=sum(g.prompt_len * len(g.generated) + g.response_tokens
                                                for g in st.groups),
                                     samples=st.n_samples, wait=self.consume_start - self.step_start,
                                     consume=ev.t - self.consume_start, version=ev.version))
        self.step = None
        if len(self.steps) >= self.settings.steps:
            self.phase = "done"
            for w in self._active_rollouters(P.ROLLOUT_POOL):
                if self.buffer.running_on(w) and w not in self.stopping:
                    self.stopping.add(w)
                    self._out.append(P.Interrupt(w, None, "finish"))
            return
        self.phase = "waiting"
        self.step_start = ev.t
        self._dispatch_rollouts()
        self._try_start_step()

    def _on_WorkerFailed(self, ev: P.WorkerFailed):
        """An auxiliary worker died: its work returns to the primaries and the lease ends (no sample lost).

        A failed rollouter's groups restart from their last known state (the prefix is lost with the
        process); a failed auxiliary trainer's chunks, running ones included, go back to the queue.
        A primary failure cannot be recovered here and is re-raised to the driver.
        """
        w = ev.worker
        if P.is_primary(w):
            raise RuntimeError(f"primary worker {w} failed: {ev.error}")
        self.failed.add(w)
        pool = P.worker_pool(w)
        if P.worker_kind(w) == "rollout":
            for gid in self.buffer.running_on(w):
                rec = self.buffer.groups[gid]
                rec.status, rec.worker = "partial", None
                self.aux_assigned.discard(gid)
            self.stopping.discard(w)
        elif self.step is not None:
            for c in self.step.live("auxiliary"):
                c.status = "queued"          # its worker is gone: even a running chunk is recovered
                self.step.cancel(c.chunk.chunk_id)
            self.step.release_plan()
        if self.owner[pool] == "auxiliary" and pool not in self.revoking:
            self._revoke(pool)
        self._dispatch_rollouts()
        self._schedule_chunks()

    # =============================================================================================
    # rollout side
    # =============================================================================================
    def _active_rollouters(self, pool: str) -> list:
        if pool == P.ROLLOUT_POOL:
            if self.owner[P.ROLLOUT_POOL] != "primary":
                return []
            return [w for w in self.topology.rollouters if w not in self.failed]
        if self.owner[P.TRAINER_POOL] != "auxiliary" or P.TRAINER_POOL in self.revoking:
            return []
        return [w for w in self.topology.aux_rollouters if w not in self.failed]

    def _rollouts_paused(self) -> bool:
        """Primaries take no new work while a sync is pending or the run is over."""
        return self.phase in ("done",) or self.sync_wanted

    def _dispatch_rollouts(self):
        """Resume parked groups (oldest tag first), then admit new ones up to the run-ahead bound."""
        workers = [w for w in self._active_rollouters(P.ROLLOUT_POOL) if w not in self.stopping]
        if not workers or self._rollouts_paused():
            return
        load = {w: len(self.buffer.running_on(w)) for w in workers}
        tasks = {w: [] for w in workers}

        def least_loaded():
            return min(workers, key=lambda w: (load[w], workers.index(w)))

        for gid in self.buffer.partial_ids():
            if gid in self.migrating:
                continue
            w = least_loaded()
            tasks[w].append(P.GroupTask(gid, self.buffer.resume(gid, w)))
            load[w] += 1
        for _ in range(self.buffer.admissible(self.rollout_version)):
            w = least_loaded()
            gid = self.buffer.admit(self.rollout_version, w)
            tasks[w].append(P.GroupTask(gid))
            load[w] += 1
        for w in workers:
            if tasks[w]:
                self._out.append(P.Generate(w, tuple(tasks[w]), self.rollout_version))

    def _rollout_pool_idle(self) -> bool:
        if self.owner[P.ROLLOUT_POOL] != "primary":
            return False
        busy = any(self.buffer.running_on(w) for w in self.topology.rollouters) or self.stopping
        return not busy and not self.buffer.partial_ids() and not self.buffer.admissible(self.rollout_version)

    def _after_rollout_change(self):
        if self.phase == "done":
            return
        if self.owner[P.TRAINER_POOL] == "auxiliary" and P.TRAINER_POOL not in self.revoking:
            aux_busy = any(self.buffer.running_on(w) for w in self.topology.aux_rollouters)
            ready = self.buffer.select_batch(self.trainer_version) is not None
            if ready or (not aux_busy and not self.migrating and not self.aux_assigned):
                self._revoke(P.TRAINER_POOL)
        self._dispatch_rollouts()
        self._maybe_sync()
        self._try_start_step()
        if self.phase == "consuming":
            self._consider_trainer_on_rollout_pool()

    # ---- Rollouter-on-TrainerPool ------------------------------------------------------------
    def _consider_rollout_on_trainer_pool(self):
        key = (ROT, self.trainer_version)
        if (not self.policy.rollout_on_trainer_pool or key in self.evaluated or self.phase != "waiting"
                or self.owner[P.TRAINER_POOL] != "primary" or not self.topology.aux_rollout_replicas):
            return
        q = self.buffer.deficit(self.trainer_version)
        if q <= 0:
            return
        self.evaluated.add(key)
        costs = self.profiler.costs[ROT]
        d_p = len([w for w in self.topology.rollouters if w not in self.failed])
        d_a = len([w for w in self.topology.aux_rollouters if w not in self.failed])
        # Eq. 3 compares M_r(Q_r, d_p) with M_r(Q_r, d_p + d_a). Primaries also carry run-ahead groups
        # (load L ≥ Q_r in flight, all progressing together under continuous batching), so the deficit
        # closes when that load drains; after dispatch (Eq. 4) they keep L − Q_a and the auxiliaries take
        # Q_a. With L = Q_r this is Eq. 3 with a capacity-proportional split.
        load = max(q, self._primary_load())
        q_a = round(d_a / (d_p + d_a) * q)
        g = self.settings.group_size
        scale = self.profiler.scales[("r", "primary")]

        def m_r(groups, d):
            if groups <= 0 or d <= 0:
                return 0.0
            p, r = self.profiler.representative(groups * g, self.prior)
            return scale * self.models.rollout_time(p, r, d)

        t_p = m_r(load, d_p)
        t_j = max(m_r(load - q_a, d_p), m_r(q_a, d_a))
        gain, cost = t_p - t_j, costs.c_in + costs.c_out
        admitted = (gain > cost) if self.policy.gated else True
        self.decisions.append(Decision(t=self._now, direction=ROT, admitted=admitted, predicted_gain=gain,
                                       cost=cost, detail={"deficit": q, "load": load, "d_p": d_p, "d_a": d_a,
                                                          "step": self.trainer_version}))
        if admitted:
            self.owner[P.TRAINER_POOL] = "switching"
            self._out.append(P.Switch(P.TRAINER_POOL, "rollout", ROT, "in", costs.c_in))

    def _primary_load(self) -> int:
        """Groups generating or waiting to resume on the primary rollouters."""
        return sum(1 for r in self.buffer.groups.values()
                   if r.status == "partial" or (r.status == "running" and r.worker and P.is_primary(r.worker)))

    def _start_aux_rollout(self):
        """Eq. 4: Q_a = round(d_a / (d_p + d_a) · Q_r) groups go to the auxiliary rollouters."""
        q = self.buffer.deficit(self.trainer_version)
        d_p = len([w for w in self.topology.rollouters if w not in self.failed])
        d_a = len(self._active_rollouters(P.TRAINER_POOL))
        q_a = round(d_a / (d_p + d_a) * q) if q > 0 else 0
        if q_a <= 0 or self.buffer.select_batch(self.trainer_version) is not None:
            self._revoke(P.TRAINER_POOL)
            return
        take = [g for g in self.buffer.partial_ids() if g not in self.migrating][:q_a]
        self._send_to_aux_rollouters(take)
        need = q_a - len(take)
        if need > 0:
            # Move the groups with the least progress (latest admitted, most needed first) off primaries.
            candidates = sorted(
                ((rec.version, -gid, gid, rec.worker) for gid, rec in self.buffer.groups.items()
                 if rec.status == "running" and rec.worker and P.is_primary(rec.worker)
                 and rec.worker not in self.stopping),
            )
            chosen = candidates[:need]
            by_worker = {}
            for _, _, gid, w in chosen:
                by_worker.setdefault(w, []).append(gid)
            for w, gids in sorted(by_worker.items()):
                self.migrating.update(gids)
                self.aux_assigned.update(gids)
                self.stopping.add(w)
                self._out.append(P.Interrupt(w, tuple(sorted(gids)), "migrate"))
        if not self.aux_assigned and not self.migrating:
            self._revoke(P.TRAINER_POOL)

    def _send_to_aux_rollouters(self, gids: list):
        workers = self._active_rollouters(P.TRAINER_POOL)
        if not workers or not gids:
            return
        tasks = {w: [] for w in workers}
        for i, gid in enumerate(gids):
            w = workers[i % len(workers)]
            tasks[w].append(P.GroupTask(gid, self.buffer.resume(gid, w)))
            self.aux_assigned.add(gid)
        for w in workers:
            if tasks[w]:
                self._out.append(P.Generate(w, tuple(tasks[w]), self.rollout_version))

    # =============================================================================================
    # trainer side
    # =============================================================================================
    def _gang(self, side: str) -> int:
        return self.topology.trainer_replicas if side == "primary" else self.topology.aux_trainer_replicas

    def _chunk_time(self, stage, p, r, d, side) -> float:
        return self.profiler.scales[("t", side)] * self.models.chunk_time(stage, p, r, d)

    def _try_start_step(self):
        if self.phase != "waiting":
            return
        batch = self.buffer.select_batch(self.trainer_version)
        if batch is None:
            self._consider_rollout_on_trainer_pool()
            return
        if self.owner[P.TRAINER_POOL] != "primary":
            if self.owner[P.TRAINER_POOL] == "auxiliary" and P.TRAINER_POOL not in self.revoking:
                self._revoke(P.TRAINER_POOL)
            return
        groups = self.buffer.consume(batch)
        check_batch(self.rule, [g.version for g in groups], self.trainer_version)
        self.batches.append((len(self.steps), self.trainer_version, [g.group_id for g in groups]))
        self.consume_start = self._now
        self.phase = "consuming"
        s = self.settings
        self.step = TrainerStep(step=len(self.steps), version=self.trainer_version, groups=groups,
                                stages=s.stages, max_chunk=s.max_chunk,
                                next_chunk_id=lambda: next(self._chunk_ids))
        self._schedule_chunks()
        self._consider_trainer_on_rollout_pool()

    def _schedule_chunks(self):
        step = self.step
        if step is None or self.phase != "consuming":
            return
        while step.segment_done and step.advance_segment():
            pass
        if step.done:
            self._finish_step()
            return
        aux_on = self.owner[P.ROLLOUT_POOL] == "auxiliary" and P.ROLLOUT_POOL not in self.revoking
        sides = [("primary", PRIMARY_TRAINER)] + ([("auxiliary", AUX_TRAINER)] if aux_on else [])
        if aux_on and self.policy.model_split and step.in_tail_window(
                self._gang("primary"), self._gang("auxiliary"), self.settings.tail_window):
            step.plan_tail(self._gang("primary"), self._gang("auxiliary"),
                           self._ready_in("primary"), self._ready_in("auxiliary"), self._chunk_time)
        for side, worker in sides:
            if step.live(side):
                continue
            rec = step.pull(side, self._gang(side), worker)
            if rec is not None:
                p, r = step.lens(rec.units)
                rec.predicted = self._chunk_time(rec.chunk.stage, p, r, self._gang(side), side)
                self._out.append(P.RunChunk(worker, rec.chunk, self.trainer_version))
        if aux_on and not step.live("auxiliary") and not step.has_work("auxiliary") \
                and step.segment_index == len(step.segments) - 1:
            self._revoke(P.ROLLOUT_POOL)

    def _ready_in(self, side: str) -> float:
        """Predicted seconds from now until ``side`` can start another chunk."""
        live = self.step.live(side)
        if not live:
            return 0.0
        c = live[0]
        started = c.started if c.started is not None else self._now
        return max(0.0, started + c.predicted - self._now)

    def _finish_step(self):
        step = self.step
        self.phase = "finishing"
        self.merge_log.append((step.step, list(step.merge_positions)))
        if self.owner[P.ROLLOUT_POOL] == "auxiliary" and P.ROLLOUT_POOL not in self.revoking:
            self._revoke(P.ROLLOUT_POOL)
        if step.aux_update_chunks:
            aux_ids = tuple(c for c in step.merge_order if c in set(step.aux_update_chunks))
            self._out.append(P.MergeGradients(step.step, aux_ids, self.profiler.costs[TOR].c_grad))
        else:
            self._out.append(P.OptimizerStep(step.step, self.trainer_version + 1))

    # ---- Trainer-on-RolloutPool --------------------------------------------------------------
    def _consider_trainer_on_rollout_pool(self):
        """Algorithm 2, lines 1-6: DrainPrefix, then T_borrow = C_in + M_t(U', d_p+d_a) + C_out + C_grad < M_t(U, d_p)."""
        step = self.step
        key = (TOR, self.trainer_version)
        if (not self.policy.trainer_on_rollout_pool or step is None or key in self.evaluated
                or self.phase != "consuming" or not self.topology.aux_trainer_replicas
                or AUX_TRAINER in self.failed or not self._rollout_pool_idle()):
            return
        units = step.remaining_units()
        if not units:
            return
        self.evaluated.add(key)
        costs = self.profiler.costs[TOR]
        d_p, d_a = self._gang("primary"), self._gang("auxiliary")
        t_no, drained = self._workload_time(step, units, d_p, "primary", drain=costs.c_in)
        rest = units[drained:]
        t_joint, _ = self._workload_time(step, rest, d_p + d_a, "primary")
        c_grad = costs.c_grad if any(stage == "actor_update" for stage, _ in rest) else 0.0
        t_borrow = costs.c_in + t_joint + costs.c_out + c_grad
        admitted = (t_borrow < t_no) if self.policy.gated else bool(rest)
        cost = costs.c_in + costs.c_out + c_grad
        self.decisions.append(Decision(t=self._now, direction=TOR, admitted=admitted,
                                       predicted_gain=t_no - t_joint, cost=cost,
                                       detail={"t_no": t_no, "t_borrow": t_borrow, "units": len(units),
                                               "drained": drained, "step": self.trainer_version}))
        if admitted:
            self.owner[P.ROLLOUT_POOL] = "switching"
            self._out.append(P.Switch(P.ROLLOUT_POOL, "trainer", TOR, "in", costs.c_in))

    def _workload_time(self, step: TrainerStep, units: list, d: int, side: str, drain: float = None):
        """M_t(U, d): chunks of s_max·d samples per stage, summed. With ``drain``, also the number of
        leading units the primaries finish within ``drain`` seconds (DrainPrefix)."""
        total, drained, i = 0.0, 0, 0
        size = self.settings.max_chunk * d
        while i < len(units):
            stage = units[i][0]
            j = i
            while j < len(units) and j - i < size and units[j][0] == stage:
                j += 1
            idx = [u[1] for u in units[i:j]]
            t = self._chunk_time(stage, [step.prompt_lens[k] for k in idx],
                                 [step.response_lens[k] for k in idx], d, side)
            total += t
            if drain is not None and total <= drain:
                drained = j
            i = j
        return total, drained

    def _start_aux_training(self):
        step = self.step
        if step is None or self.phase != "consuming" or not step.pending:
            self._revoke(P.ROLLOUT_POOL)
            return
        if not self.policy.model_split:
            step.plan_proportional(self._gang("primary"), self._gang("auxiliary"))
        self._schedule_chunks()

    # =============================================================================================
    # leases and sync
    # =============================================================================================
    def _revoke(self, pool: str):
        """Preempt-and-yield (§3.2): auxiliaries stop taking work, return what is recoverable, then yield."""
        if self.owner[pool] != "auxiliary" or pool in self.revoking:
            return
        self.revoking.add(pool)
        if pool == P.TRAINER_POOL:
            for w in self.topology.aux_rollouters:
                if self.buffer.running_on(w) and w not in self.stopping and w not in self.failed:
                    self.stopping.add(w)
                    self._out.append(P.Interrupt(w, None, "revoke"))
        else:
            step = self.step
            if step is not None:
                for c in step.live("auxiliary"):
                    if c.status == "queued":
                        self._out.append(P.CancelChunk(AUX_TRAINER, c.chunk.chunk_id))
                step.release_plan()
        self._maybe_switch_out(pool)

    def _maybe_switch_out(self, pool: str):
        if pool not in self.revoking or self.owner[pool] != "auxiliary":
            return
        if pool == P.TRAINER_POOL:
            if any(self.buffer.running_on(w) for w in self.topology.aux_rollouters if w not in self.failed) \
                    or any(w in self.stopping for w in self.topology.aux_rollouters):
                return
            costs = self.profiler.costs[ROT]
            self.owner[pool] = "switching"
            self.aux_assigned.clear()
            self._out.append(P.Switch(pool, "trainer", ROT, "out", costs.c_out))
        else:
            if self.step is not None and self.step.live("auxiliary") and AUX_TRAINER not in self.failed:
                return
            costs = self.profiler.costs[TOR]
            self.owner[pool] = "switching"
            self._out.append(P.Switch(pool, "rollout", TOR, "out", costs.c_out))
        self.revoking.discard(pool)

    def _maybe_sync(self):
        """After the optimizer step: push the new weights once primaries have stopped or drained."""
        for pool in list(self.revoking):
            self._maybe_switch_out(pool)
        if self.phase == "consuming" and self.step is not None:
            self._schedule_chunks()
        if not self.sync_wanted or self.owner[P.ROLLOUT_POOL] != "primary":
            return
        rollouters = [w for w in self.topology.rollouters if w not in self.failed]
        if any(w in self.stopping for w in rollouters):
            return
        if not self.settings.partial_rollout and any(self.buffer.running_on(w) for w in rollouters):
            return
        self.sync_wanted = False
        self._out.append(P.SyncWeights(self.trainer_version, tuple(rollouters),
                                       expected=0.0))
