"""The simulator's fast paths give the answers of the plain algorithms they replace, and the scaling
measurement (``bidirl.sim.scaling``) and the parallel partition sweep are well-formed."""

from __future__ import annotations

import heapq

import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from bidirl.core import gates
from bidirl.core.buffer import RolloutBuffer
from bidirl.core.protocol import GroupState
from bidirl.core.staleness import StalenessRule
import bidirl.job.config as cfgmod
from bidirl.sim import scaling
from bidirl.sim.sweep import simulate_partitions


def _reference_lookahead(buf: RolloutBuffer, trainer_version: int):
    """The lookahead batch by brute force: B oldest complete by (tag, commit order), accepted if the tags left
    behind stay consumable (the list form of the rule)."""
    B = buf.rule.batch
    complete = [r for r in buf.groups.values() if r.status == "complete"]
    if len(complete) < B:
        return None
    chosen = heapq.nsmallest(B, complete, key=lambda r: (r.version, r.commit_seq))
    ids = {r.group_id for r in chosen}
    left = sorted(r.version for r in buf.groups.values() if r.group_id not in ids)
    if not buf.rule.leaves_consumable(left, trainer_version):
        return None
    return [r.group_id for r in chosen]


@settings(max_examples=120, deadline=None)
@given(staleness=st.sampled_from([0, 0.5, 1, 2]), batch=st.integers(1, 5), data=st.data())
def test_lookahead_batch_matches_the_brute_force_rule(staleness, batch, data):
    buf = RolloutBuffer(StalenessRule(staleness, batch))
    version = 0
    for _ in range(40):
        for _ in range(buf.admissible(version)):
            buf.admit(version, "w")
        running = sorted(g for g, r in buf.groups.items() if r.status == "running")
        parked = sorted(buf.partial)
        action = data.draw(st.sampled_from(["commit", "park", "resume"]))
        if action == "park" and running:
            gid = data.draw(st.sampled_from(running))
            buf.park(GroupState(gid, 10, (1, 0), (False, False), buf.groups[gid].version))
        elif action == "resume" and parked:
            buf.resume(data.draw(st.sampled_from(parked)), "w")
        elif running:
            gid = data.draw(st.sampled_from(running))
            buf.commit(GroupState(gid, 10, (5, 5), (True, True), buf.groups[gid].version))
        want = _reference_lookahead(buf, version)
        assert buf.select_batch(version) == want
        if want is not None:
            buf.consume(want)
            version += 1


@given(tags=st.lists(st.integers(0, 6), max_size=30), batch=st.integers(1, 6),
       staleness=st.sampled_from([0, 0.5, 1, 2, 3]), v_t=st.integers(0, 6))
def test_consumability_from_counts_equals_the_list_form(tags, batch, staleness, v_t):
    rule = StalenessRule(staleness, batch)
    counts: dict = {}
    for t in tags:
        counts[t] = counts.get(t, 0) + 1
    assert rule.leaves_consumable_counts(counts, v_t) == rule.leaves_consumable(sorted(tags), v_t)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 300), d_p=st.integers(1, 6), d_a=st.integers(1, 6), ready_p=st.floats(0, 3),
       ready_a=st.floats(0, 3), slope=st.floats(0.5, 2.0))
def test_tail_split_with_prepare_chooses_the_same_split(n, d_p, d_a, ready_p, ready_a, slope):
    """``prepare`` only announces candidates: the split and completion are those of the plain scan, and every
    k the scan times (beyond the first block's best) was announced first."""
    time_p = lambda k: (k // d_p + (k % d_p > 0)) * 1.0        # whole rounds of one unit per device
    time_a = lambda k: slope * (k // d_a + (k % d_a > 0))
    bound_p = lambda k: 0.9 * time_p(k)
    bound_a = lambda k: 0.9 * time_a(k)
    plain = gates.joint_tail_split(n, d_p, d_a, ready_p, ready_a, time_p, time_a, bound_p, bound_a)
    announced, timed = set(), set()

    def prepare(splits):
        assert all(not ((0 < s < d_a) or (0 < n - s < d_p)) for s in splits)
        announced.update(splits)

    def spy_a(k):
        timed.add(k)
        return time_a(k)
    got = gates.joint_tail_split(n, d_p, d_a, ready_p, ready_a, time_p, spy_a, bound_p, bound_a, prepare=prepare)
    assert got == plain
    assert {k for k in timed if k} <= announced


def test_scaled_config_grows_the_batch_with_the_cluster():
    cfg = scaling.scaled_config(64)
    assert cfg.cluster.gpus == 64 and cfg.workload.prompts_per_step == 256
    assert (cfg.cluster.partition.rollout, cfg.cluster.partition.trainer) == (32, 32)
    with pytest.raises(cfgmod.ConfigError, match="gpus"):
        scaling.scaled_config(20)           # 10 + 10 is not whole nodes of 8
    with pytest.raises(cfgmod.ConfigError, match="prompts_per_gpu"):
        scaling.scaled_config(16, prompts_per_gpu=0)


def test_measure_scaling_rows_and_table():
    calls = []
    frame = scaling.measure_scaling((16,), (1, 2), prompts_per_gpu=1, repeats=2,
                                    progress=lambda done, total: calls.append((done, total)))
    # one untimed warm-up run, then two rounds over the two points
    assert calls == [(k, 5) for k in range(1, 6)]
    assert (frame["repeats"] == 2).all()
    assert (frame["cpu_us_per_gpu_step_min"] <= frame["cpu_us_per_gpu_step"]).all()
    assert (frame["cpu_us_per_gpu_step"] <= frame["cpu_us_per_gpu_step_max"]).all()
    assert list(frame.columns) == list(scaling.COLUMNS)
    assert list(frame["steps"]) == [1, 2] and (frame["gpus"] == 16).all()
    assert (frame["gpu_steps"] == frame["gpus"] * frame["steps"]).all()
    assert (frame["wall_s"] > 0).all() and (frame["events"] > 0).all()
    assert frame.loc[1, "events"] > frame.loc[0, "events"]         # a longer run processes more events
    assert set(frame["wall_provenance"]) == {"measured"} and set(frame["throughput_provenance"]) == {"simulated"}
    table = scaling.markdown_table(frame).splitlines()
    assert len(table) == 4 and table[2].startswith("| 16 | 1 | 16 |")
    fig = scaling.scaling_figure(frame, frame)
    assert len(fig.data) == 4          # wall time, wall and CPU cost per GPU-step, wall time vs steps
    with pytest.raises(ValueError, match="at least one"):
        scaling.measure_scaling((), 1)
    with pytest.raises(ValueError, match="repeats must be"):
        scaling.measure_scaling((16,), 1, repeats=0)


def test_cost_summary_reads_medians_by_slope_ratio_and_spread():
    # cost = 1000·G^0.5 µs: slope 0.5 exactly, 64 over 16 = (64/16)^0.5 = 2, spread the same (monotone)
    frame = pd.DataFrame({"gpus": [64, 16, 32], "cpu_us_per_gpu_step": [8000.0, 4000.0, 1000 * 32 ** 0.5],
                          "repeats": [3, 3, 3]})
    out = scaling.cost_summary(frame)
    assert out["slope"] == pytest.approx(0.5) and out["ratio"] == pytest.approx(2.0)
    assert out["spread"] == pytest.approx(2.0) and (out["smallest"], out["largest"]) == (16, 64)
    assert "64 GPUs over 16: 2.00×" in out["text"] and "median of 3 runs" in out["text"]
    assert "slope +0.50" in out["text"]
    with pytest.raises(ValueError, match="two GPU counts"):
        scaling.cost_summary(frame.iloc[:1])


def test_partition_sweep_on_two_workers_is_the_same_frame():
    job = cfgmod.load("a6000-default").with_overrides({"cluster.placement": "any", "cluster.partition": None,
                                                       "workload.prompts_per_step": 16})
    serial = simulate_partitions(job, steps=2, seed=0)
    forked = simulate_partitions(job, steps=2, seed=0, workers=2)
    pd.testing.assert_frame_equal(serial, forked)
    with pytest.raises(cfgmod.ConfigError, match="workers"):
        simulate_partitions(job, steps=2, workers=0)
