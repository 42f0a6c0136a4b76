"""Assemble a job's control plane: planner envelope → topology, stage-time predictor, coordinator.

Every driver (simulation, emulated Ray workers, engine Ray workers) starts from :func:`assemble`, so they
schedule the same job with the same predictor and the same coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bidirl.core import protocol as P
from bidirl.core.coordinator import Coordinator, Settings, Topology
from bidirl.core.policies import Policy, get_policy
from bidirl.core.profiler import Profiler
from bidirl.job import config as cfgmod
from bidirl.perf.costs import aux_weight_transfer_time, first_switch_allocation
from bidirl.perf.predictor import StagePredictor
from bidirl.perf.workload import sample_lengths


@dataclass
class Assembly:
    """What :func:`assemble` builds: the job, its plan, who runs where, the predictor and the coordinator."""
    config: cfgmod.JobConfig
    plan: object
    topology: Topology
    predictor: StagePredictor
    coordinator: Coordinator
    first_switch: dict = field(default_factory=dict)   # (direction, "in" | "out") -> the first switch's allocation

    @property
    def reproducible(self) -> bool:
        """Whether the run is in the reproducible mode (the engines then sum each step's gradient in unit order)."""
        return self.coordinator.settings.reproducible

    @property
    def pool_gpus(self) -> dict:
        env = self.plan.envelope
        return {P.ROLLOUT_POOL: env.rollout_gpus, P.TRAINER_POOL: env.trainer_gpus}

    def gpus_per_worker(self) -> dict:
        """GPUs each worker (lane) occupies: a rollout replica ρ_r, a trainer gang its whole pool."""
        env, top = self.plan.envelope, self.topology
        out = {w: env.rollout_layout for w in top.rollouters + top.aux_rollouters}
        out[P.PRIMARY_TRAINER] = env.trainer_gpus
        out[P.AUX_TRAINER] = env.rollout_gpus
        return out

    def optimizer_time(self) -> float:
        return self.predictor.optimizer_time(self.plan.envelope.trainer_gpus)

    def optimizer_step_time(self, final: bool) -> float:
        """One ``OptimizerStep`` command's seconds. With optimizer mini-batches (``rl.mini_batch_prompts``) the
        coordinator sends one per mini-batch: each is one update (the gradient all-reduce and the AdamW step,
        ``StagePredictor.optimizer_update_time``) and the local update's ``final`` one also carries what is charged
        once per local update (the offload copies): :meth:`optimizer_time` less the updates already taken. Without
        mini-batches the one command is :meth:`optimizer_time` itself."""
        whole = self.optimizer_time()
        taken = self.config.optimizer_updates_per_step // self.config.rl.updates_per_sync - 1
        if not taken:
            return whole
        update = self.predictor.optimizer_update_time(self.plan.envelope.trainer_gpus)
        return whole - taken * update if final else update


def reproducible_mode(cfg: cfgmod.JobConfig, policy: Policy) -> bool:
    """Whether a run is in the reproducible mode (``rl.reproducible``, by default on at s = 0): only under the
    control plane's own batch rule — a modelled system's rule (completion order, dropped groups, an in-flight cap)
    is what it is; asking for the mode with one is an error naming the key."""
    own = policy.batch_rule == "lookahead" and not policy.drop_stale and policy.max_in_flight is None
    if cfg.rl.reproducible and not own:
        raise cfgmod.ConfigError("rl.reproducible", f"policy {policy.name!r} forms batches by its own rule "
                                 f"({policy.batch_rule})", "set rl.reproducible: false for a modelled system's policy")
    return cfg.rl.reproducible_on and own


def assemble(cfg: cfgmod.JobConfig, policy, *, steps: int, seed: int,
             predictor: Optional[StagePredictor] = None, aux_refresh: bool = True) -> Assembly:
    """``policy``: a policy name (``bidirl.core.policies.POLICIES``) or a :class:`~bidirl.core.policies.Policy`;
    ``predictor``: the coordinator's starting stage-time models (default: the config's presets), which the online
    profiler refits as the run goes. ``aux_refresh``: whether the driver refreshes an auxiliary trainer gang's weights
    after each optimizer step (``RefreshWeights``); without it an auxiliary gang runs only the segments on the
    version's weights."""
    from bidirl.job.planner import plan as make_plan

    plan = make_plan(cfg)
    env = plan.envelope
    policy = policy if isinstance(policy, Policy) else get_policy(policy)
    topology = Topology(rollout_replicas=env.rollout_replicas, trainer_replicas=env.trainer_replicas,
                        aux_rollout_replicas=env.trainer_gpus // env.rollout_layout,
                        aux_trainer_replicas=env.rollout_gpus // env.trainer_layout,
                        trainer_layout=env.trainer_layout)
    predictor = predictor or StagePredictor.from_config(cfg, env.rollout_layout, env.trainer_layout,
                                                         expert_parallel=env.trainer_expert_parallel)
    w = cfg.workload
    prior = sample_lengths(cfg.workload_stats, w.max_response_len, 64 * w.group_size, np.random.default_rng([seed, 2]))
    settings = Settings(batch=w.prompts_per_step, group_size=w.group_size, staleness=cfg.rl.staleness,
                        partial_rollout=cfg.rl.partial_rollout, stages=cfg.rl.stages,
                        micro_batch_per_device=cfg.rl.micro_batch_per_device, tail_window=cfg.scheduler.tail_window,
                        steps=steps, chunks_in_flight=cfg.scheduler.chunks_in_flight,
                        optimizer_seconds=predictor.optimizer_time(env.trainer_gpus),
                        max_tokens_per_micro_batch=cfg.rl.max_tokens_per_micro_batch,
                        sequence_parallel=cfg.rl.sequence_parallel, updates_per_sync=cfg.rl.updates_per_sync,
                        mini_batch_prompts=cfg.rl.mini_batch_prompts,
                        aux_refresh_seconds=aux_weight_transfer_time(cfg.hardware_spec, cfg.model_spec,
                                                                     env.trainer_layout) if aux_refresh else None,
                        reproducible=reproducible_mode(cfg, policy))
    costs = {d: cfg.switch_costs(d) for d in P.DIRECTIONS}
    first = {(d, phase): first_switch_allocation(cfg.hardware_spec, cfg.model_spec, d, phase,
                                                 trainer_layout=env.trainer_layout)
             for d in P.DIRECTIONS for phase in ("in", "out")}
    first = {k: v for k, v in first.items() if v > 0}
    profiler = Profiler(costs=costs, first_switch={(d, "c_" + phase): v for (d, phase), v in first.items()})
    coordinator = Coordinator(settings, topology, policy, predictor, profiler, prior)
    return Assembly(cfg, plan, topology, predictor, coordinator, first)
