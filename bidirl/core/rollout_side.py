"""The coordinator's rollout side (paper §3, §5.1): committing groups, dispatching prompt groups to the primary
rollouters under the staleness rule, and **Rollouter-on-TrainerPool** windows — admission (Eq. 3), the
auxiliary rollouters' share (Eq. 4) and the migration of unfinished groups with their prefixes.

A part of :class:`bidirl.core.coordinator.Coordinator`, split out by concern: the methods read and write the
coordinator's state (its fields are declared there) and append commands to ``self._out``.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from bidirl.core import gates
from bidirl.core import protocol as P
from bidirl.core.phase import Phase
from bidirl.core.progress import ResponseEnds
from bidirl.core.schedule import SCHEDULE_RULE

ROT = P.ROLLOUT_ON_TRAINER_POOL


class RolloutSide:
    """Rollout dispatch and Rollouter-on-TrainerPool (methods of the coordinator; no state of their own)."""

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
        self._generate(tasks)

    def _generate(self, tasks: dict) -> None:
        """Send each worker its tasks (one ``Generate``: one prefill wave) and note when the groups joined it
        (:class:`bidirl.core.progress.DecodeProgress`, what the Rollouter-on-TrainerPool gate reads progress from;
        only where the policy has that gate)."""
        note = self.policy.rollout_on_trainer_pool
        prompt = self.profiler.typical_prompt(self.prior) if note else 0
        fresh = (0,) * self.settings.group_size
        for w, ts in tasks.items():
            if not ts:
                continue
            self._out.append(P.Generate(w, tuple(ts), self.rollout_version))
            if note:
                self.decode.join(w, self._now, [
                    (t.group_id, prompt, fresh) if t.resume is None else
                    (t.group_id, t.resume.prompt_len, tuple(h for h, d in zip(t.resume.generated, t.resume.done)
                                                            if not d))
                    for t in ts])

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
        groups, q = self._rollout_work()
        if q <= 0:
            return
        self.evaluated.add(key)
        costs = self.profiler.charged(ROT, self._now)
        primaries = self._alive(self.topology.rollouters)
        d_p, d_a = len(primaries), len(self._alive(self.topology.aux_rollouters))
        scales = self.profiler.scales

        def replica_time(context, remaining, prefill):
            return scales[("r", P.PRIMARY)] * self.predictor.replica_time(context, remaining, prefill)

        def replica_times(request_sets):
            return [scales[("r", P.PRIMARY)] * t for t in self._many("replica_times", "replica_time", request_sets)]

        gate = gates.rollout_gate(groups, primaries, d_a, gates.rollout_dispatch(q, d_p, d_a), replica_time,
                                  self.profiler.response_sample(self.prior), costs, self.policy.gated,
                                  replica_times=replica_times, prior=self.prior[1])
        self._decide(ROT, gate.admitted, gate.gain, gate.cost,
                     {"deficit": q, "load": len(groups), "q_a": gate.q_a, "d_p": d_p, "d_a": d_a,
                      "t_no": gate.t_primary, "t_joint": gate.t_joint, "step": self.trainer_version})

    def _rollout_work(self) -> tuple:
        """``(groups, Q_r)``: every unfinished group on (or waiting for) the primary rollouters, with its estimated
        progress — the prefix it came back with, plus one token per decode iteration its worker is estimated to
        have run since the group joined it, replayed over the load the worker had meanwhile
        (:class:`bidirl.core.progress.DecodeProgress`), each iteration and prefill wave timed by the predictor
        scaled as the gate scales it — and whether the next batch waits for it (:meth:`_waited_for`)."""
        prompt = self.profiler.typical_prompt(self.prior)
        mine = {}
        for gid, rec in self.buffer.groups.items():
            if rec.status == "partial" or (rec.status == "running" and rec.worker and P.is_primary(rec.worker)):
                mine[gid] = rec
        scale = self.profiler.scales[("r", P.PRIMARY)]

        def iteration_time(contexts):
            return scale * self.predictor.iteration_time(contexts)

        def prefill_time(contexts):
            n = len(contexts)
            return scale * self.predictor.replica_time(contexts, [0] * n, [True] * n)

        lengths = ResponseEnds(self.profiler.response_sample(self.prior), self.prior[1])
        grown_by = {}
        for w in self._alive(self.topology.rollouters):
            if self.buffer.running_count(w):
                grown_by.update(self.decode.iterations(w, self._now, iteration_time, prefill_time, lengths))
        work = {}
        for gid, rec in mine.items():
            st = rec.state
            p = st.prompt_len if st is not None else prompt
            held = st.generated if st is not None else (0,) * self.settings.group_size
            done = st.done if st is not None else (False,) * self.settings.group_size
            grown = 0
            if rec.status == "running":
                grown = int(grown_by.get(gid, 0.0))
                held, done = _ended(held, done, grown, lengths)
            work[gid] = (rec, p, held, done, grown)
        needed, q = self._waited_for({gid: (held, done) for gid, (_, _, held, done, _) in work.items()})
        return [gates.GroupWork(gid, rec.worker if rec.status == "running" else None, p, held, done,
                                gid in needed, (rec.version, -gid), prefilling=grown == 0)
                for gid, (rec, p, held, done, grown) in work.items()], q

    def _waited_for(self, progress: dict) -> tuple:
        """``(ids, Q_r)``: the unfinished groups the next batch is expected to wait for, and how many groups it
        still needs (§5.2's deficit, "the rollout groups required to start training under the staleness bound").
        Under the look-ahead rule the batch need not wait for the oldest groups still generating
        (:meth:`bidirl.core.buffer.RolloutBuffer.waited_for`): it waits for the groups its tags require, those
        expected to complete first — the smallest expected longest remaining length
        (:meth:`bidirl.core.gates.RemainingLengths.expected_max`) of ``progress`` (gid -> (tokens held, done)),
        a group without an estimate last. Under the other rules, the ``B`` oldest live groups."""
        rule = SCHEDULE_RULE if self.settings.reproducible else self.policy.batch_rule
        if rule != "lookahead":
            return {r.group_id for r in self.buffer.needed()}, self.buffer.deficit(self.trainer_version)
        ids = list(progress)
        lengths = gates.RemainingLengths.of([h for g in ids for h in progress[g][0]],
                                            [d for g in ids for d in progress[g][1]],
                                            self.profiler.response_sample(self.prior), self.prior[1])
        ends = np.cumsum([len(progress[g][0]) for g in ids])
        expected = {g: lengths.expected_max(np.arange(e - len(progress[g][0]), e)) for g, e in zip(ids, ends)}
        size, room = self._batch_shape()
        records, unadmitted = self.buffer.waited_for(self.trainer_version,
                                                     lambda r: expected.get(r.group_id, math.inf), size, room)
        return {r.group_id for r in records}, len(records) + unadmitted

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
        groups, q = self._rollout_work()
        d_a = len(self._active_rollouters(P.TRAINER_POOL))
        q_a = gates.rollout_dispatch(q, len(self._alive(self.topology.rollouters)), d_a) if d_a else 0
        if q_a <= 0 or self._batch() is not None:
            self._revoke(P.TRAINER_POOL, "the primaries had completed the batch when the switch in ended"
                         if self._batch() is not None else
                         f"Eq. 4 gave the borrowed pool no group when the switch in ended (deficit {q})")
            return
        # the groups the batch waits for move, parked ones first, then those with the least progress (latest
        # admitted) among the ones running on primaries — the order the gate assumed (gates.rollout_gate)
        needed = [self.buffer.groups[g.group_id] for g in groups if g.needed and g.group_id not in self.migrating]
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
        self._generate(tasks)


def _ended(held: tuple, done: tuple, grown: int, lengths) -> tuple:
    """A running group's responses after ``grown`` more tokens each: those whose end (``lengths``, the ends the
    progress replay took them to have, :class:`bidirl.core.progress.ResponseEnds`) is reached by then have ended
    there, the rest hold ``grown`` more tokens. The group has not reported finishing, so its longest-ending
    response is still running whatever the ends say."""
    todo = [i for i, d in enumerate(done) if not d]
    if not todo:
        return held, done
    ends = lengths(tuple(held[i] for i in todo))
    last = max(range(len(todo)), key=lambda j: (ends[j], j))
    held, done = list(held), list(done)
    for j, i in enumerate(todo):
        if j != last and ends[j] <= held[i] + grown:
            held[i], done[i] = int(ends[j]), True
        else:
            held[i] += grown
    return tuple(held), tuple(done)

