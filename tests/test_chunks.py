"""Chunk queue, lazy pull, tail split and ordered merge (paper §5.2 Algorithm 2, Table 2)."""

import itertools

from hypothesis import given, settings, strategies as st

from bidirl.core.chunks import TrainerStep
from bidirl.core.protocol import GroupState

STAGES = ("old_logprob", "ref_logprob", "actor_update")


def make_step(groups=4, size=4, micro_batch_per_device=2, stages=STAGES, lengths=None):
    ids = itertools.count()
    gs = [GroupState(g, 10 + g, tuple(lengths or [20] * size), (True,) * size, 0) for g in range(groups)]
    return TrainerStep(step=0, version=0, groups=gs, stages=stages, micro_batch_per_device=micro_batch_per_device,
                       next_chunk_id=lambda: next(ids))


def linear_time(stage, p, r, d, side):
    mult = 3 if stage == "actor_update" else 1
    return mult * (0.01 + sum(a + b for a, b in zip(p, r)) / d / 1000)


def test_segments_and_units_are_stage_ordered():
    step = make_step(groups=2, size=2)
    assert step.segments == [("old_logprob", "ref_logprob"), ("actor_update",)]
    assert [u[0] for u in step.units] == ["old_logprob"] * 4 + ["ref_logprob"] * 4
    no_ref = make_step(stages=("old_logprob", "actor_update"))
    assert no_ref.segments == [("old_logprob",), ("actor_update",)]


def test_lazy_pull_takes_s_max_per_device_and_never_crosses_a_stage():
    step = make_step(groups=3, size=2, micro_batch_per_device=2)  # 6 samples per stage
    c1 = step.pull("primary", 2, "w")               # 4 units
    c2 = step.pull("primary", 2, "w")               # only 2 left in old_logprob
    c3 = step.pull("primary", 2, "w")
    assert len(c1.units) == 4 and len(c2.units) == 2 and len(c3.units) == 4
    assert c2.chunk.stage == "old_logprob" and c3.chunk.stage == "ref_logprob"
    assert c1.chunk.per_device == 2 and c2.chunk.per_device == 1


def test_cancel_returns_units_and_only_queued_chunks_are_recoverable():
    step = make_step()
    a = step.pull("primary", 2, "w")
    b = step.pull("auxiliary", 2, "x")
    step.started(a.chunk.chunk_id, 1.0)
    assert not step.cancel(a.chunk.chunk_id)         # running: it finishes
    assert step.cancel(b.chunk.chunk_id)             # queued: recoverable
    assert step.pending[: len(b.units)] == list(b.units)
    again = step.pull("primary", 2, "w")
    assert again.units == b.units


@settings(max_examples=60)
@given(order=st.permutations(range(6)))
def test_merge_follows_original_order_whatever_the_finish_order(order):
    step = make_step(groups=3, size=4, micro_batch_per_device=1)  # 12 units, 2 per chunk: 6 chunks a stage
    chunks = [step.pull("primary" if i % 2 else "auxiliary", 2, "w") for i in range(6)]
    merged = []
    for i in order:
        merged += step.finish(chunks[i].chunk.chunk_id)
    assert merged == [c.chunk.chunk_id for c in chunks]


def test_tail_split_minimises_the_joint_finish_and_respects_minimum_chunk():
    step = make_step(groups=2, size=4, micro_batch_per_device=2)  # 8 units per stage, 16 in the forward segment
    assert step.in_tail_window(2, 2, tail_window=2)
    n_a, finish = step.plan_tail(2, 2, ready_p=0.0, ready_a=0.0, chunk_time=linear_time)
    # brute force over every legal split gives the same optimum
    units = list(range(16))
    def side(part, d):
        return sum(linear_time(step.units[r[0]][0], *step.lens(r), d, "") for r in step.split_runs(part, d))
    best = min(max(side(units[: 16 - k], 2) if 16 - k else 0.0, side(units[16 - k:], 2) if k else 0.0)
               for k in range(17) if not (0 < k < 2 or 0 < 16 - k < 2))
    assert abs(finish - best) < 1e-12
    assert 0 < n_a < 16
    # every planned chunk has at least one unit per device, and each side has at most one remainder per stage
    for side_name, runs in step.tail_plan.items():
        for run in runs:
            assert len(run) >= 2 or len(run) == 16
    covered = sorted(u for runs in step.tail_plan.values() for r in runs for u in r)
    assert covered == units


def test_tail_split_prefers_the_side_that_is_ready():
    step = make_step(groups=2, size=4, micro_batch_per_device=2)
    n_late, _ = step.plan_tail(2, 2, ready_p=0.0, ready_a=10.0, chunk_time=linear_time)
    assert n_late == 0                                 # an auxiliary busy for 10 s gets nothing


def test_release_plan_returns_everything_to_lazy_pull():
    step = make_step(groups=2, size=4, micro_batch_per_device=2)
    step.plan_tail(2, 2, 0.0, 0.0, linear_time)
    first = step.pull("primary", 2, "w")
    step.release_plan()
    assert step.tail_plan == {}
    rest = []
    while (c := step.pull("primary", 2, "w")) is not None:
        rest += c.units
    assert sorted(rest + list(first.units)) == list(range(16))


def test_proportional_split_gives_the_auxiliary_its_dp_share():
    step = make_step(groups=4, size=4, micro_batch_per_device=2)   # 32 forward units
    n_a = step.plan_proportional(3, 1)
    assert n_a == 8


def test_step_completes_after_both_segments():
    step = make_step(groups=1, size=2, micro_batch_per_device=4, stages=("old_logprob", "actor_update"))
    c = step.pull("primary", 1, "w")
    while c is not None:
        step.started(c.chunk.chunk_id, 0)
        step.finish(c.chunk.chunk_id)
        c = step.pull("primary", 1, "w")
    assert step.segment_done and not step.done
    assert step.advance_segment()
    c = step.pull("auxiliary", 1, "x")
    step.finish(c.chunk.chunk_id)
    assert step.done and step.aux_update_chunks == [c.chunk.chunk_id]


# TailWindow's reclaim (§5.2 "re-chunks the remaining tail work"; Table 2: queued chunks are recoverable) ----------

def test_tail_reclaim_returns_the_queued_chunks_once_when_the_tail_fits():
    step = make_step(groups=4, size=4, micro_batch_per_device=2)      # 32 forward units, chunks of 2 on d = 1
    first = step.pull("primary", 1, "p")
    second = step.pull("auxiliary", 1, "a")
    step.started(first.chunk.chunk_id, 0.0)
    step.started(second.chunk.chunk_id, 0.0)
    queued_p = step.pull("primary", 1, "p")
    queued_a = step.pull("auxiliary", 1, "a")
    # 24 pending + 4 queued units do not fit one combined round (2 + 2 units): nothing is reclaimed yet
    assert step.tail_reclaim(1, 1, tail_window=1) == []
    del step.pending[:]                                        # as if the rest ran: only the queued chunks remain
    got = step.tail_reclaim(1, 1, tail_window=1)               # 0 + 4 units fit one round of 2 + 2
    assert {c.chunk.chunk_id for c in got} == {queued_p.chunk.chunk_id, queued_a.chunk.chunk_id}
    assert step.reclaiming == {queued_p.chunk.chunk_id, queued_a.chunk.chunk_id}
    assert step.tail_reclaim(1, 1, tail_window=1) == []        # once per segment
    for c in got:                                              # the cancellations answer: the units come back
        assert step.cancel(c.chunk.chunk_id)
    assert not step.reclaiming
    assert step.pending == sorted(queued_p.units + queued_a.units)
    assert step.in_tail_window(1, 1, tail_window=1)            # and the split covers them
    n_a, _ = step.plan_tail(1, 1, ready_p=0.0, ready_a=10.0, chunk_time=linear_time)
    assert n_a == 0                                            # the auxiliary side is busy for 10 s: all to primaries
    assert [u for run in step.tail_plan["primary"] for u in run] == sorted(queued_p.units + queued_a.units)


def test_a_reclaimed_chunk_that_started_first_runs_and_is_no_longer_awaited():
    step = make_step(groups=1, size=4, micro_batch_per_device=2)      # 8 forward units
    running = step.pull("primary", 1, "p")
    step.started(running.chunk.chunk_id, 0.0)
    queued = step.pull("auxiliary", 1, "a")
    del step.pending[:]
    assert [c.chunk.chunk_id for c in step.tail_reclaim(1, 1, tail_window=1)] == [queued.chunk.chunk_id]
    step.started(queued.chunk.chunk_id, 1.0)                   # the gang started it before the cancel reached it
    assert not step.reclaiming
    assert not step.cancel(queued.chunk.chunk_id)              # running: it is not recoverable any more
    assert step.pending == []


def test_a_new_segment_may_reclaim_again():
    step = make_step(groups=1, size=4, micro_batch_per_device=2, stages=("old_logprob", "actor_update"))
    running = step.pull("primary", 1, "p")                    # old_logprob has 4 units: 2 + 2
    step.started(running.chunk.chunk_id, 0.0)
    queued = step.pull("auxiliary", 1, "a")
    assert step.tail_reclaim(1, 1, tail_window=1) == [queued]
    assert step.cancel(queued.chunk.chunk_id)
    again = step.pull("primary", 1, "p")
    for c in (running, again):
        if c is again:
            step.started(c.chunk.chunk_id, 1.0)
        step.finish(c.chunk.chunk_id)
    assert step.segment_done and step.advance_segment()
    assert not step.tail_reclaimed and not step.reclaiming      # the update segment's tail may reclaim again
    step.started(step.pull("primary", 1, "p").chunk.chunk_id, 2.0)
    last = step.pull("auxiliary", 1, "a")
    assert step.tail_reclaim(1, 1, tail_window=1) == [last]


@settings(max_examples=80, deadline=None)
@given(choices=st.lists(st.integers(0, 5), min_size=1, max_size=400), race=st.booleans())
def test_with_tail_reclaims_every_unit_runs_once_and_merges_in_order(choices, race):
    """Property: however lazy pull, starts, finishes, TailWindow's reclaims (answered by a cancel, or by a start that
    got there first when ``race``) and tail splits interleave, every unit of every segment runs exactly once and the
    chunks merge in unit order."""
    step = make_step(groups=3, size=4, micro_batch_per_device=1)        # 12 samples: 24 forward, 12 update units
    depth, ran = 2, []

    def answer(reclaimed):
        for k, rec in enumerate(reclaimed):      # with `race`, the first one's gang started it before the cancel
            if race and k == 0:
                step.started(rec.chunk.chunk_id, 0.0)
            else:
                step.cancel(rec.chunk.chunk_id)
    for segment in range(len(step.segments)):
        # the drawn choices first, then a cycle that always makes progress (pull, reclaim, start, finish)
        it = itertools.chain(choices, itertools.cycle([5, 0, 1, 0, 1, 4, 2, 3, 2, 3]))
        for _ in range(10_000):
            if step.segment_done:
                break
            c = next(it)
            live = step.live()
            if c in (0, 1) and not step.reclaiming:                  # a side pulls, keeping `depth` chunks sent,
                side = "primary" if c == 0 else "auxiliary"          # as the coordinator does: reclaim, split, pull
                answer(step.tail_reclaim(1, 1, tail_window=1))
                if step.in_tail_window(1, 1, tail_window=1):
                    step.plan_tail(1, 1, 0.0, 0.0, linear_time)
                if len(step.live(side)) < depth:
                    step.pull(side, 1, side[0])
            elif c == 2 and live:                                    # the oldest queued chunk of a side starts
                queued = [x for x in live if x.status == "queued"]
                if queued:
                    step.started(queued[0].chunk.chunk_id, 0.0)
            elif c == 3 and live:                                    # a running chunk finishes
                running = [x for x in live if x.status == "running"]
                if running:
                    ran.append((segment, running[0].units))
                    step.finish(running[0].chunk.chunk_id)
            elif c == 4:                                             # TailWindow's reclaim, answered at once
                answer(step.tail_reclaim(1, 1, tail_window=1))
            elif c == 5 and not live and not step.reclaiming:        # nothing sent: someone pulls
                if step.in_tail_window(1, 1, tail_window=1):
                    step.plan_tail(1, 1, 0.0, 0.0, linear_time)
                step.pull("primary", 1, "p") or step.pull("auxiliary", 1, "a")
        assert step.segment_done, "the segment finished"
        assert not step.reclaiming
        n = len(step.units)
        units = sorted(u for seg, us in ran if seg == segment for u in us)
        assert units == list(range(n)), "every unit of the segment ran exactly once"
        if not step.advance_segment():
            break
    firsts = [pos for seg, pos in step.merge_positions]
    for seg in range(len(step.segments)):
        order = [pos for s, pos in step.merge_positions if s == seg]
        assert order == sorted(order), "chunks merge in unit order"
    assert len(firsts) == len(step.merge_order)
