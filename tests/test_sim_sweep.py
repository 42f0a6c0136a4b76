"""``bidirl.sim.sweep.simulate_partitions``: every candidate split simulated beside the planner's prediction."""

from __future__ import annotations

import pytest

import bidirl.job.config as cfgmod
from bidirl.job.planner import plan
from bidirl.sim import simulate
from bidirl.sim.sweep import COLUMNS, STATUSES, simulate_partitions

JOB = cfgmod.load("a6000-default").with_overrides({"cluster.placement": "any", "cluster.partition": None})
STEPS = 4


@pytest.fixture(scope="module")
def frame():
    return simulate_partitions(JOB, steps=STEPS, seed=0)


def test_every_compatible_split_is_simulated_in_sweep_order(frame):
    p = plan(JOB)
    ok = p.sweep[p.sweep["compatible"]]
    assert list(frame.columns) == list(COLUMNS)
    assert list(frame["label"]) == list(ok["label"]) and len(frame) >= 2
    assert list(frame["predicted_rate"]) == list(ok["pipeline_rate"])
    assert set(frame["status"]) == {"ok"} and set(frame["provenance"]) == {"simulated"}
    assert (frame["steps"] == STEPS).all() and (frame["policy"] == "no-borrow").all()
    assert frame.attrs["planner_choice"] == p.envelope.label


def test_rates_are_the_groups_of_the_throughput_window_over_its_time(frame):
    for row in frame.itertuples():
        job = JOB.with_overrides({"cluster.partition": [row.rollout_gpus, row.trainer_gpus]})
        s = simulate(job, "no-borrow", steps=STEPS, seed=0).summary()
        t0, t1 = s["window"]
        assert row.throughput == s["throughput"] and row.measured_steps == s["measured_steps"]
        assert row.rate == pytest.approx(s["measured_steps"] * JOB.workload.prompts_per_step / (t1 - t0))
        # same unit as the prediction: within a factor of two of λ_pipe for a no-borrow run
        assert 0.5 < row.rate / row.predicted_rate < 2.0


def test_one_seed_one_frame(frame):
    again = simulate_partitions(JOB, steps=STEPS, seed=0)
    assert again.equals(frame)
    other = simulate_partitions(JOB, [tuple(frame.loc[0, ["rollout_gpus", "trainer_gpus"]])], steps=STEPS, seed=1)
    assert other.loc[0, "throughput"] != frame.loc[0, "throughput"]


def test_chosen_splits_incompatible_ones_and_bad_input():
    p = plan(JOB)
    bad = p.sweep[~p.sweep["compatible"]].iloc[0]
    good = p.sweep[p.sweep["compatible"]].iloc[0]
    seen = []
    out = simulate_partitions(JOB, [(bad["rollout_gpus"], bad["trainer_gpus"]),
                                    (good["rollout_gpus"], good["trainer_gpus"])],
                              steps=3, seed=0, progress=lambda done, total: seen.append((done, total)))
    assert list(out["status"]) == ["incompatible", "ok"] and "whole replicas" in out.loc[0, "reason"]
    assert out["rate"].isna().tolist() == [True, False]
    assert seen == [(1, 2), (2, 2)]
    with pytest.raises(ValueError, match="not a candidate split"):
        simulate_partitions(JOB, [(3, 3)])
    with pytest.raises(ValueError, match="pair"):
        simulate_partitions(JOB, [8])
    with pytest.raises(cfgmod.ConfigError, match="unknown policy"):
        simulate_partitions(JOB, policy="fastest")
    with pytest.raises(cfgmod.ConfigError, match="steps"):
        simulate_partitions(JOB, steps=0)


def test_unsupported_and_too_short_runs_are_rows_not_errors():
    fractional = JOB.with_overrides({"rl.staleness": 0.5})
    out = simulate_partitions(fractional, policy="areal", steps=3, seed=0)
    assert set(out["status"]) == {"unsupported"} and out["reason"].str.contains("integer").all()
    short = simulate_partitions(JOB.with_overrides({"rl.staleness": 1}), steps=2, seed=0)
    assert set(short["status"]) == {"no-window"} and short["rate"].isna().all()
    assert set(out["status"]) | set(short["status"]) <= set(STATUSES)
