"""The Ray driver with emulated workers: the real control path on local Ray (integration)."""

import pytest

from bidirl.job import config as cfgmod
from bidirl.results import metrics

pytestmark = pytest.mark.integration

SMALL = {
    "model": "qwen3-vl-2b", "hardware": "a6000",
    "cluster": {"gpus": 8, "gpus_per_node": 8, "placement": "any", "partition": [2, 6]},
    "workload": {"dataset": "geo3k", "prompts_per_step": 32, "group_size": 8, "max_response_len": 1024, "steps": 3},
    "rl": {"staleness": 0, "micro_batch_per_device": 2},
    "scheduler": {"policy": "bidirl"},
}


def _exclusive(spans):
    assert metrics.role_conflicts(spans) == []


def test_emulated_run_borrows_both_ways_and_keeps_every_sample(ray_session):
    from bidirl.cluster.emulated import EmulatedDriver
    cfg = cfgmod.from_dict(SMALL)
    res = EmulatedDriver(cfg, "bidirl", steps=3, seed=0, time_scale=100).run()
    s = res.summary()
    assert len(s["step_times"]) == 3
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    assert s["samples"]["consumed"] == 3 * 32 * 8
    assert s["borrows"]["rollout_on_trainer_pool"] + s["borrows"]["trainer_on_rollout_pool"] > 0
    assert s["costs"], "switch costs were measured"
    _exclusive(res.log.spans_df())
    # what the run is travels with it to its figures
    from bidirl.viz.gantt import TIME_AXIS_TITLES, gantt_figure
    assert res.provenance == s["provenance"] == "emulated"
    assert gantt_figure(res).layout.xaxis.title.text == TIME_AXIS_TITLES["emulated"]


def test_killing_an_auxiliary_trainer_mid_window_loses_nothing(ray_session):
    from bidirl.cluster.emulated import EmulatedDriver
    cfg = cfgmod.from_dict(SMALL).with_overrides({"cluster.partition": [6, 2], "workload.max_response_len": 256})
    killed = []

    def kill(driver):
        if not killed and driver.chunk_running.get("rollout_pool/trainer") is not None:
            ray_session.kill(driver.actors["rollout_pool/trainer"])
            killed.append(driver.steps_done)

    res = EmulatedDriver(cfg, "bidirl", steps=3, seed=1, time_scale=100).run(kill=kill)
    s = res.summary()
    assert killed, "the scenario never lent the rollout pool to auxiliary trainers"
    assert len(s["step_times"]) == 3
    assert s["samples"]["lost"] == 0 and s["samples"]["consumed"] == 3 * 32 * 8


def test_killing_primary_workers_is_recovered_and_the_run_completes(ray_session):
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.core import protocol as P
    cfg = cfgmod.from_dict(SMALL)
    killed = []

    def kill(driver):
        rollouter = P.rollouter(P.ROLLOUT_POOL, 0)
        if not killed and driver.steps_done >= 1 and driver.r_busy.get(rollouter):
            ray_session.kill(driver.actors[rollouter])
            killed.append(rollouter)
        elif len(killed) == 1 and driver.chunk_running.get(P.PRIMARY_TRAINER) is not None:
            ray_session.kill(driver.actors[P.PRIMARY_TRAINER])      # mid-step: the step starts over
            killed.append(P.PRIMARY_TRAINER)

    res = EmulatedDriver(cfg, "bidirl", steps=3, seed=0, time_scale=100).run(kill=kill)
    s = res.summary()
    assert len(killed) == 2, killed
    assert [r["worker"] for r in s["recoveries"]] == killed and res.view.failed == ()
    assert len(s["step_times"]) == 3 and s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    assert s["samples"]["consumed"] == 3 * 32 * 8
    _exclusive(res.log.spans_df())


def test_a_worker_that_keeps_failing_ends_the_run_naming_it(ray_session):
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.cluster.pool import ClusterError
    from bidirl.core import protocol as P
    cfg = cfgmod.from_dict(SMALL)
    rollouter = P.rollouter(P.ROLLOUT_POOL, 0)

    def kill(driver):
        if driver.r_busy.get(rollouter) and rollouter not in driver.failed:
            ray_session.kill(driver.actors[rollouter])

    with pytest.raises(ClusterError, match=r"worker rollout_pool/rollouter/0 failed 2 times: it was restarted 1 "
                                           r"times, the limit \(max_restarts=1\), with no whole step completed "
                                           r"between its failures, so the run stops. Last error: "):
        EmulatedDriver(cfg, "bidirl", steps=3, seed=0, time_scale=100, max_restarts=1).run(kill=kill)


def test_an_emulated_run_resumed_from_a_checkpoint_continues_its_steps_and_log(ray_session, tmp_path):
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.runtime import checkpoints
    cfg = cfgmod.from_dict(SMALL).with_overrides({"workload.steps": 4})
    straight = EmulatedDriver(cfg, "bidirl", steps=4, seed=0, time_scale=100, checkpoint_dir=str(tmp_path / "a"),
                              keep=4).run()
    assert [p.name for p in checkpoints.step_folders(tmp_path / "a")] == [f"step-00000{k}" for k in (1, 2, 3, 4)]
    resumed_driver = EmulatedDriver(cfg, "bidirl", steps=4, seed=0, time_scale=100,
                                    resume=str(tmp_path / "a" / "step-000002"), checkpoint_dir=str(tmp_path / "b"))
    resumed = resumed_driver.run()
    s = resumed.summary()
    assert s["resumed_from"]["step"] == 2 and len(s["step_times"]) == 4
    assert [r.step for r in resumed.log.steps] == [0, 1, 2, 3]
    # the first two steps are the checkpoint's, recorded once; the rest continue the same timeline
    assert resumed.log.steps[:2] == straight.log.steps[:2]
    assert resumed.log.steps[2].start == straight.log.steps[2].start
    assert [sorted(ids) for _, _, ids in resumed.view.batches] == [sorted(ids) for _, _, ids in straight.view.batches]
    assert s["samples"]["consumed"] == 4 * 32 * 8 and s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    _exclusive(resumed.log.spans_df())


def test_a_cluster_without_the_slots_gives_a_clear_error(ray_session):
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.cluster.pool import ClusterError
    cfg = cfgmod.from_dict(SMALL).with_overrides({"cluster.gpus": 16, "cluster.partition": [8, 8]})
    with pytest.raises(ClusterError, match="gpu_slot"):
        EmulatedDriver(cfg, "bidirl", steps=1, seed=0).run()


def _lifecycle(messages) -> list:
    """The run's life as the control plane steered it: steps, switches by pool and phase, merges, syncs."""
    from bidirl.core import protocol as P
    out = []
    for m in messages:
        if isinstance(m, P.Switch):
            out.append(f"Switch {m.pool} {m.phase}")
        elif isinstance(m, (P.StartStep, P.MergeGradients, P.OptimizerStep, P.SyncWeights, P.StepDone, P.RunDone)):
            out.append(type(m).__name__)
    return out


def test_the_simulator_and_emulated_workers_record_the_same_things(ray_session):
    """One control plane, two drivers: the same config, seed and policy give logs with the same lanes, kinds and
    roles, the same life of leases and steps, and utilisation over the same lanes."""
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.perf.costs import first_switch_allocation
    from bidirl.sim.driver import SimDriver
    cfg = cfgmod.from_dict(SMALL)
    sim = SimDriver(cfg, "opportunistic", steps=3, seed=0)
    sim_res = sim.run()
    emu = EmulatedDriver(cfg, "opportunistic", steps=3, seed=0, time_scale=100)
    emu_res = emu.run()

    # what a first switch pays depends on how long after the engines' load it starts (they reserve the pinned buffer
    # in the background): the emulated clock starts at worker placement and runs through Ray's start-up at
    # time_scale virtual s per wall s, so its first window can open after the reservation finished, where the
    # simulator's opens at t = 0 and pays all of it; the pin_alloc span, and the no-work window its length can cause,
    # are timing, not lanes
    timed = {"pin_alloc", "switch_no_work"}

    def lanes(res):
        return {(s.worker, s.kind, s.role) for s in res.log.spans if s.kind not in timed}
    assert lanes(sim_res) == lanes(emu_res)
    for res, driver in ((sim_res, sim), (emu_res, emu)):      # where a span is drawn, it is what was left
        for s in res.log.spans:
            if s.kind == "pin_alloc":
                whole = first_switch_allocation(cfg.hardware_spec, cfg.model_spec, s.detail["direction"],
                                                s.detail["phase"], trainer_layout=driver.plan.envelope.trainer_layout)
                assert 0 < s.detail["seconds"] <= whole
    assert _lifecycle(sim.messages) == _lifecycle(emu.messages)
    assert {"Switch trainer_pool in", "Switch rollout_pool in"} <= set(_lifecycle(sim.messages))
    a, b = sim_res.summary(), emu_res.summary()
    assert a["utilization"] is not None and b["utilization"] is not None
    assert set(a["idle"]) == set(b["idle"]) and a["provenance"] == "simulated" and b["provenance"] == "emulated"


def test_replicas_sharing_a_host_fail_and_come_back_together(ray_session):
    """Two rollout replicas per process: a kill takes both, both are restarted, nothing is lost."""
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.core import protocol as P
    cfg = cfgmod.from_dict(SMALL).with_overrides({"cluster.partition": [4, 4]})
    killed = []

    def kill(driver):
        rollouter = P.rollouter(P.ROLLOUT_POOL, 1)
        if not killed and driver.steps_done >= 1 and driver.r_busy.get(rollouter):
            ray_session.kill(driver.actors[rollouter])
            killed.append(rollouter)

    driver = EmulatedDriver(cfg, "bidirl", steps=3, seed=0, time_scale=100, replicas_per_host=2)
    res = driver.run(kill=kill)
    s = res.summary()
    assert driver.backend.hosts[0] == [P.rollouter(P.ROLLOUT_POOL, 0), P.rollouter(P.ROLLOUT_POOL, 1)]
    assert killed and sorted(r["worker"] for r in s["recoveries"]) == sorted(driver.backend.hosts[0])
    assert len(s["step_times"]) == 3 and s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    assert s["samples"]["consumed"] == 3 * 32 * 8
    _exclusive(res.log.spans_df())


def test_replicas_per_host_is_checked():
    from bidirl.cluster.emulated import EmulatedDriver
    with pytest.raises(ValueError, match="replicas_per_host must be an integer ≥ 1"):
        EmulatedDriver(cfgmod.from_dict(SMALL), "bidirl", steps=1, seed=0, replicas_per_host=0)
