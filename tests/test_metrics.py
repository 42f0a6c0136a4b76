"""Metrics on hand-built logs (numbers worked out by hand in the comments) and their invariants."""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from bidirl.results import metrics
from bidirl.results.trace import Decision, EventLog, Span, StepRecord

R0, R1 = "rollout_pool/rollouter/0", "rollout_pool/rollouter/1"
TR, AUX_R, AUX_T = "trainer_pool/trainer", "trainer_pool/rollouter/0", "rollout_pool/trainer"
GPUS = {R0: 2, R1: 2, TR: 4, AUX_R: 2, AUX_T: 4}
POOL_GPUS = {"rollout_pool": 4, "trainer_pool": 4}
SAMPLES = {"generated": 32, "consumed": 32, "lost": 0, "duplicated": 0}


def span(worker, kind, start, end, detail=None):
    pool = worker.split("/")[0]
    home = "rollouter" if pool == "rollout_pool" else "trainer"
    role = "primary" if worker.split("/")[1] == home else "auxiliary"
    return Span(worker, pool, role, kind, start, end, 0, 0, detail or {})


def steps_log(ends, tokens, start0=0.0, wait=1.0):
    log = EventLog()
    prev = start0
    for i, (e, t) in enumerate(zip(ends, tokens)):
        log.add_step(StepRecord(i, prev, e, t, 4, wait, e - prev - wait, i + 1))
        prev = e
    return log


def pool_log():
    """rollout pool: R0 [0,4] and R1 [2,6] overlap -> busy [0,6]; R0 again [8,9].
    trainer pool: trainer [1,3] (4 GPUs) and aux rollouter [5,7] with a sync [6,8] on both workers."""
    log = EventLog()
    for s in [span(R0, "generate", 0, 4), span(R1, "generate", 2, 6), span(R0, "generate", 8, 9),
              span(TR, "chunk", 1, 3, {"stage": "old_logprob", "chunk_id": 0, "samples": 2}),
              span(AUX_R, "generate", 5, 7), span(AUX_R, "sync", 6, 8), span(TR, "sync", 6, 8)]:
        log.add_span(s)
    return log


# ---------------------------------------------------------------------------------------------- intervals

def test_union_intervals_merges_overlaps_and_touching_pieces():
    s, e = metrics.union_intervals([5, 0, 2, 9, 7], [6, 3, 4, 10, 9])
    assert s.tolist() == [0, 5, 7] and e.tolist() == [4, 6, 10]
    s, e = metrics.union_intervals([0, 5], [10, 6], t0=2, t1=8)
    assert s.tolist() == [2] and e.tolist() == [8]
    assert metrics.union_length([], []) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)), max_size=25),
       st.integers(0, 20), st.integers(0, 40))
def test_union_length_equals_covered_unit_cells(pairs, t0, width):
    """Integer intervals: the union length is the number of unit cells covered, however spans overlap."""
    starts = [a for a, _ in pairs]
    ends = [a + d for a, d in pairs]
    t1 = t0 + width
    cells = np.zeros(80, dtype=bool)
    for a, b in zip(starts, ends):
        cells[max(a, t0):min(b, t1)] = True
    assert metrics.union_length(starts, ends, t0, t1) == cells.sum()


# ---------------------------------------------------------------------------------------------- throughput

def test_throughput_by_hand():
    # step ends 10, 20, 35, 45, 60, 70; tokens 100 .. 600
    log = steps_log([10, 20, 35, 45, 60, 70], [100, 200, 300, 400, 500, 600])
    steps = log.steps_df()
    # s = 0: drop 1 head, 0 tail -> steps 1..5: (200+300+400+500+600) / (70 - 10)
    assert metrics.throughput(steps, 0) == pytest.approx(2000 / 60)
    # s = 0.5: ceil = 1 -> drop 1 head, 1 tail -> steps 1..4: 1400 / (60 - 10)
    assert metrics.throughput(steps, 0.5) == pytest.approx(1400 / 50)
    # s = 2: drop 2 head, 2 tail -> steps 2..3: 700 / (45 - 20)
    assert metrics.throughput(steps, 2) == pytest.approx(700 / 25)
    assert metrics.step_times(steps).tolist() == [10, 10, 15, 10, 15, 10]


def test_throughput_counts_the_first_kept_steps_wait_via_the_previous_end():
    # step 1 "starts" late (start 12 > previous end 10) but the measured time still begins at 10
    log = EventLog(steps=[StepRecord(0, 0, 10, 50, 1), StepRecord(1, 12, 20, 100, 1), StepRecord(2, 20, 30, 100, 1)])
    assert metrics.throughput(log.steps_df(), 0) == pytest.approx(200 / 20)


def test_throughput_with_too_few_steps_says_how_many_are_needed():
    steps = steps_log([10, 20, 30, 40], [1, 1, 1, 1]).steps_df()
    with pytest.raises(ValueError, match="at least 5 steps"):
        metrics.throughput(steps, 2)
    with pytest.raises(ValueError, match="at least 2 steps"):
        metrics.throughput(steps.iloc[:1], 0)
    with pytest.raises(ValueError, match="staleness"):
        metrics.throughput(steps, -1)


def test_steps_must_be_unique_and_finish_in_order():
    bad = EventLog(steps=[StepRecord(0, 0, 10, 1, 1), StepRecord(1, 10, 20, 1, 1), StepRecord(2, 0, 15, 1, 1)])
    with pytest.raises(ValueError, match="step 2 ends before step 1"):
        metrics.throughput(bad.steps_df(), 0)
    dup = EventLog(steps=[StepRecord(0, 0, 10, 1, 1), StepRecord(0, 10, 20, 1, 1)])
    with pytest.raises(ValueError, match="unique"):
        metrics.step_times(dup.steps_df())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 50), st.integers(0, 10_000)), min_size=6, max_size=20),
       st.sampled_from([0, 0.5, 1, 2]), st.randoms(use_true_random=False))
def test_throughput_is_invariant_to_record_order(rows, staleness, rnd):
    ends = np.cumsum([d for d, _ in rows])
    log = steps_log(ends, [t for _, t in rows])
    shuffled = list(log.steps)
    rnd.shuffle(shuffled)
    a = metrics.throughput(log.steps_df(), staleness)
    b = metrics.throughput(EventLog(steps=shuffled).steps_df(), staleness)
    assert a == b and a >= 0


# ---------------------------------------------------------------------------------------------- idle / utilisation

def test_idle_from_the_union_of_all_workers_on_the_pool():
    spans = pool_log().spans_df()
    # rollout pool busy [0,6] u [8,9] within [0,10] -> idle 10 - 7 = 3
    assert metrics.idle(spans, "rollout_pool", 0, 10) == pytest.approx(3.0)
    # trainer pool busy [1,3] u [5,8] -> idle 10 - 5 = 5
    assert metrics.idle(spans, "trainer_pool", 0, 10) == pytest.approx(5.0)
    # clipped window [2,8.5]: rollout busy [2,6] u [8,8.5] -> idle 6.5 - 4.5 = 2
    assert metrics.idle(spans, "rollout_pool", 2, 8.5) == pytest.approx(2.0)
    assert metrics.idle(spans, "rollout_pool", 3, 3) == 0.0


def test_idle_gpu_seconds_and_utilization_by_hand():
    spans = pool_log().spans_df()
    # rollout pool (4 GPUs): R0 [0,4]+[8,9] x2 = 10, R1 [2,6] x2 = 8 -> busy 18 of 40 -> idle 22
    assert metrics.busy_gpu_seconds(spans, "rollout_pool", GPUS, 4, 0, 10) == pytest.approx(18.0)
    assert metrics.idle_gpu_seconds(spans, "rollout_pool", GPUS, 4, 0, 10) == pytest.approx(22.0)
    # trainer pool (4 GPUs): trainer [1,3] x4 = 8; aux [5,8] x2 but trainer's sync [6,8] x4 fills the pool:
    # [5,6] 2 GPUs + [6,8] capped at 4 -> 2 + 8 = 10; total busy 18 -> idle 22
    assert metrics.busy_gpu_seconds(spans, "trainer_pool", GPUS, POOL_GPUS, 0, 10) == pytest.approx(18.0)
    assert metrics.idle_gpu_seconds(spans, "trainer_pool", GPUS, POOL_GPUS, 0, 10) == pytest.approx(22.0)
    assert metrics.utilization(spans, POOL_GPUS, GPUS, 0, 10) == pytest.approx(36 / 80)


def test_metric_input_errors_name_the_problem():
    spans = pool_log().spans_df()
    with pytest.raises(ValueError, match="pool must be one of"):
        metrics.idle(spans, "gpu_pool", 0, 1)
    with pytest.raises(ValueError, match="t1 .* before t0"):
        metrics.idle(spans, "rollout_pool", 5, 1)
    with pytest.raises(ValueError, match=r"no entry for worker 'rollout_pool/rollouter/1'"):
        metrics.busy_gpu_seconds(spans, "rollout_pool", {R0: 2}, 4, 0, 10)
    with pytest.raises(ValueError, match="positive length"):
        metrics.utilization(spans, POOL_GPUS, GPUS, 3, 3)
    with pytest.raises(ValueError, match="lacks column"):
        metrics.idle(spans.drop(columns="end"), "rollout_pool", 0, 1)


span_strategy = st.tuples(st.sampled_from([R0, R1, AUX_T, TR, AUX_R]), st.floats(0, 100), st.floats(0, 30))


@settings(max_examples=100, deadline=None)
@given(st.lists(span_strategy, max_size=30), st.floats(0, 120), st.floats(0, 120),
       st.sampled_from(["rollout_pool", "trainer_pool"]))
def test_idle_bounds_and_duplicates_never_double_count(rows, a, b, pool):
    t0, t1 = min(a, b), max(a, b)
    log = EventLog(spans=[span(w, "generate" if "rollouter" in w else "chunk", s, s + d) for w, s, d in rows])
    spans = log.spans_df()
    i = metrics.idle(spans, pool, t0, t1)
    assert 0.0 <= i <= t1 - t0 + 1e-9
    doubled = pd.concat([spans, spans], ignore_index=True)
    assert metrics.idle(doubled, pool, t0, t1) == pytest.approx(i, abs=1e-9)
    busy = metrics.busy_gpu_seconds(doubled, pool, GPUS, POOL_GPUS, t0, t1)
    assert busy == pytest.approx(metrics.busy_gpu_seconds(spans, pool, GPUS, POOL_GPUS, t0, t1), abs=1e-6)
    assert -1e-6 <= busy <= 4 * (t1 - t0) + 1e-6
    # the union never exceeds the plain sum of lengths, and covers the longest single span
    on_pool = spans[spans["pool"] == pool]
    clipped = (np.minimum(on_pool["end"], t1) - np.maximum(on_pool["start"], t0)).clip(lower=0)
    covered = (t1 - t0) - i
    assert covered <= clipped.sum() + 1e-9
    assert covered >= (clipped.max() if len(clipped) else 0.0) - 1e-9
    if t1 > t0:
        u = metrics.utilization(spans, POOL_GPUS, GPUS, t0, t1)
        assert -1e-9 <= u <= 1 + 1e-9
    # order of span records does not matter
    assert metrics.idle(spans.iloc[::-1], pool, t0, t1) == pytest.approx(i, abs=1e-9)


# ---------------------------------------------------------------------------------------------- borrowing

def test_borrow_counts_and_errors():
    log = EventLog(decisions=[Decision(1, "rollout_on_trainer_pool", True, 2, 1),
                              Decision(2, "rollout_on_trainer_pool", False, 0.5, 1),
                              Decision(3, "trainer_on_rollout_pool", True, 3, 1),
                              Decision(4, "rollout_on_trainer_pool", True, 3, 1)])
    assert metrics.borrow_counts(log.decisions_df()) == {"rollout_on_trainer_pool": 2, "trainer_on_rollout_pool": 1,
                                                         "rejected": 1}
    assert metrics.borrow_counts(EventLog().decisions_df()) == {"rollout_on_trainer_pool": 0,
                                                                "trainer_on_rollout_pool": 0, "rejected": 0}
    bad = log.decisions_df().assign(direction="sideways")
    with pytest.raises(ValueError, match="sideways"):
        metrics.borrow_counts(bad)


def test_borrow_windows_pair_switch_in_with_the_next_switch_out_per_pool():
    rot, tor = {"direction": "rollout_on_trainer_pool"}, {"direction": "trainer_on_rollout_pool"}
    log = EventLog(spans=[span(AUX_R, "switch_in", 2, 3, rot), span(AUX_R, "generate", 3, 6),
                          span(AUX_R, "switch_out", 6, 7, rot), span(AUX_T, "switch_in", 4, 5, tor),
                          span(AUX_T, "chunk", 5, 9), span(AUX_R, "switch_in", 10, 11, rot),
                          span(TR, "chunk", 11, 12)])
    w = metrics.borrow_windows(log.spans_df())
    assert w.values.tolist() == [["rollout_pool", "trainer_on_rollout_pool", 4.0, 12.0],
                                 ["trainer_pool", "rollout_on_trainer_pool", 2.0, 7.0],
                                 ["trainer_pool", "rollout_on_trainer_pool", 10.0, 12.0]]
    assert len(metrics.borrow_windows(EventLog().spans_df())) == 0


# ---------------------------------------------------------------------------------------------- summary

def full_log():
    log = steps_log([10, 20, 30, 40], [1000, 1000, 1000, 1000], wait=2.0)
    log.extend(pool_log())
    log.add_span(span(R0, "generate", 12, 16))
    log.add_decision(Decision(5, "rollout_on_trainer_pool", True, 2, 1))
    return log


def test_summary_has_the_design_keys_and_hand_computed_values():
    out = metrics.summary(full_log(), policy="bidirl", staleness=1, pool_gpus=POOL_GPUS, gpus_per_worker=GPUS,
                          samples={**SAMPLES, "buffered": 0})
    for key in ("policy", "throughput", "step_times", "idle", "utilization", "borrows", "samples"):
        assert key in out
    assert set(out["idle"]) == {"rollout_pool", "trainer_pool"}
    assert set(out["borrows"]) == {"rollout_on_trainer_pool", "trainer_on_rollout_pool", "rejected"}
    assert {"generated", "consumed", "lost", "duplicated"} <= set(out["samples"])
    # s = 1 drops 1 head and 1 tail step: steps 1..2, window [10, 30]
    assert out["throughput"] == pytest.approx(2000 / 20)
    assert out["window"] == [10.0, 30.0] and out["measured_steps"] == 2
    assert out["step_times"] == [10.0, 10.0, 10.0, 10.0]
    # pool-union: rollout pool busy in [10,30]: [12,16] only -> 16/20; trainer pool: nothing -> 1.0
    assert out["idle_pool_union"] == {"rollout_pool": pytest.approx(0.8), "trainer_pool": pytest.approx(1.0)}
    # busy GPU-seconds: R0 [12,16] x 2 = 8 of 8 GPUs x 20 s
    assert out["utilization"] == pytest.approx(8 / 160)
    # idle is GPU-weighted: the rollout pool's 4 GPUs x 20 s less R0's 8 busy GPU-seconds
    assert out["idle"] == {"rollout_pool": pytest.approx(1 - 8 / 80), "trainer_pool": pytest.approx(1.0)}
    assert out["idle_overall"] == pytest.approx(1 - out["utilization"])
    assert out["timing_s/step"] == 10.0 and out["timing_s/gen"] == 2.0
    assert out["fully_async/trainer/idle_ratio"] == pytest.approx(4 / 20)
    assert out["fully_async/rollouter/idle_ratio"] == pytest.approx(0.8)
    assert out["borrows"]["rollout_on_trainer_pool"] == 1


def test_summary_of_a_short_run_reports_no_throughput_but_still_the_rest():
    out = metrics.summary(full_log(), policy="bidirl", staleness=2, pool_gpus=POOL_GPUS, gpus_per_worker=GPUS,
                          samples=SAMPLES)
    assert out["throughput"] is None and "at least 5 steps" in out["throughput_note"]
    assert out["window"] == [0.0, 40.0] and len(out["step_times"]) == 4
    assert 0 <= out["utilization"] <= 1


def test_summary_of_a_pool_without_gpus_reports_none():
    log = steps_log([10, 20, 30], [5, 5, 5])
    log.add_span(span(AUX_T, "chunk", 12, 18))
    out = metrics.summary(log, policy="verl-colocated", staleness=0, pool_gpus={"rollout_pool": 4, "trainer_pool": 0},
                          gpus_per_worker={AUX_T: 4}, samples=SAMPLES)
    assert out["idle"]["trainer_pool"] is None and out["idle_pool_union"]["trainer_pool"] is None
    assert out["utilization"] == pytest.approx(24 / 80)   # [12,18] x 4 GPUs over 4 GPUs x [10,30]
    assert math.isclose(out["idle_pool_union"]["rollout_pool"], 14 / 20)
    # the auxiliary trainer holds all 4 GPUs: GPU-weighted and pool-union idle agree here
    assert math.isclose(out["idle"]["rollout_pool"], 1 - 24 / 80)


def test_summary_input_errors():
    with pytest.raises(ValueError, match="lost"):
        metrics.summary(full_log(), policy="x", staleness=0, pool_gpus=POOL_GPUS, gpus_per_worker=GPUS,
                        samples={"generated": 1, "consumed": 1, "duplicated": 0})
    with pytest.raises(ValueError, match="pool_gpus"):
        metrics.summary(full_log(), policy="x", staleness=0, pool_gpus={"rollout_pool": -1}, gpus_per_worker=GPUS,
                        samples=SAMPLES)
    with pytest.raises(ValueError, match="EventLog"):
        metrics.summary(full_log().spans_df(), policy="x", staleness=0, pool_gpus=POOL_GPUS, gpus_per_worker=GPUS,
                        samples=SAMPLES)


def test_role_conflicts_finds_a_pool_running_both_roles():
    from bidirl.results.metrics import role_conflicts
    from bidirl.results.trace import EventLog, Span
    log = EventLog()
    log.add_span(Span("rollout_pool/rollouter/0", "rollout_pool", "primary", "generate", 0.0, 10.0))
    log.add_span(Span("rollout_pool/trainer", "rollout_pool", "auxiliary", "chunk", 10.0, 12.0))
    assert role_conflicts(log.spans_df()) == []
    log.add_span(Span("rollout_pool/trainer", "rollout_pool", "auxiliary", "chunk", 9.0, 9.5))
    assert role_conflicts(log.spans_df()) == [("rollout_pool", 9.0)]


def test_group_rate_is_the_runs_groups_over_its_throughput_window():
    from bidirl.results.metrics import group_rate
    # 3 measured steps of 64 groups over the window [10, 106] s: 192 / 96 = 2 groups/s
    assert group_rate({"throughput": 1.0, "window": (10.0, 106.0), "measured_steps": 3}, 64) == 2.0
    assert group_rate({"throughput": None, "window": None, "measured_steps": 0}, 64) is None


def four_replicas_one_busy() -> EventLog:
    """Four rollout replicas of 1 GPU each on a 4-GPU pool; only replica 0 generates, for the whole 3 steps."""
    log = steps_log([10, 20, 30], [100, 100, 100])
    log.add_span(span("rollout_pool/rollouter/0", "generate", 0, 30))
    return log


def test_four_replicas_one_busy_is_75_percent_idle():
    """GPU-weighted idle: 3 of 4 GPUs idle the whole window -> 3·30 / (4·30) = 0.75 (no rounding: the spans are
    exact binary fractions); the pool-union figure is 0 since some GPU of the pool is always busy."""
    gpus = {f"rollout_pool/rollouter/{i}": 1 for i in range(4)}
    out = metrics.summary(four_replicas_one_busy(), policy="no-borrow", staleness=0,
                          pool_gpus={"rollout_pool": 4, "trainer_pool": 0}, gpus_per_worker=gpus, samples=SAMPLES)
    assert out["idle"]["rollout_pool"] == 0.75
    assert out["idle_overall"] == 0.75
    assert out["idle_pool_union"]["rollout_pool"] == 0.0
    line = metrics.idle_line(out)
    assert f"{metrics.IDLE_LABEL}: rollout_pool 75.0%" in line
    # the pool-union 0.0 % is printed only under its own label
    assert line.count("0.0%") == 1 and f"{metrics.POOL_UNION_LABEL}: rollout_pool 0.0%" in line
    assert metrics.idle_line(out) in metrics.format_summary({**out, "borrows": {}, "samples": {}})


def test_a_reward_learns_only_when_it_rises_beyond_its_step_to_step_spread():
    from bidirl.results.metrics import reward_trend
    # notebook 04's flat run (the issue's 0.344 … 0.328): fitted change negative, so no rise
    flat = reward_trend([0.344, 0.359, 0.328, 0.352, 0.328])
    assert flat["rises"] is False and "does not rise" in flat["text"]
    # a steady climb of 0.05 a step with ±0.01 wiggle: rise ≈ 0.05 × 4 = 0.2, spread of the changes ≈ 0.02
    climb = reward_trend([0.30, 0.36, 0.40, 0.46, 0.50])
    assert climb["rises"] is True and climb["rise"] == pytest.approx(0.2, abs=0.01)
    assert reward_trend([0.3, 0.4])["rises"] is None
