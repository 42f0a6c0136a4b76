"""The modelled external systems (paper §7.1, "Baselines"): what each supports and how it adapts a job."""

import pytest

from bidirl.job import config as cfgmod
from bidirl.job.planner import plan
from bidirl.perf.costs import trainer_offload_reload_time
from bidirl.sim import baselines as B
from bidirl.sim.baselines import BASELINES


def a6000(**over):
    return cfgmod.load("a6000-default").with_overrides(over)


def h100_partition(model: str, rollout: int):
    return cfgmod.load("h100-default").with_overrides({
        "model": model, "cluster.gpus": 32, "cluster.partition": [rollout, 32 - rollout],
        "workload.prompts_per_step": 120})


@pytest.fixture
def dp_one_per_gpu(monkeypatch):
    """Trainer data parallelism = trainer GPUs, without consulting the planner."""
    monkeypatch.setattr(B, "trainer_data_parallel",
                        lambda cfg: cfg.cluster.partition.trainer if cfg.cluster.partition else cfg.cluster.gpus // 2)


def test_registry_shape():
    assert set(BASELINES) == {"verl-colocated", "verl-async", "areal", "roll"}
    for name, base in BASELINES.items():
        assert base.name == name
        assert base.version and any(v in base.version for v in ("v0.7.1", "v1.0.3", "v0.2.1"))
        assert base.colocated == (name == "verl-colocated")
        assert len(base.rules) >= 3 and all(isinstance(r, str) and len(r) > 40 for r in base.rules)
        assert base.not_modelled and all(isinstance(r, str) and len(r) > 40 for r in base.not_modelled)
        policy = base.policy_for(base.adapt(a6000(**{"rl.staleness": 0 if base.colocated else 1})))
        assert policy.name == name and not policy.rollout_on_trainer_pool and not policy.trainer_on_rollout_pool
    # each modelled mechanism cites the file and function it follows
    for name in ("verl-async", "areal", "roll"):
        assert all(".py" in r or ".yaml" in r or "paper" in r for r in BASELINES[name].rules), name
    # every name is a policy the config accepts
    for name in BASELINES:
        assert name in cfgmod.POLICIES


def test_verl_colocated_is_on_policy_only():
    base = BASELINES["verl-colocated"]
    assert base.supports(a6000(**{"rl.staleness": 0})) is None
    for s in (0.5, 1, 2, 4):
        reason = base.supports(a6000(**{"rl.staleness": s}))
        assert reason and "s = 0" in reason
    adapted = base.adapt(a6000(**{"rl.staleness": 0}))
    assert adapted.rl.staleness == 0 and adapted.rl.partial_rollout is False
    with pytest.raises(ValueError, match="verl-colocated"):
        base.adapt(a6000(**{"rl.staleness": 1}))


def test_verl_async_supports_fractional_staleness_with_partial_rollout():
    base = BASELINES["verl-async"]
    for s in (0, 0.5, 1, 2, 4):
        assert base.supports(a6000(**{"rl.staleness": s})) is None
    cfg = base.adapt(a6000(**{"rl.staleness": 0.5, "rl.partial_rollout": False}))
    assert cfg.rl.staleness == 0.5 and cfg.rl.partial_rollout is True


@pytest.mark.parametrize("s", [0.5, 0.25, 1.5])
def test_areal_rejects_fractional_staleness(s, dp_one_per_gpu):
    reason = BASELINES["areal"].supports(a6000(**{"rl.staleness": s}))
    assert reason and "integer" in reason


@pytest.mark.parametrize("s", [0, 1, 2, 4])
def test_areal_accepts_integer_staleness(s, dp_one_per_gpu):
    base = BASELINES["areal"]
    assert base.supports(a6000(**{"rl.staleness": s})) is None
    cfg = base.adapt(a6000(**{"rl.staleness": s}))
    assert cfg.rl.staleness == s and cfg.rl.partial_rollout is True


def test_areal_divisibility_rule(dp_one_per_gpu):
    base = BASELINES["areal"]
    for model in ("qwen3-vl-2b", "qwen3-vl-4b"):
        reason = base.supports(h100_partition(model, 16))
        assert reason and "120" in reason and "16" in reason
        assert base.supports(h100_partition(model, 8)) is None
        assert base.supports(h100_partition(model, 24)) is None


def test_areal_marks_only_the_16_16_point_with_the_real_planner():
    """Paper §7.1: in the 2B and 4B H100 batch-120 partition sweeps only the 16-16 point violates AReaL's rule."""
    base = BASELINES["areal"]
    for model in ("qwen3-vl-2b", "qwen3-vl-4b"):
        marks = {r: base.supports(h100_partition(model, r)) is not None for r in (8, 16, 24)}
        assert marks == {8: False, 16: True, 24: False}, model


@pytest.mark.parametrize("s,ok", [(0, True), (0.5, False), (0.9, False), (1, True), (1.5, True), (2, True),
                                  (4, True)])
def test_roll_staleness_rules(s, ok):
    """ROLL asserts async_generation_ratio ≥ 1 (0 = synchronous); a non-integer ratio ≥ 1 passes its code."""
    base = BASELINES["roll"]
    reason = base.supports(a6000(**{"rl.staleness": s}))
    assert (reason is None) == ok
    if ok:
        src = a6000(**{"rl.staleness": s})
        cfg = base.adapt(src)
        assert cfg.rl.staleness == s and cfg.rl.partial_rollout is True
        # the per-step trainer offload/reload rides on the weight-sync path: the adapted sync is the job's sync at its
        # planned rollout layout plus the reload at its trainer layout, the same two floats added in the same order,
        # so equal bit for bit (==); the reload is a positive copy time, so the sync grows (>), and a sync without
        # it (the defect) fails both, as one at another layout than the planned one fails the first
        env = plan(src).envelope
        sync = src.weight_sync_time(rollout_layout=env.rollout_layout)
        reload = trainer_offload_reload_time(src.hardware_spec, src.model_spec, trainer_layout=env.trainer_layout)
        assert reload > 0 and cfg.weight_sync_time() == sync + reload and cfg.weight_sync_time() > sync
    else:
        assert "async_generation_ratio" in reason


def test_the_modelled_systems_form_batches_and_admit_work_their_own_way():
    from bidirl.sim import simulate
    cfg = a6000(**{"rl.staleness": 1})
    verl = BASELINES["verl-async"].policy_for(cfg)
    areal = BASELINES["areal"].policy_for(cfg)
    roll = BASELINES["roll"].policy_for(cfg)
    assert (verl.batch_rule, areal.batch_rule, roll.batch_rule) == ("completion", "submission", "oldest-first")
    assert areal.max_in_flight == cfg.workload.prompts_per_step and roll.drop_stale
    assert verl.max_in_flight == 16 * B.rollout_replicas(cfg)
    runs = {name: simulate(cfg, name, steps=6, seed=0).summary() for name in ("verl-async", "areal", "roll")}
    for name, s in runs.items():
        assert s["policy"] == name and s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
        assert s["borrows"]["rollout_on_trainer_pool"] == s["borrows"]["trainer_on_rollout_pool"] == 0
    # the mechanisms change the timeline: the three systems no longer draw one bar
    assert len({round(s["throughput"], 6) for s in runs.values()}) == 3


def test_adapt_returns_a_validated_copy():
    cfg = a6000(**{"rl.staleness": 2, "rl.partial_rollout": False})
    out = BASELINES["roll"].adapt(cfg)
    assert out is not cfg and isinstance(out, cfgmod.JobConfig)
    assert cfg.rl.partial_rollout is False and out.rl.partial_rollout is True   # the original is untouched
    assert out.cluster == cfg.cluster and out.workload == cfg.workload


def test_unsupported_reason_for_core_policies_is_none():
    assert B.unsupported_reason("bidirl", a6000(**{"rl.staleness": 0.5})) is None
    assert B.unsupported_reason("roll", a6000(**{"rl.staleness": 0.5}))
