"""The scheduler's decisions as pure functions (bidirl.core.gates; paper §5.2 Eq. 3-4, Algorithm 2)."""

import numpy as np
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


def test_expected_remaining_is_the_conditional_mean_over_the_sample():
    sample = np.array([10, 20, 30, 40])
    np.testing.assert_allclose(gates.expected_remaining([0, 15, 35, 50, 5], [False] * 4 + [True], sample),
                               [25.0, 30.0 - 15.0, 5.0, 1.0, 0.0])
    assert gates.expected_remaining([3], [False], np.array([])).tolist() == [0.0]


def test_a_response_past_every_recent_length_takes_its_remaining_length_from_the_prior():
    # the recent sample holds only finished responses (10..40); one at 50 tokens outgrew all of them, so the
    # prior (the job's length sample) answers: E_prior[R − 50 | R > 50] = mean(60, 80) − 50 = 20 tokens
    recent, prior = np.array([10, 20, 30, 40]), np.array([10, 40, 60, 80])
    np.testing.assert_allclose(gates.expected_remaining([0, 35, 50, 90, 5], [False] * 4 + [True], recent, prior),
                               [25.0, 5.0, 20.0, 1.0, 0.0])   # within the recent sample: as without a prior
    # past the prior's longest too: one more token, as before
    assert gates.expected_remaining([90], [False], recent, prior).tolist() == [1.0]


def test_the_expected_longest_remaining_length_of_one_response_is_its_conditional_mean():
    recent, prior = np.array([10, 20, 30, 40]), np.array([10, 40, 60, 80])
    for g in (0, 15, 35, 50, 90):
        mean = gates.expected_remaining([g], [False], recent, prior)[0]
        # the event sum is exact up to the rounding of its logs: a few ulps of the 4-sample mean (≤ 80 tokens)
        assert gates.expected_max_remaining([g], [False], recent, prior) == pytest.approx(mean, rel=1e-12)


def test_the_expected_longest_remaining_length_is_the_mean_of_the_maximum_not_the_maximum_of_the_means():
    # two fresh responses, each 10, 20, 30 or 40 tokens: E[max] over the 16 equally likely pairs is 31.25 (Jensen:
    # above the 25 each one's mean gives); one at 15 needs 5, 15 or 25 more; a finished one adds nothing
    sample = np.array([10, 20, 30, 40])
    assert gates.expected_max_remaining([0, 0], [False, False], sample) == pytest.approx(31.25, rel=1e-12)
    pairs = [max(a, b - 15) for a in sample for b in sample if b > 15]
    assert gates.expected_max_remaining([0, 15, 40], [False, False, True], sample) == pytest.approx(np.mean(pairs),
                                                                                                  rel=1e-12)
    assert gates.expected_max_remaining([0, 0], [True, True], sample) == 0.0
    assert gates.expected_max_remaining([], [], sample) == 0.0
    assert gates.expected_max_remaining([3], [False], np.array([])) == 0.0     # no sample: nothing is known
    # past every sampled length (recent and prior): one more token, certain
    assert gates.expected_max_remaining([90, 95], [False, False], sample, np.array([50])) == 1.0


@given(sample=st.lists(st.integers(1, 400), min_size=1, max_size=40),
       prior=st.lists(st.integers(1, 600), max_size=40),
       progress=st.lists(st.tuples(st.integers(0, 650), st.booleans()), min_size=1, max_size=12))
def test_the_expected_longest_remaining_length_lies_between_the_largest_mean_and_the_longest_remainder(
        sample, prior, progress):
    g, done = [p for p, _ in progress], [d for _, d in progress]
    sample, prior = np.array(sample, float), np.array(prior, float)
    lengths = gates.RemainingLengths.of(g, done, sample, prior)
    longest = gates.expected_max_remaining(g, done, sample, prior)

    def reach(x, finished):
        """A response's longest possible remainder: the longest length above it in the sample it is read from,
        less its progress; one token past every sampled length; 0 when finished."""
        if finished:
            return 0.0
        for s in (sample, prior):
            if (s > x).any():
                return max(float(s.max()) - x, 1.0)
        return 1.0

    # the integral sums at most a few hundred gaps of ≤ 650 tokens: 1e-9 relative covers its rounding
    farthest = max(reach(x, d) for x, d in zip(g, done))
    assert max(lengths.mean) * (1 - 1e-9) <= longest <= farthest * (1 + 1e-9) + 1e-12
    assert longest <= lengths.mean.sum() * (1 + 1e-9) + 1e-12      # the longest is at most the sum of all
    assert lengths.mean[np.array(done, bool)].sum() == 0.0
    # finished responses add nothing to the maximum
    unfinished = [i for i, d in enumerate(done) if not d]
    assert longest == pytest.approx(lengths.expected_max(unfinished), rel=1e-12, abs=1e-12)


def test_replica_remaining_keeps_the_expected_longest_and_the_expected_tokens():
    out = gates.replica_remaining(np.array([25.0, 25.0, 10.0]), 35.0)
    assert out[0] == 35.0 and out.sum() == pytest.approx(60.0) and out[1] / out[2] == pytest.approx(2.5)
    np.testing.assert_array_equal(gates.replica_remaining(np.array([25.0]), 25.0), [25.0])
    np.testing.assert_array_equal(gates.replica_remaining(np.array([0.0, 0.0]), 0.0), [0.0, 0.0])


def test_the_slowest_of_independent_replicas():
    # one replica: its own mean; certain times: the largest; two fair coins between 10 and 90 s: 90 − 80 / 4
    assert gates.expected_slowest([np.array([10.0, 90.0])], [np.array([0.5, 1.0])]) == pytest.approx(50.0)
    assert gates.expected_slowest([np.array([3.0]), np.array([7.0])], [np.array([1.0]), np.array([1.0])]) == 7.0
    coin = (np.array([10.0, 90.0]), np.array([0.5, 1.0]))
    assert gates.expected_slowest([coin[0]] * 2, [coin[1]] * 2) == pytest.approx(70.0)
    assert gates.expected_slowest([], []) == 0.0


@given(st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=6), min_size=1, max_size=5))
def test_the_slowest_replica_is_expected_no_sooner_than_any_one_and_no_later_than_the_longest_time(samples):
    values, cdfs, means = [], [], []
    for sample in samples:
        v, counts = np.unique(np.array(sample, float), return_counts=True)
        values.append(v)
        cdfs.append(np.cumsum(counts) / counts.sum())
        means.append(float(np.mean(sample)))
    slowest = gates.expected_slowest(values, cdfs)
    # sums of at most 6 gaps of ≤ 100 s in doubles: 1e-9 relative covers their rounding
    assert max(means) * (1 - 1e-9) - 1e-9 <= slowest <= max(max(x) for x in samples) * (1 + 1e-9) + 1e-9


def iterations(context, remaining, prefill):
    """A replica whose decode iterations cost 1 s each, whatever they hold: it takes as long as its longest
    request (the decode-wave term of the appendix's replica model, alone)."""
    return float(np.max(remaining)) if len(remaining) else 0.0


def test_rollout_gate_waits_for_the_longest_response_of_a_group_not_the_longest_mean():
    # one needed group of four fresh responses, each 10 or 90 tokens with equal odds: every response's mean is
    # 50 tokens, but the group is done only when its longest is, after 90 tokens unless all four are short:
    # E[max] = 90 − 80 / 2⁴ = 85 iterations. The gate used to answer 50.
    sample = np.array([10.0, 90.0])
    group = gates.GroupWork(0, "p0", 0, (0, 0, 0, 0), (False,) * 4, True, (0, 0))
    g = gates.rollout_gate([group], ["p0"], 1, 1, iterations, sample, SwitchCosts(0.0, 0.0))
    assert g.t_primary == pytest.approx(85.0, rel=1e-12)
    # two such groups on one replica wait for the longest of eight: 90 − 80 / 2⁸
    other = gates.GroupWork(1, "p0", 0, (0, 0, 0, 0), (False,) * 4, True, (0, -1))
    g = gates.rollout_gate([group, other], ["p0"], 1, 1, iterations, sample, SwitchCosts(0.0, 0.0))
    assert g.t_primary == pytest.approx(90 - 80 / 2 ** 8, rel=1e-12)
    # with one group moved to the auxiliary each replica waits for the longest of its four (85 expected), but the
    # batch waits for the slower replica: the longest of all eight again, wherever they run
    assert g.t_joint == pytest.approx(90 - 80 / 2 ** 8, rel=1e-12)


def test_rollout_gate_predicts_responses_past_the_recent_sample_from_the_prior():
    # two needed responses at 60 tokens on one primary; every recent response finished by 55 (the longer ones
    # were still generating when the sample was taken), the prior reaches 100: 2 × (100 − 60) tokens / 10 = 8 s
    # left, not the 2 × 1 token / 10 = 0.2 s of a response taken to be one token from done
    long = gates.GroupWork(0, "p0", 0, (60, 60), (False, False), True, (0, 0))
    g = gates.rollout_gate([long], ["p0"], 1, 0, tokens, np.full(8, 55.0), SwitchCosts(0.0, 0.0),
                           prior=np.full(8, 100.0))
    assert g.t_primary == pytest.approx(8.0)


def tokens(context, remaining, prefill):
    """A replica decodes 10 tokens per second (per request, summed) and prefills 100 context tokens per second."""
    return float(np.sum(remaining)) / 10 + float(np.sum(np.asarray(context)[np.asarray(prefill, bool)])) / 100


def fresh(gid, worker, needed=True, size=2):
    return gates.GroupWork(gid, worker, 0, (0,) * size, (False,) * size, needed, (0, -gid))


SAMPLE = np.full(64, 50.0)       # every response is 50 tokens long


def test_rollout_gate_is_eq3_for_fresh_groups_without_other_load():
    # 4 needed groups on 2 primaries: T_no = 2 groups × 2 × 50 tokens / 10 = 20 s; Eq. 4 moves 2 of them to the
    # 2 auxiliaries (10 s each), the primaries keep one each (10 s): T_joint = 10 s = M_r(4, 4)
    groups = [fresh(0, "p0"), fresh(1, "p1"), fresh(2, "p0"), fresh(3, "p1")]
    g = gates.rollout_gate(groups, ["p0", "p1"], 2, gates.rollout_dispatch(4, 2, 2), tokens, SAMPLE,
                           SwitchCosts(0.0, 0.5))
    assert g.t_primary == pytest.approx(20.0) and g.t_joint == pytest.approx(10.0) and g.q_a == 2
    assert g.gain == pytest.approx(10.0) and g.cost == 0.5 and g.admitted


def test_rollout_gate_charges_run_ahead_load_up_to_the_last_needed_token_and_drains_during_c_in():
    # each primary carries one needed group and three run-ahead groups that share its iterations while the
    # needed one runs: T_no = (100 + 3 × 100 capped tokens) / 10 = 40 s
    groups = [fresh(0, "p0"), fresh(1, "p1")] + [fresh(g, "p0" if g % 2 else "p1", needed=False) for g in range(2, 8)]
    costs = SwitchCosts(c_in=4.0, c_out=1.0)
    g = gates.rollout_gate(groups, ["p0", "p1"], 2, 1, tokens, SAMPLE, costs)
    assert g.t_primary == pytest.approx(40.0)
    # one needed group (the latest admitted) moves: 10 s on an auxiliary, but the other primary still runs its
    # needed group beside its load, 40 s from now through both switches: past the switch pair the batch waits
    # 40 − 5 s, so the window's wait, C_in + T_joint + C_out, is T_no's 40 s: nothing gained
    assert g.t_joint == pytest.approx(40.0 - 5.0) and g.gain == pytest.approx(costs.c_in + costs.c_out)
    # the opportunistic ablation borrows anyway
    assert gates.rollout_gate(groups, ["p0", "p1"], 2, 1, tokens, SAMPLE, costs, gated=False).admitted
    # both needed groups move (one per auxiliary, 10 s each): C_in / T_no = 10 % of that work is done on the
    # primaries before the auxiliaries start, and the primaries keep only run-ahead load the batch does not need
    g = gates.rollout_gate(groups, ["p0", "p1"], 2, 2, tokens, SAMPLE, costs)
    assert g.t_joint == pytest.approx(0.9 * 10.0) and g.gain == pytest.approx(31.0) and g.admitted


def test_rollout_gate_charges_the_switch_out_only_past_the_primaries_own_work():
    # 4 needed groups of 2 × 50 tokens: p0 holds three (T_no = 30 s), p1 one. Eq. 4 moves q_a = 2 — the
    # latest admitted, 3 (p1) and 2 (p0) — so p0 keeps two (20 s) and p1 none; each auxiliary takes one (10 s).
    groups = [fresh(0, "p0"), fresh(1, "p0"), fresh(2, "p0"), fresh(3, "p1")]
    costs = SwitchCosts(c_in=2.0, c_out=6.0)
    g = gates.rollout_gate(groups, ["p0", "p1"], 2, 2, tokens, SAMPLE, costs)
    assert g.t_primary == pytest.approx(30.0)
    # the auxiliaries end at C_in + 10 · (1 − 2/30) = 11.33 s and switch out until 17.33 s while p0 decodes to
    # 20 s: the batch is ready at 20 s, 10 s sooner, i.e. T_joint = 20 − 8 = 12 s past the switch pair, a gain of
    # 18 s against the 8 s charged (the old form, both switches on top of the slowest replica: 8 + 20 · (1 − 2/30)
    # = 26.7 s, saw 3.3 s)
    assert g.t_joint == pytest.approx(20.0 - 8.0) and g.gain == pytest.approx(18.0) and g.admitted


def test_rollout_gate_knows_progress_prefill_and_parked_groups():
    half = gates.GroupWork(0, "p0", 10, (30, 30), (False, False), True, (0, 0))
    done_one = gates.GroupWork(1, "p0", 10, (50, 30), (True, False), True, (0, -1))
    parked = gates.GroupWork(2, None, 10, (40, 40), (False, False), True, (0, -2))
    g = gates.rollout_gate([half, done_one, parked], ["p0", "p1"], 1, 0, tokens, SAMPLE, SwitchCosts(0.0, 0.0))
    # p0 still needs 2 × 20 + 20 tokens = 6 s; the parked group resumes on the idle p1: 2 × 10 tokens after a
    # prefill of its 2 × 50 context tokens = 2 + 1 s
    assert g.t_primary == pytest.approx(6.0)
    g = gates.rollout_gate([parked], ["p0", "p1"], 1, 0, tokens, SAMPLE, SwitchCosts(0.0, 0.0))
    assert g.t_primary == pytest.approx(3.0)
    # nothing the batch waits for: nothing to gain
    assert not gates.rollout_gate([fresh(5, "p0", needed=False)], ["p0"], 1, 1, tokens, SAMPLE,
                                  SwitchCosts(0.0, 0.0)).admitted


def test_chunk_runs_never_cross_a_stage_and_respect_the_size():
    stages = ["a"] * 5 + ["b"] * 3
    assert gates.chunk_runs(stages, 2) == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
    assert gates.chunk_runs([], 4) == []


def run_time(first, end, d):
    """0.1 s per unit on one replica."""
    return 0.1 * (end - first) / d


def test_workload_time_and_drain_prefix():
    stages = ["old_logprob"] * 8 + ["actor_update"] * 8
    total, drained, _ = gates.workload_time(stages, run_time, d=2, micro_batch_per_device=2)
    assert total == pytest.approx(0.8) and drained == 0
    # DrainPrefix: chunks of 4 units take 0.2 s on 2 replicas, so one finishes within 0.25 s, two within 0.41 s
    # drained_at: when the last drained chunk ends, 0.2 and 0.4 s (sums of two float products below 1: 1e-12)
    total, drained, at = gates.workload_time(stages, run_time, d=2, micro_batch_per_device=2, drain=0.25)
    assert drained == 4 and at == pytest.approx(0.2, abs=1e-12)
    _, drained, at = gates.workload_time(stages, run_time, d=2, micro_batch_per_device=2, drain=0.41)
    assert drained == 8 and at == pytest.approx(0.4, abs=1e-12)
    # nothing drains: the start of the first chunk, less what has run of it
    assert gates.workload_time(stages, run_time, d=2, micro_batch_per_device=2, drain=0.1, ran=0.05).drained_at \
        == -0.05


def test_trainer_gate_is_algorithm_2():
    stages = ["old_logprob"] * 8 + ["actor_update"] * 8
    costs = SwitchCosts(c_in=0.2, c_out=0.1, c_grad=0.05)
    g = gates.trainer_gate(stages, run_time, d_p=2, d_a=2, micro_batch_per_device=2, costs=costs)
    # T_no = 0.8; DrainPrefix(C_in = 0.2) removes one chunk of 4 units; T_joint = 12 units on 4 replicas = 0.3
    assert g.t_no == pytest.approx(0.8) and g.drained == 4 and g.t_joint == pytest.approx(0.3)
    assert g.t_borrow == pytest.approx(0.2 + 0.3 + 0.1 + 0.05) and g.admitted
    assert g.gain == pytest.approx(0.5) and g.cost == pytest.approx(0.35)


def test_trainer_gate_leaves_out_what_the_running_chunk_has_run():
    stages = ["old_logprob"] * 8 + ["actor_update"] * 8
    costs = SwitchCosts(c_in=0.1, c_out=0.1, c_grad=0.05)
    fresh = gates.trainer_gate(stages, run_time, d_p=2, d_a=2, micro_batch_per_device=2, costs=costs)
    # nothing started: T_no = 0.8 and no 0.2 s chunk ends within C_in = 0.1
    assert fresh.t_no == pytest.approx(0.8, abs=1e-12) and fresh.drained == 0
    # 0.15 s into the first chunk: T_no is 0.8 − 0.15, and that chunk ends 0.05 s from now, within C_in, so
    # DrainPrefix takes it; the primaries then run 0.05 s of the next chunk before C_in ends, which the joint
    # workload (12 units on 4 replicas, 0.3 s) no longer holds: 0.3 − 0.05·2/4. Sums of a few decimals: 1e-12
    run = gates.trainer_gate(stages, run_time, d_p=2, d_a=2, micro_batch_per_device=2, costs=costs, ran=0.15)
    assert run.t_no == pytest.approx(0.65, abs=1e-12) and run.drained == 4
    assert run.t_joint == pytest.approx(0.275, abs=1e-12)
    assert run.t_borrow == pytest.approx(0.1 + 0.275 + 0.1 + 0.05, abs=1e-12)


def test_trainer_gate_credits_the_primaries_part_of_the_chunk_they_run_when_c_in_ends():
    """The fluid reading of DrainPrefix: what the primaries have done by the end of C_in is done, whole chunks or
    not; the rest is shared by d_p + d_a replicas."""
    stages = ["actor_update"] * 16
    # C_in = 0.25: one 0.2 s chunk drains, then 0.05 s of the next: T_joint = 12 units on 4 replicas (0.3 s)
    # less 0.05·2/4. Sums of a few decimals: 1e-12
    g = gates.trainer_gate(stages, run_time, 2, 2, 2, SwitchCosts(c_in=0.25, c_out=0.1, c_grad=0.05))
    assert g.drained == 4 and g.t_joint == pytest.approx(0.3 - 0.025, abs=1e-12)
    # 0.05 s into a chunk that does not end within C_in = 0.1: nothing drains, and the primaries have run 0.15 s of
    # it when C_in ends. Fluid check: 0.75 primary-seconds left from now, 0.65 after C_in, over 4 replicas
    # instead of 2: 0.325 = 0.4 (16 units on 4 replicas) − 0.15·2/4
    g = gates.trainer_gate(stages, run_time, 2, 2, 2, SwitchCosts(c_in=0.1, c_out=0.1, c_grad=0.05), ran=0.05)
    assert g.drained == 0 and g.t_no == pytest.approx(0.75, abs=1e-12)
    assert g.t_joint == pytest.approx(0.325, abs=1e-12)


def test_trainer_gate_charges_c_grad_only_for_update_work_and_rejects_short_windows():
    costs = SwitchCosts(c_in=0.0, c_out=0.0, c_grad=10.0)
    forward_only = gates.trainer_gate(["old_logprob"] * 8, run_time, 2, 2, 2, costs)
    assert forward_only.cost == 0.0 and forward_only.admitted
    with_update = gates.trainer_gate(["actor_update"] * 8, run_time, 2, 2, 2, costs)
    assert with_update.cost == 10.0 and not with_update.admitted
    assert gates.trainer_gate(["actor_update"] * 8, run_time, 2, 2, 2, costs, gated=False).admitted


def test_trainer_gate_charges_the_switch_back_the_tail_split_leaves_on_the_step():
    """JointTailSplit gives the auxiliaries L = C_out − (C_grad + optimizer) seconds less than the primaries, so the
    switch back overlaps the primaries' longer share and only d_a·L/(d_p + d_a) of it reaches the step (§5.2)."""
    stages = ["actor_update"] * 16
    costs = SwitchCosts(c_in=0.2, c_out=0.5, c_grad=0.05)
    g = gates.trainer_gate(stages, run_time, d_p=2, d_a=2, micro_batch_per_device=2, costs=costs, optimizer=0.05)
    # T_no = 16 units · 0.1 s / 2 replicas = 0.8; DrainPrefix(0.2) takes one 4-unit chunk (0.2 s on 2 replicas);
    # T_joint = 12 units · 0.1 s / 4 replicas = 0.3. g = 0.05 + 0.05 = 0.1, L = 0.5 − 0.1 = 0.4: the auxiliaries
    # run 0.3 − 2·0.4/4 = 0.1 s and switch back until 0.6, the primaries run 0.5 s, merge and step until 0.6.
    # T_borrow = C_in + 0.6 − optimizer = 0.2 + 0.6 − 0.05 = 0.75 < 0.8: admitted. (Charging the whole lag after
    # T_joint, max(C_out, g) − optimizer = 0.45, gave 0.95 and refused it.) Sums of a few decimals: 1e-12.
    assert g.t_no == pytest.approx(0.8, abs=1e-12) and g.t_joint == pytest.approx(0.3, abs=1e-12)
    assert g.t_borrow == pytest.approx(0.75, abs=1e-12) and g.admitted
    assert g.cost == pytest.approx(0.2 + 0.05 + 2 * 0.4 / 4, abs=1e-12)
    # a switch back the merge and optimizer step hide: only C_grad follows T_joint
    hidden = gates.trainer_gate(stages, run_time, 2, 2, 2, SwitchCosts(c_in=0.2, c_out=0.08, c_grad=0.05),
                                optimizer=0.05)
    assert hidden.t_borrow == pytest.approx(0.2 + 0.3 + 0.05, abs=1e-12)
    # a lag too long for the auxiliaries to get any work (2·0.9/4 = 0.45 > T_joint = 0.3): the primaries run the
    # joint workload alone, 12 units in 0.6 s, then g: max(0.6 + 0.1, 1.0) − 0.05 = 0.95; T_borrow 1.15, refused
    alone = gates.trainer_gate(stages, run_time, 2, 2, 2, SwitchCosts(c_in=0.2, c_out=1.0, c_grad=0.05),
                               optimizer=0.05)
    assert alone.t_borrow == pytest.approx(0.2 + 0.95, abs=1e-12) and not alone.admitted


@given(t_joint=st.floats(0.0, 50.0), d_p=st.integers(1, 32), d_a=st.integers(1, 32), c_out=st.floats(0.0, 20.0),
       c_grad=st.floats(0.0, 5.0), optimizer=st.floats(0.0, 5.0))
def test_window_tail_is_the_best_split_of_the_joint_workload(t_joint, d_p, d_a, c_out, c_grad, optimizer):
    """With C_out ≥ C_grad + optimizer, T_joint + window_tail + optimizer is the least max(x_p + g, x_a + C_out)
    over every split d_p·x_p + d_a·x_a = (d_p + d_a)·T_joint, x ≥ 0, and a split reaches it; below that the
    runtime splits evenly (JointTailSplit's lag is max(0, C_out − g)) and C_grad follows."""
    g = c_grad + optimizer
    tail = gates.window_tail(t_joint, d_p, d_a, c_out, c_grad, optimizer)
    if c_out < g:
        assert tail == c_grad
        return
    work = (d_p + d_a) * t_joint

    def end(x_a):
        return max((work - d_a * x_a) / d_p + g, x_a + c_out)

    value = t_joint + tail + optimizer
    # values ≤ 50·64 + 30: a few float operations each round by well under 1e-9
    assert all(value <= end(x) + 1e-9 for x in np.linspace(0.0, work / d_a, 257))
    best = min(max(t_joint - d_p * (c_out - g) / (d_p + d_a), 0.0), work / d_a)
    assert value == pytest.approx(end(best), abs=1e-9)


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
