"""Discrete-event simulation of a job under any policy (DESIGN.md: the ``sim`` driver)."""

from __future__ import annotations

from typing import Optional

from bidirl.errors import BidirlError
from bidirl.job import config as cfgmod
from bidirl.results.run_result import RunResult
from bidirl.sim.driver import SimDriver


class UnsupportedSetting(BidirlError, ValueError):
    """A modelled baseline system does not support this configuration (the paper marks such points ×)."""


def simulate(config, policy: Optional[str] = None, *, steps: Optional[int] = None, seed: Optional[int] = None,
             progress: bool = False) -> RunResult:
    """Simulate ``config`` under ``policy`` (default: the config's scheduler.policy).

    ``policy`` is a core policy (bidirl, no-borrow, rot-only, tor-only, opportunistic) or a modelled
    baseline (verl-colocated, verl-async, areal, roll); ``steps`` and ``seed`` override the config's.
    """
    cfg = cfgmod.load(config)
    policy = policy or cfg.scheduler.policy
    steps = cfg.workload.steps if steps is None else int(steps)
    seed = cfg.seed if seed is None else int(seed)
    if steps < 1:
        raise cfgmod.ConfigError("steps", f"must be ≥ 1, got {steps}", "simulate at least one step")
    from bidirl.sim.baselines import BASELINES
    if policy in BASELINES:
        base = BASELINES[policy]
        reason = base.supports(cfg)
        if reason:
            raise UnsupportedSetting(f"{policy} does not support this setting: {reason}")
        cfg = base.adapt(cfg)
        if base.colocated:
            from bidirl.sim.colocated import simulate_colocated
            return simulate_colocated(cfg, steps=steps, seed=seed, policy=policy)
        return SimDriver(cfg, base.policy_for(cfg), steps, seed).run(progress)
    from bidirl.core.policies import get_policy
    try:
        get_policy(policy)
    except ValueError as exc:
        raise cfgmod.ConfigError("scheduler.policy", str(exc)) from None
    return SimDriver(cfg, policy, steps, seed).run(progress)


__all__ = ["simulate", "SimDriver", "RunResult", "UnsupportedSetting"]
