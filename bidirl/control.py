"""Assemble the control plane for a job: planner envelope → topology, stage models, coordinator.

Every driver (simulation, emulated Ray workers, engine Ray workers) starts from :func:`build`, so they
schedule the same job with the same models and the same coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bidirl import config as cfgmod
from bidirl.core.coordinator import Coordinator, Settings, Topology
from bidirl.core.policies import get_policy
from bidirl.core.profiler import Profiler

DIRECTIONS = ("rollout_on_trainer_pool", "trainer_on_rollout_pool")


@dataclass
class ControlPlane:
    config: cfgmod.JobConfig
    plan: object
    topology: Topology
    models: object
    coordinator: Coordinator

    @property
    def pool_gpus(self) -> dict:
        env = self.plan.envelope
        return {"rollout_pool": env.rollout_gpus, "trainer_pool": env.trainer_gpus}

    def gpus_per_worker(self) -> dict:
        env, top = self.plan.envelope, self.topology
        out = {w: env.rollout_layout for w in top.rollouters + top.aux_rollouters}
        out["trainer_pool/trainer"] = env.trainer_gpus
        out["rollout_pool/trainer"] = env.rollout_gpus
        return out

    def optimizer_time(self) -> float:
        """AdamW over fp32 master weights sharded on the trainer pool: ~16 B moved per parameter."""
        m, hw = self.config.model_spec, self.config.hardware_spec
        return m.params_total * 16 / (hw.memory_bandwidth * 0.5) / max(1, self.plan.envelope.trainer_gpus)


def stages_of(cfg: cfgmod.JobConfig) -> tuple:
    return ("old_logprob", "ref_logprob", "actor_update") if cfg.rl.reference_model else ("old_logprob", "actor_update")


def build(cfg: cfgmod.JobConfig, policy: str, *, steps: int, seed: int) -> ControlPlane:
    from bidirl.perf.workload import sample_lengths
    from bidirl.planner import plan as make_plan
    from bidirl.sim.models import StageModels

    plan = make_plan(cfg)
    env = plan.envelope
    topology = Topology(rollout_replicas=env.rollout_replicas, trainer_replicas=env.trainer_replicas,
                        aux_rollout_replicas=env.trainer_gpus // env.rollout_layout,
                        aux_trainer_replicas=env.rollout_gpus // env.trainer_layout)
    models = StageModels.from_config(cfg, env.rollout_layout, env.trainer_layout)
    w = cfg.workload
    prior = sample_lengths(cfg.workload_stats, w.max_response_len, 64 * w.group_size, np.random.default_rng([seed, 2]))
    settings = Settings(batch=w.prompts_per_step, group_size=w.group_size, staleness=cfg.rl.staleness,
                        partial_rollout=cfg.rl.partial_rollout, stages=stages_of(cfg),
                        max_chunk=cfg.scheduler.max_chunk, tail_window=cfg.scheduler.tail_window, steps=steps)
    costs = {d: cfg.switch_costs(d) for d in DIRECTIONS}
    coordinator = Coordinator(settings, topology, get_policy(policy), models, Profiler(costs=costs), prior)
    return ControlPlane(cfg, plan, topology, models, coordinator)


def group_lengths(cfg: cfgmod.JobConfig, seed: int, group_id: int) -> tuple:
    """(prompt_len, response target lengths) of a group: a pure function of (seed, group id)."""
    from bidirl.perf.workload import sample_lengths
    w = cfg.workload
    p, r = sample_lengths(cfg.workload_stats, w.max_response_len, w.group_size,
                          np.random.default_rng([seed, 7, group_id]), step=group_id // w.prompts_per_step)
    return int(p[0]), tuple(int(x) for x in r)
