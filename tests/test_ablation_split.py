"""How the borrowed trainer window's work is split (§5.2 Algorithm 2, §7.3 "Ablation variants"), in simulated runs
of the paper's ablation settings: BiDiRL's TailWindow reclaims queued chunks for JointTailSplit, the opportunistic
variant splits each segment once by data-parallel capacity."""

import collections
import dataclasses

from bidirl.core.policies import get_policy
from bidirl.experiments import specs
from bidirl.sim import SimDriver


def _run(panel, point, policy, steps):
    cfg = specs.get(panel).config(point)
    return cfg, SimDriver(cfg, policy, steps, 0).run()


def _update_chunks(result, step):
    sp = result.log.spans_df()
    ch = sp[(sp.kind == "chunk") & (sp.step == step)]
    return ch[[d["stage"] == "actor_update" for d in ch.detail]]


def _end_idle(chunks):
    """Seconds the primary gang idles at the end of the update segment while the borrowed pool still runs."""
    p = chunks[chunks.pool == "trainer_pool"]
    a = chunks[chunks.pool == "rollout_pool"]
    return max(0.0, float(a.end.max()) - float(p.end.max())) if len(a) else 0.0


def test_the_tail_reclaim_takes_back_the_slow_gangs_queued_cell():
    # the ablation's 4-12 split at s = 0: the reproducible mode cuts the update into cells of the primary gang
    # (3 replicas), so a cell takes the 1-replica auxiliary gang 3x as long; lazy pull keeps one queued behind the
    # running one (chunks_in_flight = 2)
    bidirl = get_policy("bidirl")
    _, without = _run("abl-staleness", "s=0", dataclasses.replace(bidirl, tail_reclaim=False), 2)
    _, with_ = _run("abl-staleness", "s=0", bidirl, 2)
    old, new = _update_chunks(without, 0), _update_chunks(with_, 0)
    p_chunk = float((old[old.pool == "trainer_pool"].end - old[old.pool == "trainer_pool"].start).mean())
    # the defect: without the reclaim the primaries wait longer than one of their own chunks for the auxiliary
    # gang's queued cell, which they could have run
    assert _end_idle(old) > p_chunk
    # the reclaim gives the queued cell(s) to the primaries: whole cells move, the end-of-segment wait shrinks and
    # the step ends earlier
    cell = int(old.detail.iloc[0]["samples"])
    moved = sum(d["samples"] for d in old[old.pool == "rollout_pool"].detail) - \
        sum(d["samples"] for d in new[new.pool == "rollout_pool"].detail)
    assert moved > 0 and moved % cell == 0
    assert _end_idle(new) < _end_idle(old)
    end = lambda r: float(r.log.steps_df().set_index("step").end[0])  # noqa: E731
    assert end(with_) < end(without)


def test_the_opportunistic_variant_splits_each_segment_by_data_parallel_capacity():
    # "one-shot DP-proportional assignment" (§7.3): every segment the window reaches, the update included, is split
    # round(n · d_a / (d_p + d_a)) when it opens; both pools hold replicas of the same size, so d_a / (d_p + d_a) is
    # the borrowed pool's share of the GPUs
    for panel, point in (("abl-model", "8B/GSM8K"), ("abl-response", "2K")):
        cfg, run = _run(panel, point, "opportunistic", 3)
        share = cfg.cluster.partition.rollout / cfg.cluster.gpus
        seen = 0
        for step in range(3):
            ch = _update_chunks(run, step)
            per_pool = collections.Counter()
            for pool, d in zip(ch.pool, ch.detail):
                per_pool[pool] += d["samples"]
            if per_pool["rollout_pool"]:
                n = sum(per_pool.values())
                assert per_pool["rollout_pool"] == round(n * share), (panel, step, dict(per_pool))
                seen += 1
        assert seen, f"{panel} {point}: no window reached the update segment"
