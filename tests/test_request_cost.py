"""The rollout's per-request admission cost γ_req (bidirl.perf.rollout.request_admission_time): P_pre gains
γ_req·B_j, 0 unless calibrated, fitted by `bidirl calibrate` on fit points only, and charged by the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from bidirl.calibrate.from_records import calibrate_profile
from bidirl.core import protocol as P
from bidirl.job import presets
from bidirl.perf import RolloutModel
from bidirl.perf.fit import calibrate_rollout
from bidirl.perf.params import check_stage_params, knob_rollout_params
from bidirl.perf.replica import BatchingEngine, EngineCosts, EngineGroup
from bidirl.runtime.loop import EventLoop

TINY = presets.model("tiny")
CPU = presets.hardware("cpu")
GAMMA = 1.4e-4          # s per request: the size the CPU profile's fit finds (benchmarks/calibration_cpu.md)


def _model(gamma: float = 0.0, **kw) -> RolloutModel:
    params = dataclasses.replace(knob_rollout_params(TINY, CPU), gamma_req=gamma)
    return RolloutModel(TINY, CPU, params=params, max_seqs=256, **kw)


def test_uncalibrated_presets_charge_no_request_cost():
    for hw in ("cpu", "a6000", "h100"):
        for model in ("tiny", "qwen3-vl-2b"):
            assert RolloutModel(presets.model(model), presets.hardware(hw)).params.gamma_req == 0.0


def test_the_request_cost_adds_gamma_times_the_replicas_requests():
    """Two replicas (groups of 4 dealt round-robin: 3 groups → 8 and 4 requests) with equal lengths: the busier
    replica is the slowest with or without γ_req, and it pays γ_req·8 more; its prefill alone pays the same."""
    p, r = np.full(12, 10), np.full(12, 6)
    base, charged = _model(), _model(GAMMA)
    # sums of a few terms of ≤ 1 s in float64: relative rounding ~1e-15, far below the 1.1e-3 s added
    assert charged.stage_time(p, r, 2, 4) - base.stage_time(p, r, 2, 4) == pytest.approx(8 * GAMMA, rel=1e-9)
    assert charged.prefill_time(p) - base.prefill_time(p) == pytest.approx(12 * GAMMA, rel=1e-9)
    assert charged.replica_times(p, r, 2, 4) - base.replica_times(p, r, 2, 4) == pytest.approx([8 * GAMMA, 4 * GAMMA],
                                                                                                  rel=1e-9)
    # the planner's vectorised form gives the same numbers as stage_time
    assert charged.stage_times(p, r, [1, 2, 3]) == pytest.approx([charged.stage_time(p, r, d) for d in (1, 2, 3)],
                                                                  rel=1e-12)


def test_stage_params_accept_gamma_req_and_refuse_a_negative_one():
    ok = check_stage_params({"tiny": {"rollout": {"tp": 1, "gamma_req": GAMMA}}})
    assert ok["tiny"]["rollout"]["gamma_req"] == GAMMA
    with pytest.raises(ValueError, match=r"stage_params\.tiny\.rollout\.gamma_req"):
        check_stage_params({"tiny": {"rollout": {"tp": 1, "gamma_req": -1e-4}}})


def _records(model: RolloutModel) -> pd.DataFrame:
    rows = []
    for groups in (1, 2, 4, 8, 16, 32):
        for prompt in (4, 12, 24):
            for response in (2, 8, 24):
                n = 4 * groups
                p, r = np.full(n, prompt), np.full(n, response)
                rows.append({"prompt_lens": p, "response_lens": r, "d": 1, "group_size": 4,
                             "observed": model.stage_time(p, r, 1, 4)})
    return pd.DataFrame(rows)


def test_calibration_recovers_a_known_request_cost_from_zero():
    """Records made by a model with γ_req = 140 µs (other parameters at the priors, no noise): fitting from
    γ_req = 0 finds it. The problem is exactly representable, so the fit's residuals vanish; least squares stops
    at its default tolerances (ftol 1e-8 relative cost change), which leave γ_req within 1 % here."""
    truth = _model(GAMMA)
    fit = calibrate_rollout(_records(truth), _model(0.0), fit_request_cost=True)
    assert "gamma_req" in fit.fitted
    assert fit.params.gamma_req == pytest.approx(GAMMA, rel=0.01)
    assert fit.p90_error < 1e-3


def test_without_the_flag_the_request_cost_stays_where_it_was():
    """The default (a job's log: one batch size cannot separate B_j from the prefill's FLOPs) fits no γ_req."""
    fit = calibrate_rollout(_records(_model(GAMMA)), _model(0.0))
    assert "gamma_req" not in fit.fitted and fit.params.gamma_req == 0.0
    with pytest.raises(ValueError, match="fit_request_cost"):
        calibrate_rollout(_records(_model(0.0)), _model(0.0), fit_request_cost="yes")


def test_the_shipped_cpu_calibration_fits_the_request_cost_and_it_lowers_the_held_out_tail():
    """On data/profiles/cpu-tiny the fit finds a positive γ_req and, against the same split without it, the
    held-out rollout p90 falls (9.9 % → 4.6 % when recorded; the test asks only that it falls)."""
    with_cost = calibrate_profile(presets.data_dir() / "profiles" / "cpu-tiny")
    without = calibrate_profile(presets.data_dir() / "profiles" / "cpu-tiny", request_cost=False)
    assert with_cost.stage_params["rollout"]["gamma_req"] > 0
    # more operating points (grid points of the fit split) than fitted rollout parameters
    fitted = [k for k in with_cost.stage_params["rollout"] if k != "tp"]
    assert with_cost._count("fit") > len(fitted), (with_cost._count("fit"), fitted)
    assert "gamma_req" not in without.stage_params["rollout"]
    assert with_cost.error("rollout")["p90"] < without.error("rollout")["p90"]
    shipped = presets.hardware("cpu-calibrated")
    assert RolloutModel(TINY, shipped).params.gamma_req == with_cost.stage_params["rollout"]["gamma_req"]


def test_the_simulated_prefill_wave_charges_the_request_cost():
    """A fresh group of 3 requests, no jitter, 5 tokens each: the group takes τ_pre + α_pre·F + 3·γ_req for its
    prefill wave, then 5 decode iterations of τ_dec; so γ_req adds exactly 3·γ_req to its time."""
    flops = lambda lens: float(np.sum(lens))   # noqa: E731
    elapsed = []
    for gamma in (0.0, GAMMA):
        c = EngineCosts(tau_pre=0.01, alpha_pre=1e-6, tau_dec=0.02, beta_tok=0.0, beta_hist=0.0, prefill_flops=flops,
                        kv_tokens=10**6, noise=0.0, gamma_req=gamma)
        loop, done = EventLoop(), []
        eng = BatchingEngine("rollouter/rollout_pool/0", c, loop, np.random.default_rng(0),
                             lambda w, state, took: done.append(took), lambda *a: None, lambda *a: None)
        eng.add(EngineGroup.from_task(P.GroupTask(1), 100, (5, 5, 5), 0))
        loop.run()
        assert len(done) == 1
        elapsed.append(done[0])
    # τ_pre + α·F = 0.01 + 3e-4 s, then 5 · 0.02 s: sums of a few float64 terms, rounding ~1e-16 s
    assert elapsed[0] == pytest.approx(0.01 + 1e-6 * 300 + 5 * 0.02, abs=1e-12)
    assert elapsed[1] - elapsed[0] == pytest.approx(3 * GAMMA, abs=1e-12)
