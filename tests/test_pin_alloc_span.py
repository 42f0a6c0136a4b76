"""The first switch's pinned-allocation span (``pin_alloc``) shows only what is left of the allocation (issue 38).

A trainer engine reserves its pinned host buffer on a background thread once it is loaded, so the first switch that
offloads it waits for ``max(0, allocation − time since load)``, not the whole allocation
(``Driver.pin_left``; the allocation itself: ``perf.costs.first_switch_allocation``).
"""

import pytest

from bidirl.job import config as cfgmod
from bidirl.perf import costs
from bidirl.sim.driver import SimDriver

BASE = {
    "model": "qwen3-vl-2b", "hardware": "a6000",
    "cluster": {"gpus": 8, "gpus_per_node": 8, "placement": "any", "partition": [4, 4]},
    "workload": {"dataset": "geo3k", "prompts_per_step": 8, "group_size": 4, "max_response_len": 512, "steps": 5},
    "rl": {"staleness": 0, "micro_batch_per_device": 2},
    "scheduler": {"policy": "bidirl"},
}
#: span times a few hundred seconds into a run: ``start + left − start`` loses at most a few ulps of ``start``
#: (≈ 1e-13 s at start < 1e3 s); 1e-9 s is far above that and far below the allocations checked (≥ 1 s here)
EXACT = 1e-9


def test_what_is_left_is_the_allocation_less_the_time_since_load():
    d = SimDriver(cfgmod.load("tiny-cpu"), "bidirl", steps=1, seed=0)
    assert d.loaded_at == 0.0                                    # a fresh run's engines are loaded at its start
    assert d.pin_left(10.0, 3.0) == 7.0
    assert d.pin_left(10.0, 10.0) == 0.0 and d.pin_left(10.0, 25.0) == 0.0
    d.loaded_at = 5.0                                            # a resumed run's workers start at its boundary
    assert d.pin_left(10.0, 8.0) == 7.0 and d.pin_left(10.0, 2.0) == 10.0


def test_a_first_switch_shows_only_what_is_left_of_the_background_allocation():
    cfg = cfgmod.from_dict(BASE)
    driver = SimDriver(cfg, "opportunistic", steps=4, seed=0, jitter=0.0)
    log = driver.run().log
    rho = driver.plan.envelope.trainer_layout
    first = {}
    for s in sorted((s for s in log.spans if s.kind in ("switch_in", "switch_out")), key=lambda s: s.start):
        first.setdefault((s.detail["direction"], s.kind[len("switch_"):]), s)
    drawn = {(s.detail["direction"], s.detail["phase"]): s for s in log.spans if s.kind == "pin_alloc"}
    shown = hidden = 0
    for (direction, phase), switch in first.items():
        alloc = costs.first_switch_allocation(cfg.hardware_spec, cfg.model_spec, direction, phase, trainer_layout=rho)
        left = max(0.0, alloc - switch.start)
        if left > 0:
            s = drawn[(direction, phase)]
            assert s.start == switch.start and s.detail["allocation"] == alloc
            assert s.detail["seconds"] == pytest.approx(left, abs=EXACT)
            assert s.end - s.start == pytest.approx(min(left, switch.end - switch.start), abs=EXACT)
            shown += 1
        else:
            assert (direction, phase) not in drawn, "the allocation was over before the switch began"
            hidden += alloc > 0
    assert set(drawn) <= set(first)
    # both cases occur in this run: a switch right at the start waits for the allocation (the Rollouter-on-
    # TrainerPool switch in at t = 0), and one long after load waits for none of it — where drawing the whole
    # allocation, the defect this guards, would show a span
    assert shown >= 1 and hidden >= 1, (shown, hidden, {k: v.start for k, v in first.items()})
