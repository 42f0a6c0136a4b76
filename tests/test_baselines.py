"""The modelled external systems (paper §7.1, "Baselines"): what each supports and how it adapts a job."""

import pytest

from bidirl import config as cfgmod
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
    """Rollout data parallelism = rollout GPUs (TP 1), without consulting the planner."""
    monkeypatch.setattr(B, "rollout_data_parallel",
                        lambda cfg: cfg.cluster.partition.rollout if cfg.cluster.partition else cfg.cluster.gpus // 2)


def test_registry_shape():
    assert set(BASELINES) == {"verl-colocated", "verl-async", "areal", "roll"}
    for name, base in BASELINES.items():
        assert base.name == name
        assert base.version and any(v in base.version for v in ("v0.7.1", "v1.0.3", "v0.2.1"))
        assert base.policy == "no-borrow"
        assert base.colocated == (name == "verl-colocated")
        assert len(base.rules) >= 3 and all(isinstance(r, str) and len(r) > 40 for r in base.rules)
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


@pytest.mark.parametrize("s,ok", [(0, True), (0.5, False), (0.9, False), (1, True), (1.5, False), (2, True),
                                  (4, True)])
def test_roll_staleness_rules(s, ok):
    base = BASELINES["roll"]
    reason = base.supports(a6000(**{"rl.staleness": s}))
    assert (reason is None) == ok
    if ok:
        cfg = base.adapt(a6000(**{"rl.staleness": s}))
        assert cfg.rl.staleness == s and cfg.rl.partial_rollout is False
    else:
        assert "async_generation_ratio" in reason


def test_adapt_returns_a_validated_copy():
    cfg = a6000(**{"rl.staleness": 2})
    out = BASELINES["roll"].adapt(cfg)
    assert out is not cfg and isinstance(out, cfgmod.JobConfig)
    assert cfg.rl.partial_rollout is True            # the original is untouched
    assert out.cluster == cfg.cluster and out.workload == cfg.workload


def test_unsupported_reason_for_core_policies_is_none():
    assert B.unsupported_reason("bidirl", a6000(**{"rl.staleness": 0.5})) is None
    assert B.unsupported_reason("roll", a6000(**{"rl.staleness": 0.5}))
