"""Recovery in the control plane: any worker may fail and come back (``WorkerFailed`` / ``WorkerRestarted``).

Sans-I/O, like ``tests/test_coordinator_async.py`` (whose tiny coordinator and functions these tests use): feed
events, assert the commands. A primary rollouter's groups resume elsewhere; the primary trainer gang's failure
mid-step rolls the step back to its start and starts it over with the same batch once the gang is back.
"""

import pytest

from bidirl.core import protocol as P
from test_coordinator_async import R0, R1, coordinator, done_group, of, prefix, run_chunks, where


def _consume(c):
    """s = 0: the first batch of four groups completes; returns (StartStep, the chunks sent)."""
    placed = where(c.handle(P.Started(0.0)))
    for g in range(4):
        out = c.handle(P.GroupFinished(1.0 + g, placed[g], done_group(g)))
    (start,) = of(P.StartStep, out)
    return start, of(P.RunChunk, out)


def test_a_primary_trainer_failure_mid_step_starts_the_step_over_once_the_gang_is_back():
    c = coordinator("no-borrow")
    start, live = _consume(c)
    first = live.pop(0)
    c.handle(P.ChunkStarted(4.0, first.worker, first.chunk.chunk_id))
    c.handle(P.ChunkFinished(4.1, first.worker, first.chunk.chunk_id, 0.1))
    out = c.handle(P.WorkerFailed(4.2, P.PRIMARY_TRAINER, "actor died"))
    assert c.view().phase == "rolling_back" and P.PRIMARY_TRAINER in c.view().failed
    assert not of(P.RunChunk, out) and not of(P.OptimizerStep, out)
    out = c.handle(P.WorkerRestarted(9.0, P.PRIMARY_TRAINER))
    (again,) = of(P.StartStep, out)
    assert again == start, "the same step, version and batch start over"
    chunks = of(P.RunChunk, out)
    assert chunks and min(r.chunk.chunk_id for r in chunks) > first.chunk.chunk_id
    ran, out = run_chunks(c, chunks, t=9.1)
    (opt,) = of(P.OptimizerStep, out)
    assert opt.step == 0 and opt.version == 1
    updates = [ch for ch in ran if ch.chunk_id in opt.merge_order]
    assert sorted(s for ch in updates for s in ch.samples) == sorted((g, i) for g in range(4) for i in range(2))
    assert [s for s, _ in c.view().merge_log] == [0], "the lost attempt left no merge behind"


def test_a_failure_after_the_optimizer_step_was_sent_rolls_the_step_back_too():
    c = coordinator("no-borrow")
    _, live = _consume(c)
    _, out = run_chunks(c, live)
    assert of(P.OptimizerStep, out) and c.view().phase == "finishing"
    # the gang died before OptimizerStepped: whatever it applied is gone with it
    c.handle(P.WorkerFailed(6.0, P.PRIMARY_TRAINER, "actor died"))
    out = c.handle(P.WorkerRestarted(7.0, P.PRIMARY_TRAINER))
    assert of(P.StartStep, out) and c.view().phase == "consuming" and c.view().trainer_version == 0
    _, out = run_chunks(c, of(P.RunChunk, out), t=7.1)
    (opt,) = of(P.OptimizerStep, out)
    assert opt.version == 1
    out = c.handle(P.OptimizerStepped(8.0, 0, 1))
    assert of(P.SyncWeights, out) and len(c.view().merge_log) == 1


def test_a_rolled_back_step_waits_for_the_auxiliary_chunk_of_the_lost_attempt():
    c = coordinator("tor-only")
    _, live = _consume(c)
    first = live.pop(0)
    c.handle(P.ChunkStarted(4.0, first.worker, first.chunk.chunk_id))
    (aux,) = of(P.RunChunk, c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1)))
    c.handle(P.ChunkStarted(4.2, P.AUX_TRAINER, aux.chunk.chunk_id))
    out = c.handle(P.WorkerFailed(4.3, P.PRIMARY_TRAINER, "actor died"))
    assert c.view().leases[P.ROLLOUT_POOL] == "revoking" and not of(P.Switch, out)
    # back before the auxiliary's running chunk ends: nothing starts on the pool the auxiliary still uses
    out = c.handle(P.WorkerRestarted(4.4, P.PRIMARY_TRAINER))
    assert not of(P.StartStep, out) and not of(P.RunChunk, out)
    out = c.handle(P.ChunkFinished(4.5, P.AUX_TRAINER, aux.chunk.chunk_id, 0.3))
    assert [s.phase for s in of(P.Switch, out)] == ["out"]
    assert of(P.StartStep, out) and {r.worker for r in of(P.RunChunk, out)} == {P.PRIMARY_TRAINER}
    c.handle(P.SwitchFinished(4.6, P.ROLLOUT_POOL, P.ROLLOUT, 0.1))
    ran, out = run_chunks(c, of(P.RunChunk, out), t=5.0)
    assert of(P.OptimizerStep, out) and not of(P.MergeGradients, out), "nothing of the lost attempt is merged"
    assert all(ch.chunk_id > aux.chunk.chunk_id for ch in ran)


def test_a_primary_rollouter_failure_resumes_its_groups_on_the_other_and_on_it_when_it_is_back():
    c = coordinator("no-borrow", staleness=0.0)
    placed = where(c.handle(P.Started(0.0)))
    on_r0 = sorted(g for g, w in placed.items() if w == R0)
    assert on_r0
    moved = where(c.handle(P.WorkerFailed(1.0, R0, "actor died")))
    assert moved == {g: R1 for g in on_r0}
    # both primaries gone: the groups wait, parked, for one to come back
    assert not where(c.handle(P.WorkerFailed(1.1, R1, "actor died")))
    back = where(c.handle(P.WorkerRestarted(2.0, R0)))
    assert back == {g: R0 for g in range(4)}
    for k, g in enumerate(range(4)):
        out = c.handle(P.GroupFinished(3.0 + k, R0, done_group(g)))
    assert of(P.StartStep, out)
    s = c.view().samples
    assert s["lost"] == 0 and s["duplicated"] == 0


def test_a_rollouter_that_dies_with_the_sync_interrupt_in_flight_does_not_hold_the_sync():
    c = coordinator(staleness=1.0, policy="no-borrow")
    placed = where(c.handle(P.Started(0.0)))
    for k, g in enumerate(range(4)):
        out = c.handle(P.GroupFinished(1.0 + k, placed[g], done_group(g)))
    _, out = run_chunks(c, of(P.RunChunk, out))
    out = c.handle(P.OptimizerStepped(6.0, 0, 1))
    interrupts = {i.worker for i in of(P.Interrupt, out)}
    assert interrupts == {R0, R1}, "the run-ahead groups are stopped for the sync"
    out = c.handle(P.WorkerFailed(6.1, R0, "actor died"))
    assert not of(P.SyncWeights, out)
    out = c.handle(P.GenerationStopped(6.2, R1, tuple(prefix(g) for g, w in placed.items() if w == R1 and g >= 4)))
    assert of(P.SyncWeights, out) == [P.SyncWeights(1, (R1,))]
    out = c.handle(P.SyncFinished(6.3, 1, (R1,), 0.1))
    # R0's run-ahead groups resume (on R1) with their last known state: nothing lost
    resumed = where(out)
    assert {g for g, w in placed.items() if w == R0 and g >= 4} <= set(resumed) and set(resumed.values()) == {R1}


def test_an_auxiliary_gang_that_comes_back_may_be_lent_again():
    c = coordinator("tor-only", steps=3)
    _, live = _consume(c)
    c.handle(P.SwitchFinished(4.1, P.ROLLOUT_POOL, P.TRAINER, 0.1))
    c.handle(P.WorkerFailed(4.2, P.AUX_TRAINER, "actor died"))
    c.handle(P.WorkerRestarted(4.3, P.AUX_TRAINER))
    assert P.AUX_TRAINER not in c.view().failed


@pytest.mark.parametrize("worker", [R0, P.PRIMARY_TRAINER, P.AUX_TRAINER])
def test_a_restart_of_a_worker_that_never_failed_changes_nothing(worker):
    c = coordinator("bidirl")
    c.handle(P.Started(0.0))
    before = c.view()
    out = c.handle(P.WorkerRestarted(0.5, worker))
    assert not of(P.Generate, out) and c.view().failed == before.failed == ()


def test_a_primary_stopping_for_a_migration_when_the_step_ends_parks_its_other_groups_before_the_sync():
    """s = 1, the trainer pool lent to rollout: R0 is asked to give group 2 up (migration) and its answer is
    still on its way when the step ends, so the end-of-step interrupt skips R0. When the answer comes, R0's
    other groups are interrupted too before the weights move (an engine loads weights only when idle)."""
    A0 = P.rollouter(P.TRAINER_POOL, 0)
    c = coordinator("rot-only", staleness=1.0)
    placed = where(c.handle(P.Started(0.0)))
    assert of(P.Interrupt, c.handle(P.SwitchFinished(0.2, P.TRAINER_POOL, P.ROLLOUT, 0.1))) == [
        P.Interrupt(R0, (2,)), P.Interrupt(R1, (3,))]
    c.handle(P.GenerationStopped(0.3, R1, (prefix(3),)))
    for t, g in ((0.4, 0), (0.5, 1), (0.6, 4), (0.7, 5)):
        c.handle(P.GroupFinished(t, placed[g], done_group(g)))
    c.handle(P.GenerationStopped(0.8, A0, (prefix(3, tokens=5),)))
    out = c.handle(P.SwitchFinished(0.9, P.TRAINER_POOL, P.TRAINER, 0.1))
    _, out = run_chunks(c, of(P.RunChunk, out), t=1.0)
    assert of(P.OptimizerStep, out)
    assert of(P.Interrupt, c.handle(P.OptimizerStepped(2.0, 0, 1))) == [P.Interrupt(R1, None)]
    assert not c.handle(P.GenerationStopped(2.1, R1, tuple(prefix(g) for g in c.buffer.running_on(R1))))
    still = c.buffer.running_on(R0)
    assert still, "R0 runs groups besides the one it gave up"
    out = c.handle(P.GenerationStopped(2.2, R0, (prefix(2),)))
    assert out == [P.Interrupt(R0, None)], "no sync while R0 still generates"
    out = c.handle(P.GenerationStopped(2.3, R0, tuple(prefix(g) for g in still)))
    assert of(P.SyncWeights, out) == [P.SyncWeights(1, (R0, R1))]


def test_the_restart_bound_counts_failures_in_a_row_and_starts_over_once_a_whole_step_ran():
    from bidirl.cluster.recovery import MAX_RESTARTS, Restarts
    r = Restarts()
    assert r.limit == MAX_RESTARTS == 3
    for k in range(3):                     # three failures during step 4: three restarts
        assert not r.exhausted(R0, 4)
        assert r.begin(R0, 1.0 + k, "actor died", 4) == k + 1
    assert r.exhausted(R0, 5), "a fourth failure before a whole step ran ends the run"
    assert "failed 4 times: it was restarted 3 times" in r.message(R0, "actor died")
    assert not r.exhausted(R0, 6), "step 5 ran whole since the last failure: the count starts over"
    r.begin(R0, 9.0, "actor died", 6)
    assert r.counts[R0] == 1 and r.incarnation(R0) == 4 and r.incarnation(R1) == 0
    assert [e["restart"] for e in r.record] == [1, 2, 3, 1]
    with pytest.raises(ValueError, match="max_restarts must be an integer ≥ 0"):
        Restarts(-1)
