"""The A6000 preset's fitted numbers are the output of bidirl.experiments.paper_fit, and only the claims marked
``role: fit`` feed that fit (so the report's held-out match rate is a prediction)."""

import math

import pytest

from bidirl.experiments import paper_fit
from bidirl.experiments.claims import load_claims
from bidirl.job import presets


@pytest.fixture(scope="module")
def fitted():
    return paper_fit.fit()


def test_shipped_a6000_preset_is_the_fit(fitted):
    hw = presets.hardware("a6000")
    assert math.isclose(hw.peak_flops, fitted["peak_flops"], rel_tol=1e-3)
    assert math.isclose(hw.intra_node_bandwidth, fitted["intra_node_bandwidth"], rel_tol=1e-3)
    for knob in paper_fit.KNOBS:
        assert math.isclose(getattr(hw, knob), fitted[knob], rel_tol=5e-3), knob
    # wake_fixed and sleep_fixed land on their lower bound (0 s), where the solver's last digits (≈1e-11 s) vary
    # with the scipy/BLAS build: compare those to a microsecond, the rest relatively.
    for name, value in fitted["switch_model"].items():
        assert math.isclose(hw.switch_model[name], value, rel_tol=5e-3, abs_tol=1e-6), name
    # the fit reaches its targets: the planner picks 8-24 for 4B with the paper's 2.09x spread
    assert fitted["check"]["static_4b_choice"] == 8
    assert math.isclose(fitted["check"]["static_4b_spread"], 2.09, rel_tol=0.01)


def test_fit_claims_are_exactly_the_claims_marked_fit():
    roles = {c.id: c.role for c in load_claims()}
    assert {i for i, r in roles.items() if r == "fit"} == set(paper_fit.FIT_CLAIMS)
    assert sum(r == "held-out" for r in roles.values()) >= 40


def test_switch_fit_reads_only_the_table_it_is_given():
    """A different target row moves the constants: the fit is not a constant table."""
    hw = paper_fit.tex_hardware(presets.hardware("a6000"))
    base = paper_fit.fit_switch_model(hw)
    doubled = {d: {k: 2 * v for k, v in row.items()} for d, row in paper_fit.TABLE_2B.items()}
    moved = paper_fit.fit_switch_model(hw, table=doubled)
    assert moved["wake_fixed"] > base["wake_fixed"] * 1.5


def test_static_2b_spread_is_out_of_reach_of_any_rollout_cost():
    """The arithmetic behind limits.yaml's ``size-independent-efficiency``: with the 4B sweep fitted, no rollout cost
    brings the 2B spread within the claim's tolerance, because the 2B trainer sets both ends of it.

    The 2B and 4B runs deal the same 64 × 8 requests, so at 8 rollout GPUs the 2B rollout is no slower than the 4B's
    (a cost added to both, like a per-iteration engine overhead, keeps it so). 12-4 is then trainer-bound (its rollout
    is faster still) and 8-8 takes at least max(R_4B(8), T_2B(8)), so the 2B spread is at least
    T_2B(4) / max(R_4B(8), T_2B(8)) (≈ 128 s / 65 s ≈ 2.0 today), above the claim's upper end 1.40 + 0.12. A trainer
    mechanism that stops the 2B trainer from halving its time with twice the GPUs, or a rollout that grows faster for
    the smaller model than for the larger one, fails this test, and the limit's text must then be rewritten."""
    from bidirl.experiments.claims import allowed_deviation
    from bidirl.job.planner import plan
    hw = presets.hardware("a6000")
    two = plan(paper_fit._knob_config("qwen3-vl-2b", 16), hardware=hw).sweep.set_index("rollout_gpus")
    four = plan(paper_fit._knob_config("qwen3-vl-4b", 32), hardware=hw).sweep.set_index("rollout_gpus")
    r2_8, r2_12, r4_8 = two.loc[8].rollout_time, two.loc[12].rollout_time, four.loc[8].rollout_time
    t2_4, t2_8 = two.loc[12].trainer_time, two.loc[8].trainer_time       # trainer GPUs: 16 − rollout GPUs
    assert r2_12 <= r2_8 < r4_8 < t2_4
    claim = next(c for c in load_claims() if c.id == "static-spread-2b")
    upper = float(claim.value) + allowed_deviation(claim.value, claim.tolerance)
    floor = t2_4 / max(r4_8, t2_8)
    assert floor > upper
    # the planner's spread obeys the floor
    assert paper_fit.static_sweep(hw, "qwen3-vl-2b", 16, (4, 8, 12))[1] >= floor - 1e-9


@pytest.mark.slow
def test_no_fixed_decode_iteration_cost_flips_the_2b_choice_and_a_per_sequence_one_does_from_018_ms():
    """The refits behind limits.yaml's ``size-independent-efficiency`` (:func:`paper_fit.refit_with_engine_cost`: the
    4B sweep refitted with the engine cost, then the 2B sweep planned with the refitted knobs).

    * A fixed cost per decode iteration (``scheduler_overhead``, default 1 ms) adds the same seconds to both models'
      rollouts; the refit absorbs it (train_mfu 0.202 → 0.094 at 40 ms, 0.028 at 200 ms, decode_mbu rises) and the
      planner still picks 4-12 for 2B. From about 250 ms the 4B fit itself fails (it no longer picks 8-24).
    * A cost per running sequence and iteration (``decode_token_overhead``, default 0) weighs the 2B rollout on 4
      GPUs (128 requests a replica) more than the 4B's on 8 (64 a replica): refitted, it turns the 2B choice to 8-8
      between 0.1834 ms (still 4-12) and 0.1835 ms (the planner's step end, its optimizer step and weight sync,
      moved the edge from 0.16 ms). The test brackets that edge at 0.17 and 0.20 ms: the solver's last digits,
      which vary with the BLAS build, move the refitted knobs by ~1e-4 relative (the shipped preset's check above
      allows 5e-3), while the bracket leaves the edge 7 % on either side."""
    for seconds in (0.040, 0.200):
        fixed = paper_fit.refit_with_engine_cost(scheduler_overhead=seconds)
        assert fixed["static_4b_choice"] == 8 and math.isclose(fixed["static_4b_spread"], 2.09, rel_tol=0.01)
        assert fixed["train_mfu"] < 0.5 * presets.hardware("a6000").train_mfu      # absorbed by the trainer's knob
        assert fixed["choice_2b"] == 4, seconds
    assert paper_fit.refit_with_engine_cost(scheduler_overhead=0.250)["static_4b_choice"] != 8
    below = paper_fit.refit_with_engine_cost(decode_token_overhead=0.17e-3)
    above = paper_fit.refit_with_engine_cost(decode_token_overhead=0.20e-3)
    for r in (below, above):
        assert r["static_4b_choice"] == 8 and math.isclose(r["static_4b_spread"], 2.09, rel_tol=0.01)
    assert below["choice_2b"] == 4 and above["choice_2b"] == 8
    # about 2.5 times the CPU-measured per-sequence cost the limit compares it with (cpu-calibrated, 73.7 µs)
    assert 2.4 < 0.18e-3 / presets.hardware("cpu-calibrated").decode_token_overhead < 2.6
