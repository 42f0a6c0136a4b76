"""The gates' decision-regret counterfactual (bidirl.experiments.gate_regret): a flipped decision is the only
change to the run up to it, and the summary counts what the rows say."""

import math

import pandas as pd
import pytest

from bidirl.core import protocol as P
from bidirl.experiments import gate_regret
from bidirl.job import config as cfgmod


@pytest.fixture(scope="module")
def cfg():
    return cfgmod.load("tiny-cpu")


def test_a_flipped_decision_is_the_only_change_up_to_it(cfg):
    base = gate_regret._simulate(cfg, None).log.decisions
    assert len(base) >= 2
    k = 1
    flipped = gate_regret._simulate(cfg, k).log.decisions
    assert flipped[:k] == base[:k]
    assert flipped[k].admitted is (not base[k].admitted)
    assert (flipped[k].t, flipped[k].direction, flipped[k].predicted_gain) == \
        (base[k].t, base[k].direction, base[k].predicted_gain)


def test_the_regret_rows_and_their_summary(cfg):
    rows = gate_regret.run_regret(cfg, "p", "x")
    frame = pd.DataFrame(rows, columns=list(gate_regret.COLUMNS))
    assert len(frame) == len(gate_regret._simulate(cfg, None).log.decisions)
    rot = frame[frame["direction"] == P.ROLLOUT_ON_TRAINER_POOL]
    assert rot["realized_no"].notna().all() and rot["wait_with"].notna().all()
    s = gate_regret.summarize(frame)
    for direction in P.DIRECTIONS:
        part = frame[frame["direction"] == direction]
        wrong = part[part["flip_ratio"] > 1.0]
        assert s[direction]["decisions"] == len(part) and s[direction]["wrong"] == len(wrong)
        # a sum of the same float64 logs in the same order: equal to the last bit
        assert s[direction]["regret_log_sum"] == sum(math.log(r) for r in wrong["flip_ratio"])


def test_the_summary_on_hand_made_rows():
    rows = [dict(direction=P.ROLLOUT_ON_TRAINER_POOL, admitted=False, flip_ratio=1.02, t_no=10.0, wait_with=12.0,
                 realized_no=9.0, realized_with=8.0),
            dict(direction=P.ROLLOUT_ON_TRAINER_POOL, admitted=True, flip_ratio=0.99, t_no=20.0, wait_with=15.0,
                 realized_no=21.0, realized_with=15.5),
            dict(direction=P.TRAINER_ON_ROLLOUT_POOL, admitted=True, flip_ratio=1.01)]
    s = gate_regret.summarize(pd.DataFrame(rows))
    rot, tor = s[P.ROLLOUT_ON_TRAINER_POOL], s[P.TRAINER_ON_ROLLOUT_POOL]
    assert (rot["decisions"], rot["admitted"], rot["wrong"], rot["wrong_refusals"]) == (2, 1, 1, 1)
    assert (tor["wrong"], tor["wrong_refusals"]) == (1, 0)
    # |errors| of the wait with the window: 4 and 0.5 → median 2.25; signed mean (4 − 0.5) / 2
    assert rot["wait_with_abs_median_s"] == 2.25 and rot["wait_with_mean_s"] == 1.75
    assert rot["t_no_abs_median_s"] == 1.0 and rot["regret_max"] == 1.02


def test_the_trainer_gate_rows_carry_both_realized_waits(cfg):
    rows = pd.DataFrame(gate_regret.run_regret(cfg, "p", "x"), columns=list(gate_regret.COLUMNS))
    tor = rows[rows["direction"] == P.TRAINER_ON_ROLLOUT_POOL]
    assert len(tor) and tor["realized_no"].notna().all() and tor["realized_with"].notna().all()
    base = gate_regret._simulate(cfg, None)
    for row in tor.itertuples():
        d = base.log.decisions[row.decision]
        assert row.t_no == d.detail["t_no"] and row.wait_with == d.detail["t_borrow"]
        # the run realizes the side it took. Each step here has one optimizer step (so its first and its last are
        # the same): without a window the wait ends at its start; with one, at its start or later (the switch
        # back). realized = max(end, back) − (end − start) − t rounds twice on values below 1e3 s (one ulp ≈
        # 1.1e-13 each): slack 1e-9 s. A wait read from the run's last optimizer step instead of the step's
        # (checked: the refreshed gang's rule applied to the whole run) misses by whole steps, ~70 ms each here
        spans = base.log.spans_df()
        opt = spans[(spans["kind"] == "optimizer") & (spans["step"] == d.detail["step"])]
        assert len(opt) == 1 and float(opt["start"].iloc[0]) >= d.t
        start = float(opt["start"].iloc[0]) - d.t
        if d.admitted:
            assert row.realized_with >= start - 1e-9
        else:
            assert abs(row.realized_no - start) <= 1e-9


def test_the_trainer_gate_workload_end_on_a_hand_made_log():
    from bidirl.results.trace import EventLog, Span
    log = EventLog()
    for worker, pool, kind, start, end, detail in (
            ("trainer_pool/trainer", "trainer_pool", "chunk", 0.0, 8.0, {}),
            ("trainer_pool/trainer", "trainer_pool", "optimizer", 9.0, 11.0, {}),
            ("rollout_pool/rollouter/0", "rollout_pool", "switch_out", 7.0, 12.5,
             {"direction": P.TRAINER_ON_ROLLOUT_POOL}),
            ("trainer_pool/trainer", "trainer_pool", "optimizer", 20.0, 21.0, {})):
        log.add_span(Span(worker, pool, "primary", kind, start, end, step=0, version=0, detail=detail))
    spans = log.spans_df()
    # the switch back ends after the first optimizer step: 12.5 less its 2 s (small binary-exact values: ==)
    assert gate_regret._workload_done(spans, 0, 1.0, last=False) == 10.5
    # the last optimizer step of the step (refreshed auxiliary gang) ends later than the switch back: its start
    assert gate_regret._workload_done(spans, 0, 1.0, last=True) == 20.0
    # nothing after the decision: NaN
    assert math.isnan(gate_regret._workload_done(spans, 0, 30.0, last=False))
