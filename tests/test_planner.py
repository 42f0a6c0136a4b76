"""Algorithm 1 (paper §4): layouts, candidates, compatibility, the envelope and the sweep."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.job import config as C
from bidirl.job import presets
from bidirl.job.config import ConfigError
from bidirl.job.planner import (CANDIDATE_KEYS, ENVELOPE_KEYS, candidate_partitions, compatible, min_feasible_layouts,
                                plan, replica_count, representative_batch)
from bidirl.perf import memory
from bidirl.viz.plan import INCOMPATIBLE, TRACE_NAMES, sweep_figure

GiB = 1 << 30


def job(**overrides) -> C.JobConfig:
    """The paper's default job (a6000-default) without its fixed partition, with dotted-key overrides."""
    return C.load("a6000-default").with_overrides({"cluster.partition": None, **overrides})


# --------------------------------------------------------------------------------------------------
# the pieces
# --------------------------------------------------------------------------------------------------

def test_candidate_partitions():
    assert candidate_partitions(32, "node-aligned", 8) == [(8, 24), (16, 16), (24, 8)]
    assert candidate_partitions(6, "node-aligned", 8) == [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1)]
    assert candidate_partitions(5, "any", 8) == [(1, 4), (2, 3), (3, 2), (4, 1)]
    assert candidate_partitions(1, "any", 8) == []
    with pytest.raises(ConfigError):
        candidate_partitions(8, "random", 8)


def test_compatible_needs_whole_replicas_of_both_roles_on_both_pools():
    assert compatible(8, 24, 1, 4)
    assert not compatible(6, 10, 1, 4)          # 6 GPUs hold no whole 4-GPU trainer replica set
    assert not compatible(8, 6, 4, 2)           # the trainer pool cannot host 4-GPU rollout replicas
    assert compatible(8, 8, 2, 2)
    assert replica_count(24, 4) == 6 and replica_count(6, 4) == 1


def test_min_feasible_layouts_for_the_paper_default_by_hand():
    # Qwen3-VL-4B trainer on 48 GiB × 0.85: states 18 B/param = 79.9 GB, activations for 4 × (1024 + 2048)
    # tokens at 2·(36·2560 + 8·2560 + 4·9728) + 4·151936 = 910,848 B/token = 11.2 GB:
    # ρ = 2 → 39.9 + 11.2 = 51.1 GB > 43.8 GB usable; ρ = 4 → 20.0 + 11.2 = 31.2 GB fits.
    rho_r, rho_t, needs = min_feasible_layouts(job())
    assert (rho_r, rho_t) == (1, 4)
    usable = 48 * GiB * 0.85
    assert needs["trainer"].usable == pytest.approx(usable)
    assert needs["trainer"].parts["activations"] == pytest.approx(4 * 3072 * 910_848)
    assert needs["trainer"].parts["model_states"] == pytest.approx(4.438e9 * 18 / 4)
    # rollout: 8.9 GB of weights + reserve + one group of 3072-token requests fit one GPU
    assert needs["rollout"].fits and needs["rollout"].layout == 1
    # 2B: states 38.3 GB alone fit, with activations they do not → 2 GPUs
    assert min_feasible_layouts(job(model="qwen3-vl-2b"))[:2] == (1, 2)


def test_representative_batch_is_seeded_and_whole_groups():
    p1, r1 = representative_batch(job())
    p2, r2 = representative_batch(job())
    np.testing.assert_array_equal(r1, r2)
    assert p1.size == 64 * 8
    assert (p1.reshape(64, 8) == p1.reshape(64, 8)[:, :1]).all()
    assert not np.array_equal(representative_batch(job(seed=1))[1], r1)


# --------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------

def test_paper_default_plans_and_json_has_the_design_keys():
    result = plan(job())
    data = json.loads(result.to_json())
    assert set(ENVELOPE_KEYS) <= set(data["envelope"])
    assert data["candidates"] and all(set(CANDIDATE_KEYS) <= set(c) for c in data["candidates"])
    env = data["envelope"]
    assert env["rollout_gpus"] + env["trainer_gpus"] == 16
    assert env["rollout_replicas"] == env["rollout_gpus"] // env["rollout_layout"]
    assert env["trainer_replicas"] == env["trainer_gpus"] // env["trainer_layout"]
    assert math.isfinite(env["pipeline_rate"]) and env["pipeline_rate"] > 0
    assert data["chosen_by"] == "planner"
    # the example config plans as it is (its partition fixed)
    fixed = plan("a6000-default")
    assert fixed.fixed and fixed.choice == "8-8"


def test_sweep_rates_follow_from_the_stage_times():
    result = plan(job(**{"cluster.gpus": 32, "cluster.placement": "any"}))
    s = result.sweep
    assert len(s) == 31 and list(s["rollout_gpus"]) == list(range(1, 32))
    finite = s[np.isfinite(s["rollout_time"]) & np.isfinite(s["trainer_time"])]
    np.testing.assert_allclose(finite["rollout_rate"], 64 / finite["rollout_time"])
    np.testing.assert_allclose(finite["trainer_rate"], 64 / finite["trainer_time"])
    np.testing.assert_allclose(s["pipeline_rate"], np.minimum(s["rollout_rate"], s["trainer_rate"]))
    # fewer GPUs than one replica: no replica, no rate
    short = s[s["trainer_gpus"] < result.envelope.trainer_layout]
    assert (short["trainer_rate"] == 0).all() and np.isinf(short["trainer_time"]).all()


def test_cached_stage_times_equal_direct_model_evaluation():
    """Rollout in dispatch (group-id) order, trainer in consumption order (groups as they complete), each with
    the step's end the candidate charges (the weight sync; the trainer's optimizer work on its g_t GPUs)."""
    from bidirl.job.planner import consumption_order
    result = plan(job(**{"cluster.gpus": 24, "cluster.placement": "any"}))
    env, (p, r) = result.envelope, result.batch
    order = consumption_order(p, r, 8)
    for row in result.sweep.iloc[[3, 7, 11, 19]].itertuples():
        assert row.rollout_time == pytest.approx(env.rollout_model.stage_time(p, r, row.rollout_replicas, 8)
                                                 + row.sync_time)
        assert row.trainer_time == pytest.approx(env.trainer_model.stage_time(p[order], r[order],
                                                                              row.trainer_replicas, 4)
                                                 + row.optimizer_time + row.sync_time)


def test_consumption_order_puts_groups_in_completion_order():
    from bidirl.job.planner import consumption_order
    p = np.array([5, 5, 7, 7, 3, 3])
    r = np.array([10, 2, 1, 1, 40, 1])          # group longest: 10+5, 1+7, 40+3
    assert list(consumption_order(p, r, 2)) == [2, 3, 0, 1, 4, 5]


def test_choice_is_the_best_compatible_candidate_and_plans_are_deterministic():
    result = plan(job(**{"model": "qwen3-vl-2b", "cluster.gpus": 32, "cluster.placement": "any"}))
    s = result.sweep
    ok = s[s["compatible"]]
    assert result.envelope.pipeline_rate == ok["pipeline_rate"].max()
    assert bool(s.loc[s["chosen"], "compatible"].iloc[0])
    first_best = ok.index[ok["pipeline_rate"] == ok["pipeline_rate"].max()][0]
    assert s.loc[first_best, "chosen"]
    again = plan(job(**{"model": "qwen3-vl-2b", "cluster.gpus": 32, "cluster.placement": "any"}))
    assert again.sweep.equals(s)


@settings(max_examples=25)
@given(st.sampled_from(["qwen3-vl-2b", "qwen3-vl-4b"]), st.integers(4, 48), st.sampled_from(["any", "node-aligned"]),
       st.sampled_from([512, 1024, 2048]), st.integers(0, 3))
def test_incompatible_partitions_are_never_chosen(model, gpus, placement, max_len, seed):
    if placement == "node-aligned" and gpus > 8:
        gpus = 8 * max(2, gpus // 8)
    cfg = job(**{"model": model, "cluster.gpus": gpus, "cluster.placement": placement,
                 "workload.max_response_len": max_len, "seed": seed})
    try:
        result = plan(cfg)
    except ConfigError as exc:
        assert exc.field == "cluster.gpus"            # no compatible split of this budget
        return
    s = result.sweep
    chosen = s[s["chosen"]]
    assert len(chosen) == 1 and bool(chosen["compatible"].iloc[0])
    assert chosen["pipeline_rate"].iloc[0] == s.loc[s["compatible"], "pipeline_rate"].max()
    env = result.envelope
    assert compatible(env.rollout_gpus, env.trainer_gpus, env.rollout_layout, env.trainer_layout)


def test_fixed_partition_is_used_and_the_sweep_stays_complete():
    result = plan(job(**{"cluster.gpus": 32, "cluster.partition": [8, 24]}))
    assert result.fixed and result.choice == "8-24"
    assert len(result.sweep) == 3 and result.sweep["chosen"].sum() == 1
    assert json.loads(result.to_json())["chosen_by"] == "cluster.partition"


def test_incompatible_fixed_partition_names_the_field_and_alternatives():
    with pytest.raises(ConfigError) as info:
        plan(job(**{"cluster.placement": "any", "cluster.partition": [6, 10]}))
    err = info.value
    assert err.field == "cluster.partition"
    assert "4-12" in err.fix and "8-8" in err.fix
    with pytest.raises(ConfigError) as info:
        plan(job(**{"cluster.gpus": 32, "cluster.partition": [4, 28]}))      # not node-aligned
    assert info.value.field == "cluster.partition" and "placement" in info.value.fix


def test_budget_too_small_for_one_replica_of_each_role():
    with pytest.raises(ConfigError) as info:
        plan(job(**{"cluster.gpus": 4, "cluster.placement": "any"}))          # 4B trainer replica needs 4 GPUs
    assert info.value.field == "cluster.gpus" and "at least 8" in info.value.fix
    with pytest.raises(ConfigError) as info:
        plan(job(**{"model": "qwen3-8b", "cluster.gpus": 4, "cluster.placement": "any"}))
    assert info.value.field == "cluster.gpus"
    assert "more memory" in info.value.fix and "smaller model" in info.value.fix


def test_no_compatible_partition_is_a_config_error():
    # 12 GPUs in 8-GPU nodes with placement any: 4-GPU trainer replicas allow only 4-8 and 8-4
    assert plan(job(**{"cluster.gpus": 12, "cluster.placement": "any"})).choice in (
        "4-8", "8-4")
    with pytest.raises(ConfigError) as info:
        plan(job(**{"cluster.gpus": 10, "cluster.placement": "any"}))
    assert info.value.field == "cluster.gpus" and "multiples of 4" in info.value.fix


def test_activations_that_never_fit_name_the_micro_batch():
    with pytest.raises(ConfigError) as info:
        plan(job(**{"rl.micro_batch_per_device": 64}))
    assert info.value.field == "rl.micro_batch_per_device"


def test_reference_model_off_drops_the_ref_stage():
    with_ref = plan(job())
    without = plan(job(**{"rl.reference_model": False}))
    assert "ref_logprob" in with_ref.stages and "ref_logprob" not in without.stages
    assert (without.sweep["trainer_time"] < with_ref.sweep["trainer_time"]).all()


def test_tiny_cpu_example_plans():
    result = plan("tiny-cpu")
    assert result.envelope.rollout_layout == result.envelope.trainer_layout == 1


def test_sweep_figure_has_fixed_traces_and_highlights_the_choice():
    result = plan(job(**{"cluster.gpus": 16, "cluster.placement": "any"}))
    fig = sweep_figure(result)
    n = len(result.sweep)
    assert len(fig.data) == len(TRACE_NAMES) and all(len(t.x) == n for t in fig.data[:5])
    colors = list(fig.data[0].marker.color)
    ok = result.sweep["compatible"].to_numpy()
    assert all(c == INCOMPATIBLE for c, good in zip(colors, ok) if not good)
    i = int(np.nonzero(result.sweep["chosen"].to_numpy())[0][0])
    shape = [s for s in fig.layout.shapes if s.name == "choice"][0]
    assert shape.x0 == i - 0.5 and result.choice in fig.layout.annotations[0].text
    assert len(sweep_figure(plan(job(**{"cluster.gpus": 24, "cluster.placement": "any"}))).data) == len(TRACE_NAMES)


def test_memory_need_parts_add_up():
    need = memory.trainer_need(presets.model("qwen3-vl-4b"), presets.hardware("a6000"), 4, 4, 3072)
    assert need.total == pytest.approx(sum(need.parts.values()))
    assert need.fits


def test_mini_batches_cut_the_planner_update_stage_as_the_chunk_queue_does():
    """With ``rl.mini_batch_prompts`` the planner's M_t is the forward stages over the batch, plus each mini-batch's
    own chunk rounds of the update stage (its last chunk partial), plus the step's optimizer updates (one per
    mini-batch: those between two mini-batches are barriers the next mini-batch's chunks wait for, the last one is
    the step's own optimizer step) and the weight sync. Rebuilt here from the trainer model one mini-batch at a
    time; the old planner cut the update stage over the whole batch and charged no optimizer update (29.1 s less at
    4-12: 15 inter-node all-reduces of 1.94 s)."""
    from bidirl.core.protocol import chunk_size
    from bidirl.job.planner import consumption_order
    from bidirl.perf.predictor import StagePredictor
    cfg = C.load("a6000-default").with_overrides({"cluster.placement": "any", "cluster.partition": None,
                                                   "rl.mini_batch_prompts": 4})
    result = plan(cfg)
    env, (p, r) = result.envelope, result.batch
    order = consumption_order(p, r, cfg.workload.group_size)
    p, r = p[order], r[order]
    tm, mbpd, d = env.trainer_model, cfg.rl.micro_batch_per_device, 3          # 4-12: three 4-GPU replicas
    mini = 4 * cfg.workload.group_size                                         # 32 samples a mini-batch
    assert chunk_size(mbpd, tm.layout, d) == 48 > mini     # each mini-batch is one partial chunk a stage
    forward = tm.stage_time(p, r, d, mbpd, ("old_logprob", "ref_logprob"))
    rounds = sum(tm.stage_time(p[lo:lo + mini], r[lo:lo + mini], d, mbpd, ("actor_update",))
                 for lo in range(0, p.size, mini))
    updates = cfg.optimizer_updates_per_step * StagePredictor.from_config(
        cfg, env.rollout_layout, tm.layout).optimizer_update_time(tm.layout * d)
    whole = tm.stage_time(p, r, d, mbpd, ("actor_update",))
    row = result.sweep.set_index("label").loc["4-12"]
    # the same terms summed in another order: ~20 float64 additions, relative error ≤ 20·2⁻⁵³ ≈ 2e-15
    assert row.trainer_time == pytest.approx(forward + rounds + updates
                                              + cfg.weight_sync_time(rollout_layout=env.rollout_layout), rel=1e-12)
    assert row.trainer_time - (forward + whole) > 25.0        # the old number: forward + whole, no barrier


@pytest.mark.parametrize("overrides", [
    {},                                                                     # one optimizer step a step
    {"rl.mini_batch_prompts": 16, "rl.updates_per_sync": 2,                 # 2 local updates of 2 mini-batches,
     "rl.param_offload": True, "rl.optimizer_offload": True},              # with the offload copies
])
def test_planner_charges_the_step_end_the_simulator_charges(overrides):
    """M_t holds the step's optimizer work and the weight sync that ends it, M_r the weight sync, with the numbers
    the simulator charges: on 4-12 (12 trainer GPUs over two nodes, so every optimizer update carries an inter-node
    gradient all-reduce of 1.94 s) the planner's M_t less its chunk rounds, and its M_r less the rollout model's
    generation, equal the primary trainer's optimizer spans and the sync span of one simulated step (jitter off).
    The old planner left the step's own optimizer step and the weight sync out (4.8 s a step here: AdamW and the
    all-reduce 1.94 s, the 4B sync 2.88 s), so its differences were 0 (rollout) and the barriers between
    mini-batches only (trainer).

    Tolerance: each simulated span is ``(t0 + d) − t0`` on a clock below 10³ s, exact to an ulp of 10³ s
    (1.1e-13 s) per span; at most 5 spans (4 optimizer updates and the sync) of ≥ 2.9 s in all against the planner's
    float64 sums of the same terms (a few 2⁻⁵³ relative): ≤ 5·1.1e-13 / 2.9 ≈ 2e-13 relative, so 1e-12."""
    from bidirl.core import protocol as P
    from bidirl.job.planner import consumption_order, trainer_stage_times
    from bidirl.sim.driver import SimDriver
    cfg = C.load("a6000-default").with_overrides({"cluster.placement": "any", "cluster.partition": [4, 12],
                                                   "rl.staleness": 0, **overrides})
    result = plan(cfg)
    env, (p, r) = result.envelope, result.batch
    order = consumption_order(p, r, cfg.workload.group_size)
    chunks = trainer_stage_times(cfg, env.trainer_model, p[order], r[order], [env.trainer_replicas],
                                 result.stages)[0]
    generation = env.rollout_model.stage_time(p, r, env.rollout_replicas, cfg.workload.group_size)

    driver = SimDriver(cfg, "no-borrow", steps=1, seed=cfg.seed, jitter=0.0)
    spans = driver.run().log.spans_df()
    mine = spans[(spans["worker"] == P.PRIMARY_TRAINER) & (spans["step"] == 0)]
    opt = mine[mine["kind"] == "optimizer"]
    sync = float((mine[mine["kind"] == "sync"]["end"] - mine[mine["kind"] == "sync"]["start"]).sum())
    assert len(opt) == cfg.optimizer_updates_per_step and sync > 2.0
    simulated_opt = float((opt["end"] - opt["start"]).sum())
    assert env.trainer_time - chunks == pytest.approx(simulated_opt + sync, rel=1e-12)
    assert env.rollout_time - generation == pytest.approx(sync, rel=1e-12)
    assert env.optimizer_time == pytest.approx(simulated_opt, rel=1e-12)
    assert env.sync_time == pytest.approx(sync, rel=1e-12)
    assert env.pipeline_rate == pytest.approx(cfg.workload.prompts_per_step
                                              / max(env.rollout_time, env.trainer_time), rel=1e-12)
