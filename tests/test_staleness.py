"""The staleness rule and the rollout buffer (paper §2.2; bidirl.core.staleness)."""


import pytest
from hypothesis import given, settings, strategies as st

from bidirl.core.buffer import RolloutBuffer
from bidirl.core.protocol import GroupState
from bidirl.core.staleness import StalenessRule, check_batch


def test_admission_cap_matches_verl_and_areal():
    # s = 0: one batch per version; s = 0.5: half a batch of run-ahead; s = 2: AReaL's (2 + v + 1)·B
    assert StalenessRule(0, 8).admission_cap(0) == 8
    assert StalenessRule(0, 8).admission_cap(3) == 32
    assert StalenessRule(0.5, 8).admission_cap(0) == 12
    assert StalenessRule(2, 8).admission_cap(1) == 32
    assert StalenessRule(0.25, 10).stale_allowance == 2
    assert StalenessRule(1.5, 10).max_lag == 2


def test_check_batch_rejects_each_violation():
    rule = StalenessRule(0.5, 4)
    check_batch(rule, [3, 3, 2, 2], 3)                    # two stale, allowance 2
    with pytest.raises(AssertionError, match="allowance"):
        check_batch(rule, [3, 2, 2, 2], 3)
    with pytest.raises(AssertionError, match="exceeds"):
        check_batch(rule, [3, 3, 3, 1], 3)
    with pytest.raises(AssertionError, match="newer"):
        check_batch(rule, [4, 3, 3, 3], 3)
    with pytest.raises(AssertionError, match="expected 4"):
        check_batch(rule, [3, 3, 3], 3)


def test_invalid_rule_arguments():
    with pytest.raises(ValueError, match="staleness"):
        StalenessRule(-1, 4)
    with pytest.raises(ValueError, match="batch"):
        StalenessRule(1, 0)


def _state(gid, version, n=2):
    return GroupState(gid, 10, (5,) * n, (True,) * n, version)


@settings(max_examples=150)
@given(staleness=st.sampled_from([0, 0.25, 0.5, 1, 1.5, 2, 4]), batch=st.integers(1, 6),
       data=st.data())
def test_any_completion_order_keeps_the_rule_and_loses_nothing(staleness, batch, data):
    """Admit under the cap, complete groups in an arbitrary order, consume whenever a batch forms:
    every batch satisfies the rule and every admitted group is consumed exactly once or still live."""
    rule = StalenessRule(staleness, batch)
    buf = RolloutBuffer(rule)
    version = 0
    consumed = []
    for _ in range(40):
        for _ in range(buf.admissible(version)):
            buf.admit(version, "w")
        running = [g for g, r in buf.groups.items() if r.status == "running"]
        if running:
            # the must-consume groups finish first sometimes, last sometimes: any order is allowed
            gid = data.draw(st.sampled_from(sorted(running)))
            buf.commit(_state(gid, buf.groups[gid].version))
        batch_ids = buf.select_batch(version)
        if batch_ids is not None:
            versions = [buf.groups[g].version for g in batch_ids]
            check_batch(rule, versions, version)
            buf.consume(batch_ids)
            consumed += batch_ids
            version += 1
    assert len(consumed) == len(set(consumed))
    live = set(buf.groups)
    assert set(consumed) | live == set(range(buf.next_group_id))
    assert not set(consumed) & live


def test_deficit_counts_missing_groups_and_must_consume_stragglers():
    rule = StalenessRule(1, 3)
    buf = RolloutBuffer(rule)
    ids = [buf.admit(0, "w") for _ in range(6)]
    assert buf.deficit(0) == 3
    for g in ids[:2]:
        buf.commit(_state(g, 0))
    assert buf.deficit(0) == 1
    buf.commit(_state(ids[2], 0))
    assert buf.select_batch(0) == ids[:3]
    buf.consume(ids[:3])
    # at version 1 the old groups (v=0) are "must" for max_lag 1: all three of ids[3:] are needed
    assert buf.deficit(1) == 3
    buf.commit(_state(ids[3], 0))
    assert buf.select_batch(1) is None


def test_duplicate_commit_is_counted_not_stored_twice():
    buf = RolloutBuffer(StalenessRule(1, 1))
    g = buf.admit(0, "w")
    assert buf.commit(_state(g, 0))
    assert not buf.commit(_state(g, 0))
    assert buf.duplicates == 1
    buf.consume([g])
    assert not buf.commit(_state(g, 0))
    assert buf.duplicates == 2


def test_parked_group_keeps_its_oldest_version_and_resumes():
    buf = RolloutBuffer(StalenessRule(2, 2))
    g = buf.admit(0, "a")
    partial = GroupState(g, 10, (3, 7), (False, True), 0)
    buf.park(partial)
    assert buf.partial_ids() == [g]
    assert buf.resume(g, "b") is partial
    assert buf.groups[g].worker == "b" and buf.groups[g].status == "running"
    with pytest.raises(ValueError, match="never admitted"):
        buf.commit(_state(99, 0))


@settings(max_examples=150)
@given(staleness=st.sampled_from([0, 0.25, 0.5, 1, 1.5, 2, 4]), local=st.integers(1, 3), updates=st.integers(1, 4),
       data=st.data())
def test_streamed_local_batches_keep_the_rule_and_lose_nothing(staleness, local, updates, data):
    """Streaming consumption (rl.updates_per_sync): each version's batch is taken as ``updates`` local batches of
    ``local`` groups, each as soon as the look-ahead accepts it with the step's remaining room; the union of a
    version's local batches satisfies the rule as a whole batch, and nothing is lost or consumed twice."""
    batch = local * updates
    rule = StalenessRule(staleness, batch)
    buf = RolloutBuffer(rule)
    version, taken, step_versions, consumed = 0, 0, [], []
    for _ in range(60):
        for _ in range(buf.admissible(version)):
            buf.admit(version, "w")
        running = [g for g, r in buf.groups.items() if r.status == "running"]
        if running:
            gid = data.draw(st.sampled_from(sorted(running)))
            buf.commit(_state(gid, buf.groups[gid].version))
        ids = buf.select_batch(version, size=local, room=batch - taken - local)
        if ids is not None:
            step_versions += [buf.groups[g].version for g in ids]
            buf.consume(ids)
            consumed += ids
            taken += local
            if taken == batch:
                check_batch(rule, step_versions, version)
                version, taken, step_versions = version + 1, 0, []
    assert len(consumed) == len(set(consumed))
    live = set(buf.groups)
    assert set(consumed) | live == set(range(buf.next_group_id))


def test_the_lookahead_batch_waits_for_the_groups_expected_to_end_first_not_the_oldest():
    rule = StalenessRule(1, 3)
    buf = RolloutBuffer(rule)
    for _ in range(6):
        buf.admit(0, "w")
    # at s = 1 any three of the six groups of version 0 complete its batch (the other three can still go into the
    # next one): it waits for the three expected to end first, where a batch of the oldest waits for 0, 1 and 2
    ends_first = {5: 0, 4: 1, 3: 2, 2: 3, 1: 4, 0: 5}
    waited, unadmitted = buf.waited_for(0, lambda r: ends_first[r.group_id])
    assert sorted(r.group_id for r in waited) == [3, 4, 5] and unadmitted == 0
    assert [r.group_id for r in buf.needed()] == [0, 1, 2] and buf.deficit(0) == 3
    for g in (3, 4, 5):
        buf.commit(_state(g, 0))
    assert buf.select_batch(0) == [3, 4, 5]
    buf.consume([3, 4, 5])
    for _ in range(buf.admissible(1)):
        buf.admit(1, "w")
    # at version 1 the three groups of version 0 left are too stale for the next batch: it waits for all three,
    # however soon the newer ones are expected to end
    waited, unadmitted = buf.waited_for(1, lambda r: -r.group_id)
    assert sorted(r.group_id for r in waited) == [0, 1, 2] and unadmitted == 0


def test_the_lookahead_wait_counts_groups_not_admitted_yet():
    buf = RolloutBuffer(StalenessRule(0, 3))
    buf.admit(0, "w")
    buf.admit(0, "w")
    waited, unadmitted = buf.waited_for(0, lambda r: 0)
    assert sorted(r.group_id for r in waited) == [0, 1] and unadmitted == 1
    # a streamed step's local batch of 1 group, with room for 2 more of this version: either group completes it
    waited, unadmitted = buf.waited_for(0, lambda r: -r.group_id, size=1, room=2)
    assert [r.group_id for r in waited] == [1] and unadmitted == 0


@settings(max_examples=150)
@given(staleness=st.sampled_from([0, 0.25, 0.5, 1, 1.5, 2, 4]), batch=st.integers(1, 6), data=st.data())
def test_completing_the_groups_the_lookahead_batch_waits_for_forms_it(staleness, batch, data):
    """Whatever the state and the expected finishing order, once every group :meth:`RolloutBuffer.waited_for`
    names is complete (and nothing else changed) the look-ahead batch forms: the wait it predicts is enough."""
    import copy
    rule = StalenessRule(staleness, batch)
    buf = RolloutBuffer(rule)
    version = 0
    for _ in range(data.draw(st.integers(1, 25))):
        for _ in range(buf.admissible(version)):
            buf.admit(version, "w")
        running = sorted(g for g, r in buf.groups.items() if r.status == "running")
        if running:
            gid = data.draw(st.sampled_from(running))
            buf.commit(_state(gid, buf.groups[gid].version))
        batch_ids = buf.select_batch(version)
        if batch_ids is not None:
            buf.consume(batch_ids)
            version += 1
    for _ in range(buf.admissible(version)):
        buf.admit(version, "w")
    order = data.draw(st.permutations(sorted(buf.groups)))
    rank = {g: i for i, g in enumerate(order)}
    waited, unadmitted = buf.waited_for(version, lambda r: rank[r.group_id])
    assert unadmitted == 0                       # everything the run-ahead bound allows is admitted
    done = copy.deepcopy(buf)
    for r in waited:
        done.commit(_state(r.group_id, r.version))
    assert done.select_batch(version) is not None
