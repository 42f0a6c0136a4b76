"""Emulated workers refresh an auxiliary trainer gang's weights after each optimizer mini-batch, as the simulator and
engine runs do: every Ray driver refreshes (``PoolDriver.refreshes_aux_weights``), so one coordinator decision
(:mod:`bidirl.core.aux_weights`) says when, and the emulated backend holds the gang for the transfer the scheduler
charged (integration: starts Ray)."""

import copy

import pytest

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.perf.costs import aux_weight_transfer_time
from tests.test_aux_weight_refresh import WatchingAuxWeights
from tests.test_cluster_emulated import SMALL

pytestmark = pytest.mark.integration

#: 32 prompts a step in mini-batches of 8: a forward segment, then four update segments (three optimizer steps
#: keep the version inside each step); the simulator's run of this job works in all four (seeds 0 and 1)
MINI = copy.deepcopy(SMALL)
MINI["rl"]["mini_batch_prompts"] = 8


def _emulated_watching():
    from bidirl.cluster.emulated import EmulatedDriver

    class EmulatedWatching(WatchingAuxWeights, EmulatedDriver):
        """Emulated workers under :class:`WatchingAuxWeights`."""
    return EmulatedWatching


def test_emulated_workers_refresh_an_auxiliary_gang_after_each_mini_batch(ray_session):
    cfg = cfgmod.from_dict(MINI)
    driver = _emulated_watching()(cfg, "bidirl", steps=3, seed=0, time_scale=100)
    res = driver.run()
    s = res.summary()
    assert len(s["step_times"]) == 3 and s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    # the gang worked past the first mini-batch, on the weights of each (the mixin asserted it chunk by chunk): under
    # the earlier rule (no refresh) every auxiliary update chunk ran on the version's own weights (0)
    worked = {since for _, _, since, stage in driver.aux_chunks if stage == "actor_update"}
    assert worked and max(worked) > 0, sorted(worked)
    # each refresh is the transfer the scheduler charged, on the auxiliary gang's lane
    want = aux_weight_transfer_time(cfg.hardware_spec, cfg.model_spec, driver.topology.trainer_layout)
    assert driver.refreshes and {r.expected for r in driver.refreshes} == {want}
    assert {r.worker for r in driver.refreshes} == {P.AUX_TRAINER} and all(r.updates > 0 for r in driver.refreshes)
    spans = res.log.spans_df()
    refreshes = spans[spans.kind == "weight_refresh"]
    assert len(refreshes) == len(driver.refreshes) and set(refreshes.worker) == {P.AUX_TRAINER}
    # a hold of `want` virtual seconds: the actor sleeps want / time_scale wall seconds, and the driver's clock reads
    # the elapsed time back × time_scale, so the span is at least `want` (never shorter: a sleep does not end early)
    assert (refreshes.end - refreshes.start).min() >= want * (1 - 1e-9)

