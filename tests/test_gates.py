"""The scheduler's decisions as pure functions (bidirl.core.gates; paper §5.2 Eq. 3-4, Algorithm 2)."""

import pytest
from hypothesis import given, strategies as st

from bidirl.core import gates
from bidirl.core.protocol import SwitchCosts


def test_rollout_dispatch_is_capacity_proportional():
    assert gates.rollout_dispatch(8, 2, 2) == 4
    assert gates.rollout_dispatch(8, 3, 1) == 2
    assert gates.rollout_dispatch(5, 4, 4) == round(2.5)
    assert gates.rollout_dispatch(0, 2, 2) == 0 and gates.rollout_dispatch(-3, 2, 2) == 0
    assert gates.rollout_dispatch(8, 0, 0) == 0


@given(q=st.integers(0, 500), d_p=st.integers(1, 64), d_a=st.integers(0, 64))
def test_rollout_dispatch_never_exceeds_the_deficit(q, d_p, d_a):
    q_a = gates.rollout_dispatch(q, d_p, d_a)
    assert 0 <= q_a <= q


def m_linear(groups, d):
    """1 s per group per replica: M_r(n, d) = n / d."""
    return groups / d


def test_rollout_gate_is_eq3_when_the_load_is_the_deficit():
    costs = SwitchCosts(0.5, 0.5)
    g = gates.rollout_gate(m_linear, deficit=8, load=8, d_p=2, d_a=2, costs=costs)
    # M_r(8, 2) − max(M_r(4, 2), M_r(4, 2)) = 4 − 2 = M_r(8, 2) − M_r(8, 4)
    assert g.t_primary == 4 and g.t_joint == 2 and g.gain == 2 and g.q_a == 4 and g.cost == 1.0
    assert g.gain == pytest.approx(m_linear(8, 2) - m_linear(8, 4))
    assert g.admitted


def test_rollout_gate_counts_run_ahead_load_on_the_primaries():
    g = gates.rollout_gate(m_linear, deficit=4, load=12, d_p=2, d_a=2, costs=SwitchCosts(0.4, 0.4))
    # primaries keep 12 − 2 groups; the auxiliaries take Q_a = 2
    assert g.load == 12 and g.q_a == 2 and g.t_primary == 6 and g.t_joint == 5 and g.admitted
    # a load below the deficit counts as the deficit
    assert gates.rollout_gate(m_linear, deficit=4, load=1, d_p=2, d_a=2, costs=SwitchCosts(0, 0)).load == 4


def test_rollout_gate_rejects_a_window_shorter_than_the_switch_and_opportunistic_takes_it():
    costs = SwitchCosts(1.5, 1.5)
    g = gates.rollout_gate(m_linear, deficit=8, load=8, d_p=2, d_a=2, costs=costs)
    assert g.gain == 2 and not g.admitted
    assert gates.rollout_gate(m_linear, deficit=8, load=8, d_p=2, d_a=2, costs=costs, gated=False).admitted


def test_chunk_runs_never_cross_a_stage_and_respect_the_size():
    stages = ["a"] * 5 + ["b"] * 3
    assert gates.chunk_runs(stages, 2) == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
    assert gates.chunk_runs([], 4) == []


def run_time(first, end, d):
    """0.1 s per unit on one replica."""
    return 0.1 * (end - first) / d


def test_workload_time_and_drain_prefix():
    stages = ["old_logprob"] * 8 + ["actor_update"] * 8
    total, drained = gates.workload_time(stages, run_time, d=2, max_chunk=2)
    assert total == pytest.approx(0.8) and drained == 0
    # DrainPrefix: chunks of 4 units take 0.2 s on 2 replicas, so one finishes within 0.25 s, two within 0.41 s
    total, drained = gates.workload_time(stages, run_time, d=2, max_chunk=2, drain=0.25)
    assert drained == 4
    _, drained = gates.workload_time(stages, run_time, d=2, max_chunk=2, drain=0.41)
    assert drained == 8


def test_trainer_gate_is_algorithm_2():
    stages = ["old_logprob"] * 8 + ["actor_update"] * 8
    costs = SwitchCosts(c_in=0.2, c_out=0.1, c_grad=0.05)
    g = gates.trainer_gate(stages, run_time, d_p=2, d_a=2, max_chunk=2, costs=costs)
    # T_no = 0.8; DrainPrefix(C_in = 0.2) removes one chunk of 4 units; T_joint = 12 units on 4 replicas = 0.3
    assert g.t_no == pytest.approx(0.8) and g.drained == 4 and g.t_joint == pytest.approx(0.3)
    assert g.t_borrow == pytest.approx(0.2 + 0.3 + 0.1 + 0.05) and g.admitted
    assert g.gain == pytest.approx(0.5) and g.cost == pytest.approx(0.35)


def test_trainer_gate_charges_c_grad_only_for_update_work_and_rejects_short_windows():
    costs = SwitchCosts(c_in=0.0, c_out=0.0, c_grad=10.0)
    forward_only = gates.trainer_gate(["old_logprob"] * 8, run_time, 2, 2, 2, costs)
    assert forward_only.cost == 0.0 and forward_only.admitted
    with_update = gates.trainer_gate(["actor_update"] * 8, run_time, 2, 2, 2, costs)
    assert with_update.cost == 10.0 and not with_update.admitted
    assert gates.trainer_gate(["actor_update"] * 8, run_time, 2, 2, 2, costs, gated=False).admitted


def test_joint_tail_split_balances_the_two_sides():
    per_unit = 1.0
    n_a, finish = gates.joint_tail_split(10, 1, 1, 0.0, 0.0, lambda k: k * per_unit, lambda k: k * per_unit)
    assert (n_a, finish) == (5, 5.0)
    # a side that is busy for 4 s more takes less
    n_a, finish = gates.joint_tail_split(10, 1, 1, 0.0, 4.0, lambda k: k * per_unit, lambda k: k * per_unit)
    assert (n_a, finish) == (3, 7.0)
    # each side gets nothing or at least one unit per device
    n_a, _ = gates.joint_tail_split(5, 2, 4, 0.0, 0.0, lambda k: k / 2, lambda k: k / 4)
    assert n_a in (0, 4, 5)
    # fewer units than devices on every side: everything stays on the primaries
    assert gates.joint_tail_split(1, 2, 2, 0.5, 0.0, lambda k: k, lambda k: k) == (0, 1.5)


@given(n=st.integers(1, 60), d_p=st.integers(1, 8), d_a=st.integers(1, 8),
       ready_p=st.floats(0, 5), ready_a=st.floats(0, 5))
def test_joint_tail_split_is_never_worse_than_all_on_the_primaries(n, d_p, d_a, ready_p, ready_a):
    time_p, time_a = (lambda k: k / d_p), (lambda k: k / d_a)
    n_a, finish = gates.joint_tail_split(n, d_p, d_a, ready_p, ready_a, time_p, time_a)
    if n >= d_p:
        assert finish <= max(ready_p + time_p(n), ready_a) + 1e-9
    assert 0 <= n_a <= n
