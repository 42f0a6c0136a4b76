"""The reproducible mode's rule (issue 42; ``bidirl.core.schedule``): batches and generation versions fixed by
(step, group, s), chunks on a fixed grid — checked on the control plane, under the simulator with timings that
differ run to run (the log-normal jitter's σ), against the default rule, which follows timing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.core.buffer import RolloutBuffer
from bidirl.core.protocol import GroupState
from bidirl.core.schedule import Reproducibility, batch_of, generation_version
from bidirl.core.staleness import StalenessRule, check_batch
from bidirl.errors import BidirlError
from bidirl.job import config as cfgmod


@settings(max_examples=200, deadline=None)
@given(B=st.integers(1, 40), s=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]),
       steps=st.integers(1, 6))
def test_the_rule_admits_each_group_at_its_version_and_every_batch_obeys_the_staleness_rule(B, s, steps):
    rule = StalenessRule(s, B)
    for step in range(steps):
        ids = range(step * B, (step + 1) * B)
        versions = [generation_version(g, s, B) for g in ids]
        assert all(batch_of(g, B) == step for g in ids)
        # e(g) is the first version whose admission cap holds g, so no later admission would be earlier
        for g, v in zip(ids, versions):
            assert g < rule.admission_cap(v) and (v == 0 or g >= rule.admission_cap(v - 1))
        check_batch(rule, versions, step)


def _complete(buf: RolloutBuffer, gid: int, version: int) -> None:
    buf.commit(GroupState(gid, 4, (3,), (True,), version))


def test_the_schedule_batch_is_the_next_ids_whatever_completed_first():
    rule = StalenessRule(1.0, 2)
    buf = RolloutBuffer(rule)
    for _ in range(4):
        buf.admit(0, "w")
    for gid in (3, 2, 1):                       # completion order 3, 2, 1: the default rule takes two of them
        _complete(buf, gid, 0)
    assert buf.select_batch(0, "lookahead") is not None
    assert buf.select_batch(0, "schedule") is None          # group 0 is still generating
    _complete(buf, 0, 0)
    assert buf.select_batch(0, "schedule") == [0, 1]
    buf.consume([0, 1])
    assert buf.select_batch(1, "schedule") == [2, 3]


def _sim(staleness, jitter, policy="bidirl", reproducible=None, steps=5):
    from bidirl.sim.driver import SimDriver
    cfg = cfgmod.load("tiny-cpu").with_overrides({"rl.staleness": staleness, "rl.reproducible": reproducible,
                                                  "workload.prompts_per_step": 32, "workload.group_size": 8})
    return SimDriver(cfg, policy, steps, 0, jitter=jitter).run()


@pytest.mark.parametrize("staleness", [0.5, 1.0, 2.0])
def test_timings_that_differ_give_the_same_batches_and_chunks_in_the_mode(staleness):
    """σ = 0.03 against σ = 0.3 moves every completion; in the mode each step takes the same groups and runs the same
    chunk grid (the merge log's (segment, first unit) of every chunk), with borrowing in both directions."""
    a, b = (_sim(staleness, jitter, policy="opportunistic", reproducible=True) for jitter in (0.03, 0.3))
    va, vb = a.view, b.view
    assert va.batches == vb.batches
    assert va.merge_log == vb.merge_log
    assert va.reproducibility["mode"] and va.reproducibility["reproducible"], va.reproducibility
    kinds = {(s.kind, s.role, s.pool) for s in a.log.spans + b.log.spans}
    assert ("chunk", "auxiliary", "rollout_pool") in kinds, "the rollout pool lent to training"
    assert ("generate", "auxiliary", "trainer_pool") in kinds, "the trainer pool lent to rollout"


def test_without_the_mode_timing_changes_the_batches_and_the_summary_says_why():
    a, b = (_sim(1.0, jitter, reproducible=False) for jitter in (0.03, 0.3))
    assert [ids for *_, ids in a.view.batches] != [ids for *_, ids in b.view.batches]
    rep = a.summary()["reproducibility"]
    assert rep["mode"] is False and rep["reproducible"] is False and "completed first" in rep["timing"][0]


def test_the_mode_is_on_by_default_at_s0_only_and_refused_with_a_modelled_systems_rule():
    base = cfgmod.load("tiny-cpu")
    assert base.with_overrides({"rl.staleness": 0}).rl.reproducible_on
    assert not base.rl.reproducible_on
    with pytest.raises(cfgmod.ConfigError, match="rl.reproducible"):
        base.with_overrides({"rl.reproducible": "yes"})
    from bidirl.core.policies import Policy
    from bidirl.runtime.assemble import reproducible_mode
    fifo = Policy("fifo", False, False, batch_rule="completion")
    assert not reproducible_mode(base.with_overrides({"rl.staleness": 0}), fifo)
    with pytest.raises(BidirlError, match="rl.reproducible"):
        reproducible_mode(base.with_overrides({"rl.reproducible": True}), fifo)


def test_waits_are_clocked_while_they_last():
    r = Reproducibility(on=True)
    r.trainer_waits(1.0, True)
    r.trainer_waits(2.0, True)
    r.trainer_waits(3.5, False)
    r.sync_waits(4.0, True)
    r.sync_waits(4.25, False)
    r.sync_waits(5.0, False)
    assert r.summary()["trainer_wait_s"] == 2.5 and r.summary()["sync_wait_s"] == 0.25


def test_grid_cells_do_not_depend_on_the_split():
    """The tail split and the proportional split move to cell boundaries; a pull takes one cell either side."""
    from bidirl.core.chunks import TrainerStep
    groups = [GroupState(g, 5, tuple([3] * 4), tuple([True] * 4), 0) for g in range(10)]     # 40 samples
    counter = iter(range(1000))

    def step():
        return TrainerStep(0, 0, groups, ("actor_update",), micro_batch_per_device=4,
                           next_chunk_id=lambda: next(counter), grid=2)            # cells of 4 · 2 = 8 samples
    s = step()
    assert s._cell_bounds() == [8, 16, 24, 32, 40]
    aux = s.pull("auxiliary", 1, "aux")       # a gang of 1 replica still takes a whole cell, from the back
    assert aux.units == tuple(range(32, 40))
    assert s.pull("primary", 2, "p").units == tuple(range(8))
    s.pending.remove(20)                      # a unit in a live chunk: the split must still cut on cell boundaries
    n_a = s.plan_proportional(2, 1)           # 23 pending, a third would be 7.67 units: moved to a cell boundary
    assert n_a == 8
    assert s.tail_plan["auxiliary"] == [tuple(range(24, 32))]
    assert s.tail_plan["primary"] == [tuple(range(8, 16)), tuple(range(16, 20)), tuple(range(21, 24))]


def test_the_modes_waits_are_spans_of_the_log_and_its_verdict_is_saved_with_it(tmp_path):
    """At s = 1 the trainer sometimes waits for the rule's groups while others are complete: the mode's waits are
    ``rule_wait`` spans on the primary trainer, their sums are the summary's, and a saved log says whether the run
    was reproducible."""
    from bidirl.results.trace import EventLog
    res = _sim(1.0, 0.03, policy="opportunistic", reproducible=True)
    rep = res.summary()["reproducibility"]
    waits = [s for s in res.log.spans if s.kind == "rule_wait"]
    assert waits and {s.worker for s in waits} == {"trainer_pool/trainer"}
    by = {held: sum(s.end - s.start for s in waits if s.detail["held"] == held) for held in ("batch", "sync")}
    assert by["batch"] > 0
    # the spans are the clocked waits (each ended wait is one span; a wait still open at the end is in neither)
    assert by["sync"] == pytest.approx(rep["sync_wait_s"], abs=1e-9)
    assert by["batch"] == pytest.approx(rep["trainer_wait_s"], abs=1e-9)
    path = res.log.save(tmp_path / "log.parquet")
    assert EventLog.load(path).meta["reproducibility"] == rep
    assert res.log.to_chrome_trace()["otherData"]["reproducibility"]["reproducible"] is True


@settings(max_examples=150, deadline=None)
@given(samples=st.integers(1, 60), mb=st.integers(1, 6), d_p=st.integers(1, 3), d_a=st.integers(1, 3),
       ops=st.lists(st.tuples(st.sampled_from(["primary", "auxiliary", "split", "cancel", "finish", "release"]),
                              st.integers(0, 10_000)), max_size=60))
def test_every_chunk_is_a_whole_cell_of_the_grid_whatever_the_order_of_pulls_splits_and_cancels(samples, mb, d_p,
                                                                                                 d_a, ops):
    """The invariant the ordered sum's bit-identity rests on: in the mode every chunk is exactly one cell of the grid
    (the primaries' full chunks from each stage's first sample), however the two sides pull, split and cancel."""
    from bidirl.core.chunks import TrainerStep
    groups = [GroupState(g, 5, (3,), (True,), 0) for g in range(samples)]
    counter = iter(range(100_000))
    s = TrainerStep(0, 0, groups, ("old_logprob", "actor_update"), micro_batch_per_device=mb,
                    next_chunk_id=lambda: next(counter), grid=d_p)
    made = []
    for op, k in ops:
        live = s.live()
        if op in ("primary", "auxiliary"):
            rec = s.pull(op, d_p if op == "primary" else d_a, op)
            if rec is not None:
                made.append(rec.units)
        elif op == "split" and s.pending and not s.tail_plan:
            s.plan_proportional(d_p, d_a)
        elif op == "cancel" and live:
            s.cancel(live[k % len(live)].chunk.chunk_id)
        elif op == "finish" and live:
            s.finish(live[k % len(live)].chunk.chunk_id)
        elif op == "release":
            s.release_plan()
    for units in made:
        assert s.is_cell_start(units[0]) and units[-1] + 1 == s.cell_end(units[0]), (units, s._cell_bounds())
        assert list(units) == list(range(units[0], units[-1] + 1))


def test_without_the_grid_a_smaller_gang_cuts_partial_cells():
    """The guard of the invariant above: outside the mode a gang of one replica pulls half a primary chunk."""
    from bidirl.core.chunks import TrainerStep
    groups = [GroupState(g, 5, (3,), (True,), 0) for g in range(8)]
    counter = iter(range(100))
    free = TrainerStep(0, 0, groups, ("actor_update",), micro_batch_per_device=2, next_chunk_id=lambda: next(counter))
    assert free.pull("auxiliary", 1, "a").units == (0, 1)
    grid = TrainerStep(0, 0, groups, ("actor_update",), micro_batch_per_device=2, next_chunk_id=lambda: next(counter),
                       grid=2)
    assert grid.pull("auxiliary", 1, "a").units == (4, 5, 6, 7)
