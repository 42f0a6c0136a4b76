"""The coordinator's trainer side (paper §3, §5.2, Algorithm 2): forming a step's batch, the stage-ordered
chunk queue on the primary trainers, and **Trainer-on-RolloutPool** windows — admission, LazyPull, the
TailWindow's reclaim and JointTailSplit, the auxiliary gang's chunks and the step's finish.

A part of :class:`bidirl.core.coordinator.Coordinator`, split out by concern: the methods read and write the
coordinator's state (its fields are declared there) and append commands to ``self._out``.
"""

from __future__ import annotations

import functools
from typing import Optional

from bidirl.core import gates
from bidirl.core import protocol as P
from bidirl.core.chunks import TrainerStep
from bidirl.core.phase import Phase
from bidirl.core.schedule import SCHEDULE_RULE
from bidirl.core.staleness import check_batch

TOR = P.TRAINER_ON_ROLLOUT_POOL


class TrainerSide:
    """The trainer step's chunks and Trainer-on-RolloutPool (methods of the coordinator; no state of their own)."""

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
        rule = SCHEDULE_RULE if self.settings.reproducible else self.policy.batch_rule
        if self.settings.updates_per_sync == 1:
            return self.buffer.select_batch(self.trainer_version, rule)
        size, room = self._batch_shape()
        return self.buffer.select_batch(self.trainer_version, rule, size=size, room=room)

    def _batch_shape(self) -> tuple:
        """``(size, room)`` of the next batch: the whole batch ``B`` and no room, or with streaming consumption the
        next local update's ``B/U`` groups and the groups of this version the step's later local updates take."""
        s = self.settings
        if s.updates_per_sync == 1:
            return s.batch, 0
        size = s.batch // s.updates_per_sync
        return size, s.batch - size * (self.local_update + 1)

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
        self._out.append(P.StartStep(self.step.step, self.trainer_version, tuple(groups), self.local_update))
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
        step = TrainerStep(step=index, version=self.trainer_version, groups=groups, stages=s.stages,
                           micro_batch_per_device=s.micro_batch_per_device,
                           next_chunk_id=functools.partial(next, self._chunk_ids), rho=self.topology.trainer_layout,
                           max_tokens_per_micro_batch=s.max_tokens_per_micro_batch,
                           sequence_parallel=s.sequence_parallel,
                           grid=self.topology.trainer_replicas if s.reproducible else None,
                           mini_batch=s.mini_batch_prompts * s.group_size if s.mini_batch_prompts else None,
                           version_weights=self.local_update == 0,
                           aux_refresh=s.aux_refresh_seconds is not None)
        step.updates_before = self.local_update * step.update_segments   # local updates have equal mini-batches
        return step

    def _schedule_chunks(self):
        step = self.step
        if step is not None and self.phase is Phase.ROLLING_BACK:
            self._restart_step()
            return
        if step is None or self.phase is not Phase.CONSUMING:
            return
        while step.segment_done:
            if step.at_mini_batch_end:       # the mini-batch's optimizer step before the next one's chunks
                if not step.optimizing and P.PRIMARY_TRAINER not in self.failed:
                    self._step_mini_batch(step)
                return
            if not step.advance_segment():
                break
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
        if aux_on and step.aux_needs_refresh and P.AUX_TRAINER not in self.failed:
            self._refresh_aux_weights(step)
        if step.reclaiming:
            return                           # the split waits for the reclaimed chunks' answers
        if aux_on and self.policy.model_split and step.in_tail_window(
                self._gang(P.PRIMARY), self._gang(P.AUXILIARY), self.settings.tail_window):
            step.plan_tail(self._gang(P.PRIMARY), self._gang(P.AUXILIARY),
                           self._ready_in(P.PRIMARY),
                           self._ready_in(P.AUXILIARY) + self._yield_lag(step) + self._refresh_lag(step),
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
                and step.segment_index >= step.aux_last_segment:
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
        ``max(t_p, t_a + max(0, C_out − g))``: the lag is added to the auxiliary side's ready time (the split whose
        end :func:`bidirl.core.gates.window_tail` predicts for the trainer gate). 0 before the last segment (the
        window goes on)."""
        if step.segment_index != len(step.segments) - 1:
            return 0.0
        costs = self.profiler.charged(TOR, self._now)
        return max(0.0, costs.c_out - costs.c_grad - self.settings.optimizer_seconds)

    def _ran(self, side: str) -> float:
        """Predicted seconds ``side`` has already run of the chunks it started and has not finished (each at most
        its predicted time): what :meth:`_ready_in` leaves out of them."""
        return sum(min(max(0.0, self._now - c.started), c.predicted)
                   for c in self.step.live(side) if c.started is not None)

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
        self._merge_then_step(step)

    def _merge_then_step(self, step) -> None:
        """The auxiliary update chunks' gradients not merged yet go to the primary gang (C_grad; the optimizer step
        follows when they arrived, :meth:`_on_GradientsMerged`), or the optimizer step now."""
        if step.aux_update_chunks:
            aux = set(step.aux_update_chunks)
            aux_ids = tuple(c for c in step.merge_order if c in aux)
            self._out.append(P.MergeGradients(step.step, aux_ids, self.profiler.costs[TOR].c_grad))
        else:
            self._optimizer_step(step)

    def _optimizer_step(self, step) -> None:
        """The optimizer step over the current update segment's chunks in merge order: a mini-batch's
        (``step.optimizing``: the version kept) or the local update's ``final`` one (:meth:`_update_version`)."""
        version = self.trainer_version if step.optimizing else self._update_version()
        self._out.append(P.OptimizerStep(step.step, version, step.update_merge_order(), final=not step.optimizing))

    def _step_mini_batch(self, step) -> None:
        """An optimizer mini-batch's chunks are all merged and another mini-batch follows (``rl.mini_batch_prompts``,
        veRL's ``ppo_mini_batch_size``): the auxiliary window ends — the next mini-batch computes on weights only the
        primary gang will hold — its gradients are merged, and the primary gang takes the mini-batch's optimizer
        step, keeping the version (weights sync once per step). The next segment opens when it is done
        (:meth:`_on_OptimizerStepped`)."""
        step.optimizing = True
        if not step.aux_refresh:
            self._revoke(P.ROLLOUT_POOL, "the optimizer mini-batch it could run ended (the next one computes on the "
                                         "updated weights)")
        self._merge_then_step(step)

    # ---- the auxiliary gang's weights across optimizer steps (bidirl.core.aux_weights) ------------------
    def _refresh_aux_weights(self, step) -> None:
        """The auxiliary gang holds weights older than the current segment's (the switch in loaded the version's;
        an optimizer step kept the version since): the primaries send it their current weights (one weight
        transfer, ``settings.aux_refresh_seconds``) before it is handed a chunk of the segment."""
        step.aux_refreshing = True
        self._out.append(P.RefreshWeights(P.AUX_TRAINER, step.step, self.trainer_version, step.weights_at(),
                                          self.settings.aux_refresh_seconds))

    def _on_WeightsRefreshed(self, ev: P.WeightsRefreshed):
        """The auxiliary gang holds the refreshed weights: it pulls the segment's chunks. If another optimizer step
        came meanwhile (the primaries finished the mini-batch alone) they are already old, and :meth:`_schedule_chunks`
        refreshes it again. A refresh no window waits for (revoked, rolled back, another local update's) changes
        nothing."""
        step = self.step
        if step is None or ev.step != step.step or not step.aux_refreshing or not self.leases[P.ROLLOUT_POOL].lent:
            return
        step.aux_refreshing, step.aux_weights = False, ev.updates
        self._schedule_chunks()

    def _refresh_lag(self, step) -> float:
        """What a refresh under way adds to the auxiliary side's ready time (at most its whole predicted transfer)."""
        return (self.settings.aux_refresh_seconds or 0.0) if step.aux_refreshing else 0.0

    # ---- Trainer-on-RolloutPool --------------------------------------------------------------
    def _consider_trainer_on_rollout_pool(self):
        """Algorithm 2, lines 1-6 (:func:`bidirl.core.gates.trainer_gate`) when the rollout pool idles."""
        step = self.step
        key = (TOR, self.trainer_version, self.idle_windows[P.ROLLOUT_POOL])
        if (not self.policy.trainer_on_rollout_pool or step is None or key in self.evaluated
                or self.phase is not Phase.CONSUMING or not self.topology.aux_trainer_replicas
                or P.AUX_TRAINER in self.failed or not self._rollout_pool_idle()
                or step.aux_window_closed):
            return
        stages, samples = step.remaining_work(until=step.aux_last_segment + 1)
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
                                  self.settings.micro_batch_per_device, self.profiler.charged(TOR, self._now),
                                  self.policy.gated,
                                  rho=self.topology.trainer_layout, optimizer=self.settings.optimizer_seconds,
                                  chunk_len=chunk_len, sequence_parallel=self.settings.sequence_parallel,
                                  ran=self._ran(P.PRIMARY))
        if step.aux_refresh:
            gate = gates.charge_refreshes(gate, step.refreshes_from(step.segment_index),
                                          self.settings.aux_refresh_seconds, self._gang(P.PRIMARY),
                                          self._gang(P.AUXILIARY), self.policy.gated)
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
        step.aux_weights, step.aux_refreshing = 0, False   # the switch in loaded the version's weights
        if not self.policy.model_split and step.pending:
            step.plan_proportional(self._gang(P.PRIMARY), self._gang(P.AUXILIARY))
        self._schedule_chunks()

    @staticmethod
    def _window_has_work(step) -> bool:
        """Whether a Trainer-on-RolloutPool window opening now can still get a chunk of ``step``: units of the
        current segment not yet sent, or a later segment (opened at the barrier)."""
        if step.aux_window_closed:
            return False
        return bool(step.pending) or step.segment_index < step.aux_last_segment
