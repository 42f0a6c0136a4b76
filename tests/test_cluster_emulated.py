"""The Ray driver with emulated workers: the real control path on local Ray (integration)."""

import pytest

from bidirl import config as cfgmod, metrics

pytestmark = pytest.mark.integration

SMALL = {
    "model": "qwen3-vl-2b", "hardware": "a6000",
    "cluster": {"gpus": 8, "gpus_per_node": 8, "placement": "any", "partition": [2, 6]},
    "workload": {"dataset": "geo3k", "prompts_per_step": 32, "group_size": 8, "max_response_len": 1024, "steps": 3},
    "rl": {"staleness": 0, "micro_batch_per_device": 2},
    "scheduler": {"policy": "bidirl", "max_chunk": 2},
}


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    import os
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    ray.shutdown()                      # a Ray left running by an earlier module
    ray.init(num_cpus=4, resources={"gpu_slot": 8.0}, include_dashboard=False, log_to_driver=False,
             namespace="bidirl-tests")
    yield ray
    ray.shutdown()


def _exclusive(spans):
    assert metrics.role_conflicts(spans) == []


def test_emulated_run_borrows_both_ways_and_keeps_every_sample(ray_session):
    from bidirl.cluster.driver import RayDriver
    cfg = cfgmod.from_dict(SMALL)
    res = RayDriver(cfg, "bidirl", steps=3, seed=0, emulate=True, time_scale=100).run()
    s = res.summary()
    assert len(s["step_times"]) == 3
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    assert s["samples"]["consumed"] == 3 * 32 * 8
    assert s["borrows"]["rollout_on_trainer_pool"] + s["borrows"]["trainer_on_rollout_pool"] > 0
    assert s["costs"], "switch costs were measured"
    _exclusive(res.log.spans_df())


def test_killing_an_auxiliary_trainer_mid_window_loses_nothing(ray_session):
    from bidirl.cluster.driver import RayDriver
    cfg = cfgmod.from_dict(SMALL).with_overrides({"cluster.partition": [6, 2], "workload.max_response_len": 256})
    killed = []

    def kill(driver):
        c = driver.coordinator
        if not killed and c.owner["rollout_pool"] == "auxiliary" and c.step is not None \
                and c.step.live("auxiliary"):
            ray_session.kill(driver.actors["rollout_pool/trainer"])
            killed.append(len(c.steps))

    res = RayDriver(cfg, "bidirl", steps=3, seed=1, emulate=True, time_scale=100).run(kill=kill)
    s = res.summary()
    assert killed, "the scenario never lent the rollout pool to auxiliary trainers"
    assert len(s["step_times"]) == 3
    assert s["samples"]["lost"] == 0 and s["samples"]["consumed"] == 3 * 32 * 8


def test_a_cluster_without_the_slots_gives_a_clear_error(ray_session):
    from bidirl.cluster.driver import ClusterError, RayDriver
    cfg = cfgmod.from_dict(SMALL).with_overrides({"cluster.gpus": 16, "cluster.partition": [8, 8]})
    with pytest.raises(ClusterError, match="gpu_slot"):
        RayDriver(cfg, "bidirl", steps=1, seed=0).run()
