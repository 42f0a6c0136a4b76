"""Decode progress replayed over the load each rollouter had (bidirl.core.progress), and the coordinator's use of it
for the Rollouter-on-TrainerPool gate's inputs."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bidirl.core import protocol as P
from bidirl.core.coordinator import Coordinator, Settings, Topology
from bidirl.core.policies import get_policy
from bidirl.core.profiler import Profiler
from bidirl.core.progress import DecodeProgress, ResponseEnds

R0, R1 = P.rollouter(P.ROLLOUT_POOL, 0), P.rollouter(P.ROLLOUT_POOL, 1)


def per_request(contexts):
    """10 ms an iteration per running request, whatever their contexts (so every count below is exact)."""
    return 0.01 * len(contexts)


def no_prefill(contexts):
    return 0.0


def test_progress_is_integrated_over_the_heavier_load_the_worker_had():
    # 40 one-request groups share the worker for 10 s, then 39 leave: 10 s at 0.40 s an iteration (25) and 10 s at
    # 0.01 s (1,000). Timed on the present load alone, as before, the 20 s would read 2,000 iterations.
    d = DecodeProgress()
    d.join(R0, 0.0, [(g, 100, (0,)) for g in range(40)])
    d.leave(R0, 10.0, range(1, 40))
    got = d.iterations(R0, 20.0, per_request, no_prefill)
    assert set(got) == {0}
    # 10/0.4 + 10/0.01 in floating point: within 1e-9 of 1,025 (a few ulps of each quotient)
    assert got[0] == pytest.approx(1025.0, abs=1e-9)


def test_a_group_counts_only_the_iterations_since_it_joined_and_waits_for_its_prefill_wave():
    # group 0 alone 0-5 s (500 iterations at 0.01 s); group 1 joins at 5 s with a 1 s prefill wave (nothing decodes
    # meanwhile, 5-6 s), then both decode at 0.02 s an iteration until 9 s: 150 more
    d = DecodeProgress()
    d.join(R0, 0.0, [(0, 10, (0,))])
    prefill = {(10,): 0.0, (20,): 1.0}
    got = d.join(R0, 5.0, [(1, 10, (10,))]) or d.iterations(R0, 9.0, per_request, lambda c: prefill[tuple(c)])
    assert got[0] == pytest.approx(650.0, abs=1e-9)
    assert got[1] == pytest.approx(150.0, abs=1e-9)


def test_iterations_slow_down_as_contexts_grow():
    # the i-th iteration costs a + b·i with a = 1 ms·(1 + 1,000 tokens/1,000) = 2 ms and b = 1 µs: k iterations take
    # 0.002·k + 0.000001·k(k−1)/2 seconds; k = 1,000 takes 2 + 0.4995 = 2.4995 s
    d = DecodeProgress()
    d.join(R0, 0.0, [(0, 1000, (0,))])
    got = d.iterations(R0, 2.4995, lambda c: 0.001 * (1 + sum(c) / 1000), no_prefill)
    assert got[0] == pytest.approx(1000.0, abs=1e-6)      # a quadratic root: well inside a millionth of a token


def test_a_response_leaves_the_load_at_its_end():
    # two requests at 0.01 s each (0.02 s an iteration) until the first ends at 100 tokens (2 s), then one alone
    d = DecodeProgress()
    d.join(R0, 0.0, [(0, 10, (0, 0))])
    got = d.iterations(R0, 4.0, per_request, no_prefill, lengths=lambda held: (100.0, math.inf))
    assert got[0] == pytest.approx(100.0 + 2.0 / 0.01, abs=1e-9)


def test_an_idle_worker_forgets_its_past_and_unknown_leaves_are_ignored():
    d = DecodeProgress()
    d.join(R0, 0.0, [(0, 10, (0,))])
    d.leave(R0, 1.0, [7])               # never there: a late or duplicate report
    assert len(d.changes[R0]) == 1
    d.leave(R0, 2.0, [0])
    assert R0 not in d.changes and R0 not in d.running
    assert d.iterations(R0, 3.0, per_request, no_prefill) == {}


def test_response_ends_deal_the_conditional_quantiles():
    sample = np.arange(1, 101)                      # 1 … 100
    ends = ResponseEnds(sample, np.array([500.0]))
    # four fresh responses: the 1/8, 3/8, 5/8, 7/8 quantiles of 1 … 100 → indices 12, 37, 62, 87
    assert ends((0, 0, 0, 0)) == (13.0, 38.0, 63.0, 88.0)
    # past every recent length: the prior's; past the prior too: no end before the group leaves
    assert ends((150, 600)) == (500.0, math.inf)
    # the one holding the fewest tokens is dealt the lowest quantile of what lies above it: 50 → the 1/4 quantile of
    # 51 … 100 (index 12: 63), 90 → the 3/4 quantile of 91 … 100 (index 7: 98)
    assert ends((90, 50)) == (98.0, 63.0)


# ---------------------------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------------------------

changes = st.lists(st.tuples(st.floats(0.01, 5.0), st.booleans(), st.integers(1, 6)), min_size=1, max_size=12)


def replay(script):
    """Group 0 (one request) joins at 0; then each step, after ``dt``, one more group of ``n`` requests joins or the
    latest-joined other group leaves. Returns the ledger, the end time and every set size group 0 ran beside."""
    d = DecodeProgress()
    d.join(R0, 0.0, [(0, 50, (0,))])
    t, others, sizes, next_id = 0.0, [], [1], 1
    for dt, join, n in script:
        t += dt
        if join or not others:
            d.join(R0, t, [(next_id, 50, (0,) * n)])
            others.append((next_id, n))
            next_id += 1
        else:
            gid, _ = others.pop()
            d.leave(R0, t, [gid])
        sizes.append(1 + sum(n for _, n in others))
    return d, t, sizes


@settings(max_examples=60, deadline=None)
@given(changes, st.floats(0.0, 5.0))
def test_progress_lies_between_the_slowest_and_the_fastest_load_it_ran_beside(script, extra):
    d, t, sizes = replay(script)
    now = t + extra
    got = d.iterations(R0, now, per_request, no_prefill)[0]
    # every iteration of group 0 ran beside one of ``sizes`` requests, at 0.01 s a request, never prefilling: the
    # count lies between elapsed / slowest and elapsed / fastest (1e-9 absorbs the sums' rounding)
    assert now / (0.01 * max(sizes)) - 1e-9 <= got <= now / (0.01 * min(sizes)) + 1e-9


@settings(max_examples=60, deadline=None)
@given(changes, st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_progress_never_falls_as_time_passes(script, a, b):
    d, t, _ = replay(script)
    growing = lambda c: 0.001 + 1e-6 * sum(c)                                 # noqa: E731  (contexts cost too)
    prefill = lambda c: 1e-4 * len(c)                                         # noqa: E731
    ends = ResponseEnds(np.arange(1, 400), None)
    early = d.iterations(R0, t + min(a, b), growing, prefill, ends)
    late = d.iterations(R0, t + max(a, b), growing, prefill, ends)
    assert set(early) == set(late)
    # the same replay up to the earlier instant, then more non-negative iterations (1e-9: rounding of the sums)
    assert all(late[g] >= early[g] - 1e-9 for g in early)


# ---------------------------------------------------------------------------------------------------------------
# the coordinator
# ---------------------------------------------------------------------------------------------------------------

class PerRequestPredictor:
    """Rollout: 10 ms an iteration per running request, prefill free; trainer: 1 ms per token per replica."""

    def rollout_time(self, prompt_lens, response_lens, d):
        return 0.01 * float(np.sum(response_lens)) / d

    def replica_time(self, context, remaining, prefill):
        return 0.01 * float(np.sum(remaining))

    def iteration_time(self, context):
        return 0.01 * len(context)

    def chunk_time(self, stage, prompt_lens, response_lens, d):
        return 0.001 * float(np.sum(prompt_lens) + np.sum(response_lens)) / d


def test_the_coordinator_estimates_progress_over_the_load_its_worker_had():
    costs = {d: P.SwitchCosts(0.1, 0.1, 0.05) for d in P.DIRECTIONS}
    settings_ = Settings(batch=4, group_size=2, staleness=0.0, partial_rollout=True,
                         stages=("old_logprob", "actor_update"), micro_batch_per_device=1, tail_window=2, steps=2)
    topology = Topology(rollout_replicas=2, trainer_replicas=2, aux_rollout_replicas=2, aux_trainer_replicas=2)
    # responses of 10,000 tokens: nothing is expected to end within the 1,000 iterations below
    prior = (np.full(64, 10), np.full(64, 10_000))
    c = Coordinator(settings_, topology, get_policy("bidirl"), PerRequestPredictor(), Profiler(costs=costs), prior)
    out = c.handle(P.Started(0.0))
    on = {t.group_id: g.worker for g in out if isinstance(g, P.Generate) for t in g.tasks}
    first, second = sorted(g for g, w in on.items() if w == R0)
    # both groups (4 requests: 0.04 s an iteration) for 10 s, then one (0.02 s) for 10 s: 250 + 500 iterations.
    # Timed on the present load alone the 20 s read 1,000.
    c.handle(P.GroupFinished(10.0, R0, P.GroupState(second, 10, (10_000, 10_000), (True, True), 0)))
    c._now = 20.0
    work = {g.group_id: g for g in c._rollout_work()[0]}
    # int() of a float sum within a few ulps of 750: 749 or 750
    assert work[first].progress[0] in (749, 750) and work[first].progress == (work[first].progress[0],) * 2
    assert not work[first].prefilling


def test_responses_past_their_end_read_as_finished_but_the_group_keeps_its_longest():
    from bidirl.core.rollout_side import _ended
    # three fresh responses: the 1/6, 1/2, 5/6 quantiles of 1 … 100 (indices 16, 50, 83) end at 17, 51 and 84
    ends = ResponseEnds(np.arange(1, 101), None)
    held, done = _ended((0, 0, 0, 40), (False, False, False, True), 60, ends)
    assert held == (17, 51, 60, 40) and done == (True, True, False, True)
    # all three past their ends, but the group has not reported finishing: its longest-ending one still runs
    held, done = _ended((0, 0, 0), (False, False, False), 90, ends)
    assert held == (17, 51, 90) and done == (True, True, False)
