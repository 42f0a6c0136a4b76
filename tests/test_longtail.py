"""The long-tail CPU job (``tiny-cpu-longtail``): its length distribution, the simulator running exactly the lengths a
real run forces, the gate's windows in both directions, and the side-by-side report
(``bidirl.experiments.side_by_side``).

The unit tests use the simulator; the integration test (``-m integration``) runs the job for real on an embedded
local Ray (vLLM rollouters, torch trainers) for three steps, about two minutes on 2 cores, and asserts what does not
depend on the machine's speed: every response has its forced length and the gate admits a window in each
direction. Speed ratios belong to the benchmark (``benchmarks/bench_longtail.py``), never to a test.
"""

from __future__ import annotations

import numpy as np
import pytest

from bidirl.cluster.engines.workers.rollout import GroupRequest
from bidirl.core.protocol import DIRECTIONS, ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL
from bidirl.experiments import side_by_side as sbs
from bidirl.job import config as cfgmod
from bidirl.perf.workload import GroupLengths

CONFIG = "tiny-cpu-longtail"


@pytest.fixture(scope="module")
def cfg():
    return cfgmod.load(CONFIG)


@pytest.fixture(scope="module")
def simulated(cfg):
    return sbs.run_policies(cfg, ("no-borrow", "bidirl"), steps=4, simulate=True)


def step_lengths(cfg, group_ids) -> list:
    lengths = GroupLengths.of(cfg, cfg.seed)
    return [n for g in group_ids for n in lengths(g)[1]]


# --------------------------------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------------------------------

def test_the_shipped_job_forces_long_tailed_lengths_within_the_models_positions(cfg):
    w = cfg.workload
    assert w.forced_lengths and w.response_lengths is not None
    assert cfg.workload_stats.prompt_max + w.max_response_len <= 64      # the tiny model's positions
    r = np.array(step_lengths(cfg, range(4 * w.prompts_per_step)))
    assert r.min() >= 1 and r.max() == w.max_response_len
    assert abs(r.mean() - w.response_lengths.mean) < 0.15 * w.response_lengths.mean
    median, p95 = np.percentile(r, [50, 95])
    assert p95 > 3 * median                              # a long tail: most responses short, a few near the limit
    assert 0 < np.mean(r == w.max_response_len) < 0.1


def test_group_lengths_follow_the_configured_distribution_not_the_presets(cfg):
    preset = cfg.with_overrides({"workload.response_lengths": None})
    own = np.array(step_lengths(cfg, range(256)))
    theirs = np.array(step_lengths(preset, range(256)))
    stats = preset.workload_stats                        # the arithmetic preset: a mean fraction, cv 0.12
    assert theirs.mean() == pytest.approx(stats.response_mean_fraction * cfg.workload.max_response_len, rel=0.1)
    assert own.mean() == pytest.approx(cfg.workload.response_lengths.mean, rel=0.15)
    assert own.std() / own.mean() > 5 * theirs.std() / theirs.mean()


def test_a_forced_request_generates_each_responses_own_length():
    forced = GroupRequest(3, (1, 2), 3, 40, response_tokens=(5, 40, 1))
    assert forced.forced and [forced.target_tokens(i) for i in range(3)] == [5, 40, 1]
    plain = GroupRequest(3, (1, 2), 3, 40)
    assert not plain.forced and plain.target_tokens(2) == 40
    assert GroupRequest(3, (1, 2), 3, 40, ignore_eos=True).forced


# --------------------------------------------------------------------------------------------------
# the simulator models the distribution the real run forces
# --------------------------------------------------------------------------------------------------

def test_every_simulated_step_trains_on_exactly_the_drawn_lengths(cfg, simulated):
    """A real run forces response i of group g to GroupLengths(config, seed)(g)[1][i] tokens; the simulator must
    run the same tokens step by step, so its step tokens equal the drawn prompt + response lengths."""
    lengths = GroupLengths.of(cfg, cfg.seed)
    for res in simulated.values():
        tokens = res.log.steps_df().set_index("step")["tokens"]
        assert len(res.view.batches) == 4
        for step, _version, groups in res.view.batches:
            drawn = sum(lengths(g)[0] * cfg.workload.group_size + sum(lengths(g)[1]) for g in groups)
            assert tokens[step] == drawn


def test_the_simulator_admits_windows_in_both_directions_and_predicts_a_gain(cfg, simulated):
    counts = sbs.window_counts(simulated["bidirl"])
    assert all(counts[d]["admitted"] >= 1 for d in DIRECTIONS), counts
    assert sbs.window_counts(simulated["no-borrow"]) == {d: {"admitted": 0, "evaluated": 0} for d in DIRECTIONS}
    ratio = sbs.throughput_ratio(simulated)
    assert ratio.provenance == "simulated" and ratio.window > 1.1


def test_the_first_window_charges_the_configured_switch_costs(cfg, simulated):
    from bidirl.runtime.assemble import assemble
    first = sbs.windows_table(simulated["bidirl"]).iloc[0]
    costs = cfg.switch_costs(ROLLOUT_ON_TRAINER_POOL)
    # the engines load at t = 0 and start reserving the first switch's pinned buffer then: a window at t = 0
    # waits for all of it (bidirl.perf.costs.first_switch_allocation), on top of the configured costs
    allocation = assemble(cfg, "bidirl", steps=1, seed=cfg.seed).first_switch.get((ROLLOUT_ON_TRAINER_POOL, "in"), 0.0)
    assert first["direction"] == ROLLOUT_ON_TRAINER_POOL and first["step"] == 0 and first["t"] == 0
    assert first["cost"] == pytest.approx(costs.c_in + costs.c_out + allocation)
    assert first["predicted_gain"] > first["cost"] and first["admitted"]


# --------------------------------------------------------------------------------------------------
# the side-by-side report
# --------------------------------------------------------------------------------------------------

def test_windows_table_lists_every_decision_in_time_order(simulated):
    res = simulated["bidirl"]
    table = sbs.windows_table(res)
    assert tuple(table.columns) == sbs.WINDOW_COLUMNS
    assert len(table) == len(res.log.decisions)
    assert table["t"].is_monotonic_increasing
    assert set(table["direction"]) <= set(DIRECTIONS)
    lines = sbs.format_windows(table)
    assert len(lines) == len(table) + 1
    assert all(("admitted" in ln) != ("rejected" in ln) for ln in lines[1:])


def test_step_throughputs_are_the_measured_steps_tokens_over_their_times(simulated):
    res = simulated["no-borrow"]
    steps = res.log.steps_df().sort_values("step")
    per_step = sbs.step_throughputs(res)
    assert len(per_step) == len(steps) - 1                 # staleness 0: the first step is dropped
    end = steps["end"].to_numpy()
    expected = steps["tokens"].to_numpy()[1:] / np.diff(end)
    assert np.allclose(per_step, expected)
    # the §7.1 throughput is the same tokens over the same window
    assert res.summary()["throughput"] == pytest.approx(steps["tokens"].to_numpy()[1:].sum() / (end[-1] - end[0]))


def test_throughput_ratio_compares_like_with_like(simulated):
    ratio = sbs.throughput_ratio(simulated)
    a, b = simulated["bidirl"], simulated["no-borrow"]
    assert ratio.window == pytest.approx(a.summary()["throughput"] / b.summary()["throughput"])
    assert ratio.median_step == pytest.approx(np.median(sbs.step_throughputs(a)) / np.median(sbs.step_throughputs(b)))
    with pytest.raises(ValueError, match="no run of policy 'opportunistic'"):
        sbs.throughput_ratio(simulated, "opportunistic")


def test_throughput_ratio_refuses_a_measured_run_against_a_simulated_one(simulated):
    import dataclasses
    measured = dataclasses.replace(simulated["bidirl"], provenance="measured")
    with pytest.raises(ValueError, match="cannot compare a measured run of bidirl with a simulated run"):
        sbs.throughput_ratio({"bidirl": measured, "no-borrow": simulated["no-borrow"]})


def test_step_throughputs_need_a_measured_step(cfg):
    res = sbs.run_policies(cfg, ("no-borrow",), steps=1, simulate=True)["no-borrow"]
    with pytest.raises(ValueError, match="need at least 2 steps"):
        sbs.step_throughputs(res)


# --------------------------------------------------------------------------------------------------
# the real run
# --------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_the_real_long_tail_run_forces_the_lengths_and_borrows_both_ways(cfg, model_dir, ray_session):
    """Three real steps under bidirl: each step's responses have exactly the lengths the simulator draws, and the
    gate admits at least one window in each direction. The margins do not depend on the machine's speed: the first
    Rollouter-on-TrainerPool window is judged on the config's models and costs alone (as in simulation), and later
    windows on the online profiler's refit of the measured times, whose gains grow with them."""
    from bidirl.cluster.engines.driver import EngineDriver
    steps = 3
    res = EngineDriver(cfg, "bidirl", steps, cfg.seed, model_dir=str(model_dir)).run()
    s = res.summary()
    assert res.provenance == "measured" and len(s["train"]) == steps
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    for (step, _version, groups), stats in zip(res.view.batches, s["train"]):
        forced = step_lengths(cfg, groups)
        assert stats["response_length"] == pytest.approx(np.mean(forced))
        assert (stats["response_length_min"], stats["response_length_max"]) == (min(forced), max(forced))
    counts = sbs.window_counts(res)
    assert counts[ROLLOUT_ON_TRAINER_POOL]["admitted"] >= 1, sbs.windows_table(res)
    assert counts[TRAINER_ON_ROLLOUT_POOL]["admitted"] >= 1, sbs.windows_table(res)
    sim = sbs.run_policies(cfg, ("bidirl",), steps, simulate=True)["bidirl"]
    first, sim_first = sbs.windows_table(res).iloc[0], sbs.windows_table(sim).iloc[0]
    assert (first["direction"], first["admitted"]) == (sim_first["direction"], sim_first["admitted"])
    # T_no is the config's models alone, as in simulation: at the first decision (on Started, nothing grown yet) the
    # same floats go through the same code in one process, so it is equal bit for bit (==; a run judged on anything
    # else — measured times, another model — differs). The charge differs only by what was left of the first
    # switch's pinned allocation when the gate ran: (c_in + left) + c_out with 0 ≤ left_run ≤ left_sim (all of it at
    # the simulation's t = 0, less a moment into the run), and float addition is monotone, so the charge lies
    # between the configured costs and the simulation's charge exactly (<=, no tolerance)
    assert res.log.decisions[0].detail["t_no"] == sim.log.decisions[0].detail["t_no"]
    steady = cfg.switch_costs(ROLLOUT_ON_TRAINER_POOL)
    assert steady.c_in + steady.c_out <= first["cost"] <= sim_first["cost"]
    assert s["costs"][ROLLOUT_ON_TRAINER_POOL]["c_in"] > 0 and s["costs"][TRAINER_ON_ROLLOUT_POOL]["c_grad"] > 0
