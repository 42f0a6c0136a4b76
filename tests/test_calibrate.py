"""Calibration of the stage-time models (paper §5.1, §6.4): records generated from known parameters plus
seeded noise are fitted back; errors must be of the size of the noise; bad records raise clear errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from bidirl.job import presets
from bidirl.perf import (RolloutModel, TrainerModel, TrainerParams, calibrate_rollout, calibrate_trainer,
                         sample_groups, sample_lengths, validate_records)

MODEL = presets.model("qwen3-vl-4b")
HW = presets.hardware("a6000")
STATS = presets.workload("geo3k")
STAGES = ("old_logprob", "ref_logprob", "actor_update")
NOISE = 0.03


def rollout_truth() -> RolloutModel:
    base = RolloutModel(MODEL, HW)
    q = base.params
    truth = dataclasses.replace(q, tau_pre=q.tau_pre * 1.5, alpha_pre=q.alpha_pre * 0.7, tau_dec=q.tau_dec * 1.3,
                                beta_tok=q.beta_tok * 0.8, beta_hist=q.beta_hist * 1.25)
    return RolloutModel(MODEL, HW, params=truth)


def rollout_records(truth: RolloutModel, n: int, noise: float, seed: int) -> list:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        groups, max_len, d = int(rng.integers(1, 17)), int(rng.choice([512, 1024, 2048, 4096])), int(rng.choice([1, 2, 4]))
        p, r = sample_groups(STATS, max_len, groups, 8, rng)
        t = truth.stage_time(p, r, d, 8)
        rows.append({"prompt_lens": p, "response_lens": r, "d": d, "group_size": 8,
                     "observed": t * float(np.exp(rng.normal(0.0, noise)))})
    return rows


def trainer_truth(layout: int) -> TrainerModel:
    q = TrainerModel(MODEL, HW, layout=layout).params
    scale = lambda m, f: {k: v * f for k, v in m.items()}  # noqa: E731
    truth = TrainerParams(tau=scale(q.tau, 1.4), alpha=scale(q.alpha, 0.6), r=scale(q.r, 1.2),
                          alpha_comm=q.alpha_comm, beta_comm=scale(q.beta_comm, 1.5))
    return TrainerModel(MODEL, HW, layout=layout, params=truth)


def trainer_records(truth: TrainerModel, n: int, noise: float, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        stage = STAGES[i % 3]
        size, max_len, d = int(rng.integers(1, 17)), int(rng.choice([512, 1024, 2048, 4096])), int(rng.choice([1, 2]))
        p, r = sample_lengths(STATS, max_len, size, rng)
        rows.append({"stage": stage, "prompt_lens": p, "response_lens": r, "d": d,
                     "observed": truth.chunk_time(stage, p, r, d) * float(np.exp(rng.normal(0.0, noise)))})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------

def test_rollout_fit_recovers_parameters_and_reports_noise_sized_errors():
    truth = rollout_truth()
    result = calibrate_rollout(rollout_records(truth, 60, NOISE, seed=1), RolloutModel(MODEL, HW))
    assert result.success
    # the terms that carry most of the decode time are recovered closely; β_tok·N_tok is nearly collinear with
    # β_hist·H_dec and the prefill is a small share of the time, so those are only bracketed
    for name in ("tau_dec", "beta_hist"):
        assert getattr(result.params, name) == pytest.approx(getattr(truth.params, name), rel=0.1), name
    for name in ("beta_tok", "alpha_pre"):
        assert 0.5 < getattr(result.params, name) / getattr(truth.params, name) < 2.0, name
    # errors of the size of the noise (|e^ε − 1| with ε ~ N(0, 0.03): median ≈ 2 %, p90 ≈ 5 %)
    assert result.median_error < 2 * NOISE and result.p90_error < 3 * NOISE
    assert np.median(result.prior_errors) > 3 * result.median_error
    report = result.report()
    assert set(report) >= {"median_error_pct", "p90_error_pct", "fitted"}
    assert report["median_error_pct"] == pytest.approx(100 * result.median_error)
    assert "c_pre" not in result.fitted and "r" not in result.fitted        # tp = 1: no communication terms
    # held-out records are predicted about as well
    held = rollout_records(truth, 30, NOISE, seed=2)
    pred = [result.model.stage_time(r["prompt_lens"], r["response_lens"], r["d"], 8) for r in held]
    err = np.abs(np.array(pred) - [r["observed"] for r in held]) / [r["observed"] for r in held]
    assert np.median(err) < 2 * NOISE


def test_rollout_fit_without_noise_is_exact():
    truth = rollout_truth()
    result = calibrate_rollout(rollout_records(truth, 40, 0.0, seed=3), RolloutModel(MODEL, HW))
    assert result.p90_error < 1e-3


@pytest.mark.parametrize("layout", [1, 2])
def test_trainer_fit_recovers_parameters_and_reports_noise_sized_errors(layout):
    truth = trainer_truth(layout)
    result = calibrate_trainer(trainer_records(truth, 90, NOISE, seed=4), TrainerModel(MODEL, HW, layout=layout))
    assert result.success
    for s in STAGES:
        assert result.params.alpha[s] == pytest.approx(truth.params.alpha[s], rel=0.1), s
    assert result.median_error < 2 * NOISE and result.p90_error < 3 * NOISE
    assert np.median(result.prior_errors) > 3 * result.median_error
    comm = [f for f in result.fitted if f.startswith(("beta_comm", "alpha_comm", "r["))]
    if layout == 1:
        assert comm == []                      # no collectives inside a one-GPU replica
    else:
        assert "beta_comm[actor_update]" in comm and "alpha_comm[actor_update]" not in comm


def test_trainer_fit_without_noise_is_exact_and_only_fits_present_stages():
    truth = trainer_truth(2)
    records = trainer_records(truth, 60, 0.0, seed=5)
    records = records[records["stage"] != "ref_logprob"]
    base = TrainerModel(MODEL, HW, layout=2)
    result = calibrate_trainer(records, base)
    assert result.p90_error < 1e-3
    assert not any("ref_logprob" in f for f in result.fitted)
    assert result.params.alpha["ref_logprob"] == base.params.alpha["ref_logprob"]


def test_calibration_accepts_a_list_of_dicts_and_a_frame():
    truth = trainer_truth(1)
    frame = trainer_records(truth, 12, 0.0, seed=6)
    a = calibrate_trainer(frame, TrainerModel(MODEL, HW, layout=1))
    b = calibrate_trainer(frame.to_dict("records"), TrainerModel(MODEL, HW, layout=1))
    assert a.params == b.params


# --------------------------------------------------------------------------------------------------
# record validation
# --------------------------------------------------------------------------------------------------

def good_row(**kw) -> dict:
    row = {"stage": "actor_update", "prompt_lens": [10, 20], "response_lens": [5, 6], "d": 1, "observed": 1.0}
    row.update(kw)
    return row


def test_empty_records_are_rejected():
    with pytest.raises(ValueError, match="no profiling records"):
        calibrate_rollout([], RolloutModel(MODEL, HW))
    with pytest.raises(ValueError, match="no profiling records"):
        calibrate_trainer(pd.DataFrame(), TrainerModel(MODEL, HW))


def test_missing_column_is_named():
    row = good_row()
    del row["observed"]
    with pytest.raises(ValueError, match="missing column 'observed'"):
        validate_records([row], "trainer")
    with pytest.raises(ValueError, match="missing column 'stage'"):
        validate_records([{k: v for k, v in good_row().items() if k != "stage"}], "trainer")


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), "slow"])
def test_non_positive_times_are_rejected(bad):
    with pytest.raises(ValueError, match="'observed' must hold positive times"):
        validate_records([good_row(), good_row(observed=bad)], "trainer")


def test_other_bad_values_are_named():
    with pytest.raises(ValueError, match="column 'd'"):
        validate_records([good_row(d=0)], "trainer")
    with pytest.raises(ValueError, match="column 'stage'"):
        validate_records([good_row(stage="backward")], "trainer")
    with pytest.raises(ValueError, match="row 0.*prompt_lens"):
        validate_records([good_row(prompt_lens=[-3, 1])], "trainer")
    with pytest.raises(ValueError, match="no requests"):
        validate_records([good_row(prompt_lens=[], response_lens=[])], "rollout")
    with pytest.raises(ValueError, match="group_size"):
        calibrate_rollout([good_row(group_size=3)], RolloutModel(MODEL, HW))
    with pytest.raises(ValueError, match="RolloutModel"):
        calibrate_rollout([good_row()], TrainerModel(MODEL, HW))
