"""The coordinator as a sans-I/O state machine (h11 style): feed events, assert the commands that come out.

Each test walks one borrowing direction through a whole life — admitted, dispatched, revoked on batch-ready,
revoked on failure, rejected by the gate — with a tiny linear predictor, so every number is easy to follow.
"""

import numpy as np
import pytest

from bidirl.core import protocol as P
from bidirl.core.coordinator import Coordinator, Settings, Topology
from bidirl.core.lease import Lease, LeaseError, PoolLease
from bidirl.core.policies import get_policy
from bidirl.core.profiler import Profiler

ROT, TOR = P.ROLLOUT_ON_TRAINER_POOL, P.TRAINER_ON_ROLLOUT_POOL
R0, R1 = P.rollouter(P.ROLLOUT_POOL, 0), P.rollouter(P.ROLLOUT_POOL, 1)
A0, A1 = P.rollouter(P.TRAINER_POOL, 0), P.rollouter(P.TRAINER_POOL, 1)


class LinearPredictor:
    """Rollout: 10 ms per response token spread over the replicas (prefill free); trainer: 1 ms per token per
    replica."""

    def rollout_time(self, prompt_lens, response_lens, d):
        return 0.01 * float(np.sum(response_lens)) / d

    def replica_time(self, context, remaining, prefill):
        return 0.01 * float(np.sum(remaining))

    def iteration_time(self, context):
        return 0.01

    def chunk_time(self, stage, prompt_lens, response_lens, d):
        return 0.001 * float(np.sum(prompt_lens) + np.sum(response_lens)) / d


def coordinator(policy="bidirl", staleness=0.0, cost=0.1, batch=4, steps=2):
    costs = {d: P.SwitchCosts(cost, cost, cost / 2) for d in P.DIRECTIONS}
    settings = Settings(batch=batch, group_size=2, staleness=staleness, partial_rollout=True,
                        stages=("old_logprob", "actor_update"), micro_batch_per_device=1, tail_window=2, steps=steps)
    topology = Topology(rollout_replicas=2, trainer_replicas=2, aux_rollout_replicas=2, aux_trainer_replicas=2)
    prior = (np.full(64, 10), np.full(64, 100))
    return Coordinator(settings, topology, get_policy(policy), LinearPredictor(), Profiler(costs=costs), prior)


def of(kind, msgs):
    return [m for m in msgs if isinstance(m, kind)]


def done_group(gid, version=0, tokens=100):
    return P.GroupState(gid, 10, (tokens, tokens), (True, True), version)


def prefix(gid, version=0, tokens=3):
    return P.GroupState(gid, 10, (tokens, tokens), (False, False), version)


def where(msgs):
    """group id -> rollouter, from the Generate commands."""
    return {t.group_id: g.worker for g in of(P.Generate, msgs) for t in g.tasks}


# --------------------------------------------------------------------------------------------------
# the lease state machine
# --------------------------------------------------------------------------------------------------

def test_the_lease_goes_round_its_cycle_and_refuses_anything_else():
    lease = PoolLease(P.TRAINER_POOL)
    for event, state in (("lend", Lease.SWITCHING_IN), ("switched", Lease.LENT), ("revoke", Lease.REVOKING),
                         ("yield", Lease.SWITCHING_OUT), ("switched", Lease.PRIMARY)):
        assert lease.fire(event) is state
    with pytest.raises(LeaseError, match=r"trainer_pool: 'revoke' is not allowed while the lease is primary"):
        lease.fire("revoke")
    lease.fire("lend")
    with pytest.raises(LeaseError, match=r"'lend' is not allowed while the lease is switching_in .*switched"):
        lease.fire("lend")


# --------------------------------------------------------------------------------------------------
# Rollouter-on-TrainerPool
# --------------------------------------------------------------------------------------------------

def test_at_staleness_one_the_gate_waits_for_the_groups_that_complete_the_batch_not_the_oldest():
    # s = 1, B = 4: the run-ahead bound admits 8 groups of version 0, and any 4 of them complete its batch (the
    # rest can go into the next one). Once three run-ahead groups are done the batch waits for one more group —
    # where a batch of the 4 oldest would still wait for groups 0-3
    c = coordinator(staleness=1.0)
    placed = where(c.handle(P.Started(0.0)))
    for t, g in ((1.0, 4), (1.5, 5), (2.0, 6)):
        c.handle(P.GroupFinished(t, placed[g], done_group(g)))
    groups, q = c._rollout_work()
    assert q == 1 and sum(g.needed for g in groups) == 1
    assert c.buffer.deficit(0) == 4


@pytest.mark.parametrize("allocation_left, admitted", [(0.0, True), (3.0, True), (10.0, False)])
def test_the_rollout_gate_charges_what_is_left_of_the_first_switch_allocation(allocation_left, admitted):
    # the trainer engines reserve the first switch's pinned buffer in the background from their load at t = 0:
    # a window lent now waits for what is left of it, so the gate charges it (C_in = 0.1 + left). The case of
    # the test above, T_no = 8 s: with 3 s left, f = 3.1 / 8, past the switch pair the batch waits
    # max(6 − 3.2, 2 · (1 − 3.1 / 8)) = 2.8 s, still a gain; with 10 s left the switch pair alone exceeds T_no
    c = coordinator(staleness=1.0)
    if allocation_left:
        c.profiler.first_switch = {(ROT, "c_in"): allocation_left}
    (decided,) = of(P.Decided, c.handle(P.Started(0.0)))
    d = decided.decision
    assert d.cost == pytest.approx(0.2 + allocation_left) and d.admitted is admitted
    if allocation_left == 3.0:
        assert d.detail["t_joint"] == pytest.approx(6.0 - 3.2)


def test_rollout_on_trainer_pool_admitted_dispatched_and_revoked_when_the_batch_is_ready():
    c = coordinator(staleness=1.0)
    out = c.handle(P.Started(0.0))
    # the run-ahead bound admits (v + 1 + s)·B = 8 groups, dealt to the least-loaded primary rollouter
    placed = where(out)
    assert sorted(placed) == list(range(8)) and set(placed.values()) == {R0, R1}
    # the trainer pool idles (no batch yet): the gate on the work the batch waits for, Q_r = 4 groups (0-3) of
    # 2 × 100 expected tokens, two on each primary beside two run-ahead groups that share its iterations up to
    # the needed groups' last token: T_no = 4 × 200 tokens × 10 ms = 8 s. Eq. 4 moves Q_a = 2 needed groups (one
    # per auxiliary: 2 s, after C_in drained 0.1 / 8 of it); each primary keeps one needed group and its load:
    # 6 s from now, through both switches (0.2 s), so past the switch pair the batch waits max(6 − 0.2, 2 · (1 −
    # 0.1 / 8)) = 5.8 s.
    (decided,) = of(P.Decided, out)
    d = decided.decision
    assert d.direction == ROT and d.admitted and d.detail["deficit"] == 4 and d.detail["load"] == 8
    assert d.detail["t_no"] == pytest.approx(8.0) and d.detail["t_joint"] == pytest.approx(6.0 - 0.2)
    assert d.predicted_gain == pytest.approx(8.0 - (6.0 - 0.2)) and d.cost == pytest.approx(0.2)
    assert of(P.Switch, out) == [P.Switch(P.TRAINER_POOL, P.ROLLOUT, ROT, "in", 0.1, 0)]
    assert c.view().leases[P.TRAINER_POOL] == "switching_in"

    # dispatch (Eq. 4): Q_a = round(2/4 · 4) = 2 needed groups move off the primaries, least progress first
    out = c.handle(P.SwitchFinished(1.0, P.TRAINER_POOL, P.ROLLOUT, 0.1))
    interrupts = of(P.Interrupt, out)
    moved = sorted(g for i in interrupts for g in i.group_ids)
    assert moved == [2, 3] and {i.worker for i in interrupts} == {placed[2], placed[3]}
    resumed = []
    for i in interrupts:
        out = c.handle(P.GenerationStopped(1.5, i.worker, tuple(prefix(g) for g in i.group_ids)))
        resumed += [(g.worker, t.group_id, t.resume) for g in of(P.Generate, out) for t in g.tasks]
    assert {w for w, _, _ in resumed} == {A0, A1} and sorted(g for _, g, _ in resumed) == [2, 3]
    assert all(r is not None and r.generated == (3, 3) for _, _, r in resumed), "prefixes resume, never restart"

    # the primaries finish their needed groups, one auxiliary its group; the batch still waits for the other one
    aux_of = {g: w for w, g, _ in resumed}
    for t, g, w in ((1.5, 0, placed[0]), (1.6, 1, placed[1]), (1.8, 2, aux_of[2])):
        out = c.handle(P.GroupFinished(t, w, done_group(g)))
        assert not of(P.Switch, out) and not of(P.StartStep, out)
    assert c.view().leases[P.TRAINER_POOL] == "lent"
    # the last needed group completes on its auxiliary: the batch is ready, the lease is revoked and, nothing of the
    # auxiliaries running any more, the pool switches back to the trainer at once
    out = c.handle(P.GroupFinished(2.1, aux_of[3], done_group(3)))
    assert of(P.Switch, out) == [P.Switch(P.TRAINER_POOL, P.TRAINER, ROT, "out", 0.1, 0)] and not of(P.StartStep, out)
    out = c.handle(P.SwitchFinished(2.5, P.TRAINER_POOL, P.TRAINER, 0.2))
    (start,) = of(P.StartStep, out)
    assert [g.group_id for g in start.groups] == [0, 1, 2, 3] and start.version == 0
    assert of(P.RunChunk, out)[0].worker == P.PRIMARY_TRAINER
    assert c.view().leases[P.TRAINER_POOL] == "primary"


def test_rollout_on_trainer_pool_revoked_when_the_batch_is_ready_while_auxiliaries_still_generate():
    """At s = 1 a batch may form from other complete groups of an allowed version: the auxiliaries are then
    interrupted, hand their prefixes back and the pool returns to the trainer."""
    c = coordinator(staleness=1.0)
    placed = where(c.handle(P.Started(0.0)))
    out = c.handle(P.SwitchFinished(1.0, P.TRAINER_POOL, P.ROLLOUT, 0.1))
    aux = {}
    for i in of(P.Interrupt, out):
        for g in of(P.Generate, c.handle(P.GenerationStopped(1.5, i.worker, tuple(prefix(x) for x in i.group_ids)))):
            aux.update({t.group_id: g.worker for t in g.tasks})
    assert sorted(aux) == [2, 3]
    # groups 0, 1 and the run-ahead groups 4, 5 complete on the primaries: four version-0 groups form the batch
    for t, g in ((2.0, 0), (2.1, 1), (2.2, 4)):
        assert not of(P.Interrupt, c.handle(P.GroupFinished(t, placed[g], done_group(g))))
    out = c.handle(P.GroupFinished(2.3, placed[5], done_group(5)))
    revoke = of(P.Interrupt, out)
    assert {i.worker for i in revoke} == set(aux.values()) and c.view().leases[P.TRAINER_POOL] == "revoking"
    back = {}
    for k, i in enumerate(revoke):
        assert not of(P.Switch, out)
        out = c.handle(P.GenerationStopped(2.4 + 0.1 * k, i.worker,
                                           tuple(prefix(g, tokens=9) for g, w in aux.items() if w == i.worker)))
        back.update({t.group_id: (g.worker, t.resume) for g in of(P.Generate, out) for t in g.tasks})
    assert of(P.Switch, out) == [P.Switch(P.TRAINER_POOL, P.TRAINER, ROT, "out", 0.1, 0)]
    # the prefixes resume on the primaries, never regenerated; once the pool is back the step starts
    assert {back[2][0], back[3][0]} <= {R0, R1} and back[2][1].generated == (9, 9)
    (start,) = of(P.StartStep, c.handle(P.SwitchFinished(2.8, P.TRAINER_POOL, P.TRAINER, 0.2)))
    assert sorted(g.group_id for g in start.groups) == [0, 1, 4, 5]


def test_rollout_on_trainer_pool_revoked_when_an_auxiliary_rollouter_dies():
    c = coordinator(staleness=1.0)
    c.handle(P.Started(0.0))
    out = c.handle(P.SwitchFinished(1.0, P.TRAINER_POOL, P.ROLLOUT, 0.1))
    aux = {}
    for i in of(P.Interrupt, out):
        for g in of(P.Generate, c.handle(P.GenerationStopped(1.5, i.worker, tuple(prefix(x) for x in i.group_ids)))):
            aux.update({t.group_id: g.worker for t in g.tasks})
    dead = aux[2]
    out = c.handle(P.WorkerFailed(2.0, dead, "actor died"))
    resumed = {t.group_id: g.worker for g in of(P.Generate, out) for t in g.tasks}
    # the lease is revoked: surviving auxiliaries holding groups are interrupted, then the pool is given back
    assert c.view().failed == (dead,)
    for i in of(P.Interrupt, out):
        assert i.worker != dead
        out = c.handle(P.GenerationStopped(2.1, i.worker, tuple(prefix(g) for g, w in aux.items() if w == i.worker)))
        resumed.update({t.group_id: g.worker for g in of(P.Generate, out) for t in g.tasks})
    assert [s.phase for s in of(P.Switch, out)] == ["out"] and c.view().leases[P.TRAINER_POOL] == "switching_out"
    # nothing is lost with the worker: its groups resume on the primaries once they own the pool again
    c.handle(P.SwitchFinished(2.5, P.TRAINER_POOL, P.TRAINER, 0.1))
    assert c.view().leases[P.TRAINER_POOL] == "primary"
    lost = {g for g, w in aux.items() if w == dead}
    assert lost and all(resumed.get(g) in (R0, R1) for g in lost), resumed
    # a primary rollouter's death is recovered as well: its groups resume on the other primary
    on_r0 = {g for g, w in resumed.items() if w == R0}
    moved = {t.group_id: g.worker for g in of(P.Generate, c.handle(P.WorkerFailed(3.0, R0, "boom"))) for t in g.tasks}
    assert on_r0 and on_r0 <= set(moved) and set(moved.values()) == {R1}, moved


def test_rollout_on_trainer_pool_rejected_by_the_gate_when_switching_costs_more_than_it_saves():
    c = coordinator(staleness=1.0, cost=5.0)
    out = c.handle(P.Started(0.0))
    (decided,) = of(P.Decided, out)
    assert decided.decision.direction == ROT and not decided.decision.admitted
    assert decided.decision.cost == pytest.approx(10.0) and decided.decision.predicted_gain < 10.0
    assert not of(P.Switch, out) and c.view().leases[P.TRAINER_POOL] == "primary"
    # the opportunistic ablation borrows whatever the cost
    out = coordinator("opportunistic", staleness=1.0, cost=5.0).handle(P.Started(0.0))
    assert of(P.Decided, out)[0].decision.admitted and of(P.Switch, out)


# --------------------------------------------------------------------------------------------------
# Trainer-on-RolloutPool
# --------------------------------------------------------------------------------------------------

def _consume_start(c):
    """At s = 0 the rollouters generate one batch and then idle while it trains: Started, four completions."""
    placed = where(c.handle(P.Started(0.0)))
    out = []
    for g in range(4):
        out = c.handle(P.GroupFinished(1.0 + g, placed[g], done_group(g)))
    return out


def test_trainer_on_rollout_pool_admitted_pulls_chunks_lazily_merges_in_order_and_yields():
    c = coordinator("tor-only")
    out = _consume_start(c)
    (start,) = of(P.StartStep, out)
    assert start.step == 0 and len(start.groups) == 4
    (first,) = of(P.RunChunk, out)
    assert first.worker == P.PRIMARY_TRAINER and first.chunk.per_device == 1 and len(first.chunk.samples) == 2
    # Algorithm 2: T_no = 8 chunks of 2 × 110 tokens on 2 replicas; the rollout pool idles, so it is lent
    (decided,) = of(P.Decided, out)
    d = decided.decision
    assert d.direction == TOR and d.admitted and d.detail["t_no"] == pytest.approx(8 * 0.11)
    assert of(P.Switch, out) == [P.Switch(P.ROLLOUT_POOL, P.TRAINER, TOR, "in", 0.1, 0)]
    out = c.handle(P.ChunkStarted(4.0, P.PRIMARY_TRAINER, first.chunk.chunk_id))
    out = c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1))
    # lazy pull: the auxiliary gang gets the next chunk as soon as it is ready
    (aux,) = of(P.RunChunk, out)
    assert aux.worker == P.AUX_TRAINER and aux.chunk.order > first.chunk.order
    live = {first.chunk.chunk_id: first, aux.chunk.chunk_id: aux}
    chunks = {cmd.chunk.chunk_id: cmd.chunk for cmd in live.values()}
    t, finished_order, merged = 4.2, [], None
    while live:
        # finish the auxiliary's chunks first when both run: the merge must still follow the original order
        cid = max(live, key=lambda k: (live[k].worker == P.AUX_TRAINER, k))
        cmd = live.pop(cid)
        finished_order.append(cid)
        c.handle(P.ChunkStarted(t, cmd.worker, cid))
        out = c.handle(P.ChunkFinished(t + 0.05, cmd.worker, cid, 0.05))
        t += 0.1
        for run in of(P.RunChunk, out):
            live[run.chunk.chunk_id] = run
            chunks[run.chunk.chunk_id] = run.chunk
        if of(P.MergeGradients, out) or of(P.OptimizerStep, out):
            merged = out
    # the auxiliary did actor-update chunks, so their gradients merge (C_grad) before the optimizer step
    switch_out = [s for s in of(P.Switch, merged) if s.phase == "out"] or None
    (merge,) = of(P.MergeGradients, merged)
    assert finished_order != sorted(finished_order, key=lambda k: chunks[k].order), "chunks finished out of order"

    def in_original_order(ids):
        return [chunks[k].order for k in ids] == sorted(chunks[k].order for k in ids)
    assert merge.expected == pytest.approx(0.05) and in_original_order(merge.chunk_ids)
    assert {chunks[k].stage for k in merge.chunk_ids} == {"actor_update"}
    out = c.handle(P.GradientsMerged(t, 0, 0.05))
    (opt,) = of(P.OptimizerStep, out)
    assert opt.version == 1 and in_original_order(opt.merge_order) and set(merge.chunk_ids) < set(opt.merge_order)
    assert {chunks[k].stage for k in opt.merge_order} == {"actor_update"}
    assert sum(len(chunks[k].samples) for k in opt.merge_order) == 8, "every sample's update, once"
    assert switch_out is not None or c.view().leases[P.ROLLOUT_POOL] == "switching_out"
    # the new weights wait for the rollout pool to come back to its rollouters
    out = c.handle(P.OptimizerStepped(t + 0.1, 0, 1))
    assert not of(P.SyncWeights, out)
    out = c.handle(P.SwitchFinished(t + 0.2, P.ROLLOUT_POOL, P.ROLLOUT, 0.1))
    assert of(P.SyncWeights, out) == [P.SyncWeights(1, (R0, R1))]
    out = c.handle(P.SyncFinished(t + 0.3, 1, (R0, R1), 0.1))
    (step,) = of(P.StepDone, out)
    assert step.record.step == 0 and step.record.version == 1 and step.record.samples == 8
    assert {g.worker for g in of(P.Generate, out)} == {R0, R1}, "the next batch is generated with version 1"
    assert all(g.version == 1 for g in of(P.Generate, out))


def run_chunks(c, live, t=5.0, gang=None):
    """Start and finish every chunk sent (and those that follow) in order, each on the gang it was sent to (which
    must be ``gang`` when given); returns (chunks run, last messages)."""
    ran, out = [], []
    while live:
        cmd = live.pop(0)
        if gang is not None:
            assert cmd.worker == gang
        ran.append(cmd.chunk)
        c.handle(P.ChunkStarted(t, cmd.worker, cmd.chunk.chunk_id))
        out = c.handle(P.ChunkFinished(t + 0.05, cmd.worker, cmd.chunk.chunk_id, 0.05))
        live += of(P.RunChunk, out)
        t += 0.1
    return ran, out


def _finish_on_primaries(c, live, t=5.0):
    """Run every chunk the coordinator sends to the primary gang to completion; returns (chunks run, last out)."""
    return run_chunks(c, live, t, gang=P.PRIMARY_TRAINER)


def test_trainer_on_rollout_pool_revoked_when_the_auxiliary_gang_dies_mid_chunk():
    c = coordinator("tor-only")
    (first,) = of(P.RunChunk, _consume_start(c))
    c.handle(P.ChunkStarted(4.0, P.PRIMARY_TRAINER, first.chunk.chunk_id))
    (aux,) = of(P.RunChunk, c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1)))
    c.handle(P.ChunkStarted(4.2, P.AUX_TRAINER, aux.chunk.chunk_id))
    out = c.handle(P.WorkerFailed(4.3, P.AUX_TRAINER, "actor died"))
    # its running chunk is recovered (its worker is gone), the pool goes back to the rollouters
    assert of(P.Switch, out) == [P.Switch(P.ROLLOUT_POOL, P.ROLLOUT, TOR, "out", 0.1, 0)]
    assert P.AUX_TRAINER in c.view().failed
    ran, out = _finish_on_primaries(c, [first])
    # the lost chunk's samples are redone on the primaries; nothing of the dead gang is merged
    assert set(aux.chunk.samples) <= {s for ch in ran if ch.stage == aux.chunk.stage for s in ch.samples}
    assert not of(P.MergeGradients, out) and of(P.OptimizerStep, out)


def _aux_finishes_update_chunks(c):
    """Lend the rollout pool to the auxiliary gang and run chunks on both gangs until the auxiliary one has
    finished an actor-update chunk; returns (the chunks live on the primary gang, the auxiliary update chunk)."""
    (first,) = of(P.RunChunk, _consume_start(c))
    c.handle(P.ChunkStarted(4.0, P.PRIMARY_TRAINER, first.chunk.chunk_id))
    live = of(P.RunChunk, c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1))) + [first]
    t = 4.2
    while True:
        # the auxiliary's chunks first; a primary one when the auxiliary waits for the next stage's segment
        cmd = next((x for x in live if x.worker == P.AUX_TRAINER), None) or live[0]
        live.remove(cmd)
        c.handle(P.ChunkStarted(t, cmd.worker, cmd.chunk.chunk_id))
        live += of(P.RunChunk, c.handle(P.ChunkFinished(t + 0.05, cmd.worker, cmd.chunk.chunk_id, 0.05)))
        t += 0.1
        if cmd.chunk.stage == "actor_update" and cmd.worker == P.AUX_TRAINER:
            return live, cmd


def test_an_auxiliary_gang_that_dies_holding_its_windows_gradients_rolls_the_step_back():
    """§5.2: the auxiliary gang keeps its window's update gradients on its own devices until the window ends; they
    die with it, so the step starts over with the same batch once the lost attempt's primary chunks are done."""
    c = coordinator("tor-only")
    live, aux_update = _aux_finishes_update_chunks(c)
    out = c.handle(P.WorkerFailed(6.0, P.AUX_TRAINER, "actor died"))
    assert c.view().phase == "rolling_back" and not of(P.StartStep, out)
    assert of(P.Switch, out) == [P.Switch(P.ROLLOUT_POOL, P.ROLLOUT, TOR, "out", 0.1, 0)]
    primary = [x for x in live if x.worker == P.PRIMARY_TRAINER]
    assert primary, "a primary chunk of the lost attempt is still running"
    out = []
    for k, cmd in enumerate(primary):              # the lost attempt's primary chunks finish first
        c.handle(P.ChunkStarted(6.1 + k, cmd.worker, cmd.chunk.chunk_id))
        out = c.handle(P.ChunkFinished(6.2 + k, cmd.worker, cmd.chunk.chunk_id, 0.05))
    (again,) = of(P.StartStep, out)
    assert again.step == 0 and [g.group_id for g in again.groups] == [0, 1, 2, 3]
    ran, out = _finish_on_primaries(c, of(P.RunChunk, out), t=9.0)
    assert aux_update.chunk.chunk_id not in {ch.chunk_id for ch in ran}
    assert sorted(s for ch in ran if ch.stage == "actor_update" for s in ch.samples) == \
        sorted((g, i) for g in range(4) for i in range(2)), "every sample's update once, in the new attempt"
    assert not of(P.MergeGradients, out) and of(P.OptimizerStep, out)


def test_an_auxiliary_gang_that_dies_after_handing_its_window_over_loses_nothing():
    c = coordinator("tor-only")
    live, _ = _aux_finishes_update_chunks(c)
    sent, t = [], 6.0                              # every chunk of the step runs: the window ends
    while live:
        cmd = live.pop(0)
        c.handle(P.ChunkStarted(t, cmd.worker, cmd.chunk.chunk_id))
        out = c.handle(P.ChunkFinished(t + 0.05, cmd.worker, cmd.chunk.chunk_id, 0.05))
        live += of(P.RunChunk, out)
        sent += out
        t += 0.1
    assert [s.phase for s in of(P.Switch, sent)] == ["out"] and of(P.MergeGradients, sent)
    c.handle(P.SwitchFinished(8.0, P.ROLLOUT_POOL, P.ROLLOUT, 0.1))     # it handed its window over, then left
    out = c.handle(P.WorkerFailed(8.1, P.AUX_TRAINER, "actor died"))
    assert c.view().phase == "finishing" and not of(P.StartStep, out)
    (opt,) = of(P.OptimizerStep, c.handle(P.GradientsMerged(8.2, 0, 0.05)))
    assert opt.version == 1


def test_a_cancelled_chunk_is_pulled_again_and_every_sample_runs_once():
    c = coordinator("tor-only")
    (first,) = of(P.RunChunk, _consume_start(c))
    # the first chunk runs (a queued one would go back into TailWindow's split when the auxiliaries arrive)
    c.handle(P.ChunkStarted(4.0, P.PRIMARY_TRAINER, first.chunk.chunk_id))
    (aux,) = of(P.RunChunk, c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1)))
    # the driver reclaimed the queued chunk (Table 2: queued → cancelled): its units are planned again
    live = [first] + of(P.RunChunk, c.handle(P.ChunkCancelled(4.2, P.AUX_TRAINER, aux.chunk.chunk_id)))
    finished, t = [], 5.0
    while live:
        cmd = live.pop(0)
        c.handle(P.ChunkStarted(t, cmd.worker, cmd.chunk.chunk_id))
        out = c.handle(P.ChunkFinished(t + 0.05, cmd.worker, cmd.chunk.chunk_id, 0.05))
        finished.append(cmd.chunk)
        live += of(P.RunChunk, out)
        t += 0.1
    assert aux.chunk.chunk_id not in {ch.chunk_id for ch in finished}
    for stage in ("old_logprob", "actor_update"):
        ran = sorted(s for ch in finished if ch.stage == stage for s in ch.samples)
        assert ran == sorted((g, i) for g in range(4) for i in range(2)), (stage, ran)


def test_trainer_on_rollout_pool_rejected_by_the_gate():
    c = coordinator("tor-only", cost=5.0)
    out = _consume_start(c)
    (decided,) = of(P.Decided, out)
    d = decided.decision
    assert d.direction == TOR and not d.admitted and d.detail["t_borrow"] >= d.detail["t_no"]
    assert not of(P.Switch, out) and c.view().leases[P.ROLLOUT_POOL] == "primary"


def test_the_trainer_gate_times_the_workload_from_now_leaving_out_what_a_running_chunk_has_run():
    # s = 1: the batch of groups 0-3 starts training while the rollouters still generate the run-ahead groups
    # 4-7; the rollout pool idles only when they are done, 0.04 s into the first chunk (predicted 2 × 110 tokens
    # at 1 ms on 2 replicas, 0.11 s). T_no is the step's 8 chunks less what the running one has run
    c = coordinator("tor-only", staleness=1.0)
    placed = where(c.handle(P.Started(0.0)))
    out = []
    for g in range(4):
        out = c.handle(P.GroupFinished(1.0 + g, placed[g], done_group(g)))
    (first,) = of(P.RunChunk, out)
    assert not of(P.Decided, out)                  # the rollouters are busy with 4-7: no window to consider
    c.handle(P.ChunkStarted(5.0, P.PRIMARY_TRAINER, first.chunk.chunk_id))
    for k, g in enumerate(range(4, 8)):
        out = c.handle(P.GroupFinished(5.01 + 0.01 * k, placed[g], done_group(g)))
    (decided,) = of(P.Decided, out)
    d = decided.decision
    assert d.direction == TOR and d.t == pytest.approx(5.04)
    # 8 · 0.11 − (5.04 − 5.0): a handful of float sums of numbers below 10, each exact to ~1e-15
    assert d.detail["t_no"] == pytest.approx(8 * 0.11 - 0.04, abs=1e-12)


def test_a_group_that_completes_while_its_migration_is_in_flight_is_not_waited_for():
    c = coordinator("rot-only", staleness=1.0)
    placed = where(c.handle(P.Started(0.0)))
    out = c.handle(P.SwitchFinished(1.0, P.TRAINER_POOL, P.ROLLOUT, 0.1))
    (first, *_), worker = of(P.Interrupt, out)[0].group_ids, of(P.Interrupt, out)[0].worker
    # the group completes on the primary while the Interrupt to migrate it is in flight
    c.handle(P.GroupFinished(1.1, worker, done_group(first)))
    # the interrupt's answer no longer lists it; nothing waits for it and it is not generated twice
    out = c.handle(P.GenerationStopped(1.2, worker, ()))
    assert first not in {t.group_id for g in of(P.Generate, out) for t in g.tasks}
    assert c.view().samples["generated"] == 2 and placed[first] == worker


def test_tail_window_reclaims_a_queued_chunk_and_splits_it_with_the_rest():
    """§5.2 JointTailSplit re-chunks the remaining tail work; Table 2: a queued chunk is recoverable. When the
    auxiliaries arrive and the whole remaining segment fits the tail window, the primary's chunk that has not
    started is cancelled, nothing is sent until the cancellation answers, and then the split covers its units."""
    c = coordinator("tor-only")
    (first,) = of(P.RunChunk, _consume_start(c))
    out = c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1))
    assert of(P.CancelChunk, out) == [P.CancelChunk(P.PRIMARY_TRAINER, first.chunk.chunk_id)]
    assert not of(P.RunChunk, out)
    out = c.handle(P.ChunkCancelled(4.2, P.PRIMARY_TRAINER, first.chunk.chunk_id))
    sent = of(P.RunChunk, out)
    assert {m.worker for m in sent} == {P.PRIMARY_TRAINER, P.AUX_TRAINER}
    assert first.chunk.samples[0] in {s for m in sent for s in m.chunk.samples}
