"""The external systems the paper compares against (§7.1 "Baselines"), modelled as rules over a job.

The paper compares BiDiRL with veRL v0.7.1, AReaL v1.0.3 and ROLL v0.2.1 and marks settings a system cannot
run with ×: fractional staleness 0 < s < 1 for ROLL and AReaL, and — for AReaL — a prompt batch that is not a
multiple of the rollout data parallelism (the batch-120, 16-16 point of the H100 resource-partition sweeps).
A :class:`Baseline` captures each system as

* ``supports(config)`` — ``None`` when the system can run the job, else the reason it cannot (the runner
  records the point as unsupported and never simulates it);
* ``adapt(config)`` — the job with the system's own settings applied (its partial-rollout behaviour, its
  staleness representation), built with :meth:`bidirl.config.JobConfig.with_overrides`;
* ``policy`` / ``colocated`` — how :func:`bidirl.sim.simulate` executes it: the disaggregated systems run
  the ``no-borrow`` core policy on fixed rollout/trainer pools (none of the three versions borrows GPUs
  between pools), veRL's hybrid engine runs on one time-shared pool (``bidirl.sim.colocated``);
* ``rules`` — every documented rule with its source, so a reader can check the model against the system.

Sources are the systems' own code and docs as summarised in the project's peer survey (file paths and
versions are quoted in each rule) and the paper's §7.1 text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from bidirl.config import JobConfig
from bidirl.core.protocol import BASELINE_POLICIES


@dataclass(frozen=True)
class Baseline:
    """One modelled external system (paper §7.1, "Baselines").

    ``supports`` returns ``None`` or the human-readable reason the system cannot run ``config``;
    ``adapt`` returns ``config`` with the system's own settings applied. ``rules`` lists each modelled
    rule with its source.
    """
    name: str
    version: str
    policy: str
    colocated: bool
    rules: tuple
    _check: Callable[[JobConfig], Optional[str]]
    _adapt: Callable[[JobConfig], JobConfig]

    def supports(self, config: JobConfig) -> Optional[str]:
        """``None`` if this system runs ``config``, else the reason it cannot (as the paper marks ×)."""
        return self._check(config)

    def adapt(self, config: JobConfig) -> JobConfig:
        """``config`` with this system's settings applied; raises ``ValueError`` if unsupported."""
        reason = self._check(config)
        if reason is not None:
            raise ValueError(f"{self.name} ({self.version}) cannot run this job: {reason}")
        return self._adapt(config)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------

def _is_integer(x: float) -> bool:
    return float(x).is_integer()


def rollout_data_parallel(config: JobConfig) -> int:
    """Rollout data parallelism: rollout GPUs / GPUs per rollout replica (tensor parallel size).

    The rollout GPU count is the fixed partition when the job has one, else the static planner's envelope;
    the replica size ρ_r always comes from the planner's memory model (paper §4, Algorithm 1), so AReaL's
    divisibility rule is judged on the same layout the simulator runs.
    """
    from bidirl.planner import plan
    env = plan(config).envelope
    rollout_gpus = config.cluster.partition.rollout if config.cluster.partition is not None else env.rollout_gpus
    return max(1, rollout_gpus // max(1, env.rollout_layout))


# --------------------------------------------------------------------------------------------------
# veRL v0.7.1, colocated hybrid engine
# --------------------------------------------------------------------------------------------------

VERL_COLOCATED_RULES = (
    "Synchronous on-policy only (s = 0): the hybrid engine generates a batch on all GPUs, then trains on the "
    "same GPUs; off-policy training needs the separate fully-async / one-step-off recipes "
    "(veRL verl/trainer/ppo/ray_trainer.py, actor_rollout_ref.hybrid_engine=True; paper §7.2 compares it "
    "at s = 0 only).",
    "One time-shared pool of all G GPUs: rollout and training never overlap "
    "(peer survey §7: veRL 'hybrid engine' colocation).",
    "Each step pays the reshard between rollout and training: vLLM sleep + FSDP onload before the update, "
    "FSDP offload + vLLM wake + in-place weight load after it (charged with the Rollouter-on-TrainerPool "
    "C_in / C_out plus the weight-sync time by bidirl.sim.colocated).",
    "No partial rollout: a step's generation ends with its slowest response "
    "(veRL's async_training.partial_rollout exists only in the fully-async recipe).",
)


def _verl_colocated_check(cfg: JobConfig) -> Optional[str]:
    if cfg.rl.staleness != 0:
        return (f"veRL's colocated hybrid engine is synchronous (s = 0); rl.staleness = {cfg.rl.staleness:g} "
                "needs an asynchronous recipe")
    return None


def _verl_colocated_adapt(cfg: JobConfig) -> JobConfig:
    return cfg.with_overrides({"rl.staleness": 0.0, "rl.partial_rollout": False})


# --------------------------------------------------------------------------------------------------
# veRL v0.7.1, disaggregated fully-async recipe
# --------------------------------------------------------------------------------------------------

VERL_ASYNC_RULES = (
    "Disaggregated fixed pools: trainer.nnodes/n_gpus_per_node for training, rollout.nnodes/n_gpus_per_node "
    "for the rollouter, hybrid_engine=False (verl/experimental/separation/utils.py::"
    "create_resource_pool_manager). v0.7.1 predates dynamic_schedule (PR #6556, v0.9.0): no borrowing, "
    "so it runs the no-borrow policy.",
    "Fractional staleness supported: async_training.staleness_threshold is a float; at most "
    "(1+s)·trigger_parameter_sync_step·require_batches·ppo_mini_batch_size − n_stale samples per version "
    "(fully_async_rollouter.py::set_max_required_samples, docs/advance/fully_async.md) — the rule "
    "bidirl.core.staleness implements; s = 0 is synchronous.",
    "Partial rollout on (async_training.partial_rollout: True, the default): generation is interrupted at "
    "each parameter sync and resumed with the kept prefix (FullyAsyncLLMServerClient).",
    "Assumed trigger_parameter_sync_step = 1 and require_batches = 1: one weight sync per training step, "
    "as BiDiRL does, so versions count the same in both systems.",
)


def _verl_async_check(cfg: JobConfig) -> Optional[str]:
    return None


def _verl_async_adapt(cfg: JobConfig) -> JobConfig:
    return cfg.with_overrides({"rl.partial_rollout": True})


# --------------------------------------------------------------------------------------------------
# AReaL v1.0.3
# --------------------------------------------------------------------------------------------------

AREAL_RULES = (
    "Integer staleness only: rollout.max_head_offpolicyness is an int, default 0 = synchronous "
    "(areal/api/cli_args.py); fractional 0 < s < 1 is unsupported (paper §7.1 marks those points ×).",
    "Admission capacity min(max_concurrent − running, (max_staleness + version + 1)·batch − (accepted + "
    "running)) (areal/infra/staleness_manager.py::StalenessManager.get_capacity) — identical to "
    "bidirl.core.staleness for integer s.",
    "Interruptible generation: on a weight update requests are aborted with their tokens and log-probs kept "
    "and resubmitted with the prefix (areal/infra/remote_inf_engine.py) — partial rollout on.",
    "The prompt batch must be divisible by the rollout data parallelism (rollout GPUs / rollout TP size); "
    "otherwise unsupported (paper §7.1: the batch-120 16-16 point of the H100 resource-partition sweeps).",
    "Disaggregated fixed pools (scheduling_strategy.type: separation), no borrowing: runs no-borrow.",
)


def _areal_check(cfg: JobConfig) -> Optional[str]:
    s = cfg.rl.staleness
    if not _is_integer(s):
        return (f"AReaL's rollout.max_head_offpolicyness is an integer; rl.staleness = {s:g} is fractional")
    dp = rollout_data_parallel(cfg)
    batch = cfg.workload.prompts_per_step
    if batch % dp:
        return (f"AReaL needs the prompt batch ({batch}) divisible by the rollout data parallelism ({dp}); "
                f"{batch} % {dp} = {batch % dp}")
    return None


def _areal_adapt(cfg: JobConfig) -> JobConfig:
    return cfg.with_overrides({"rl.staleness": float(int(cfg.rl.staleness)), "rl.partial_rollout": True})


# --------------------------------------------------------------------------------------------------
# ROLL v0.2.1
# --------------------------------------------------------------------------------------------------

ROLL_RULES = (
    "Asynchronous RLVR needs async_generation_ratio ≥ 1.0 (assert in roll/pipeline/rlvr/rlvr_config.py, "
    "v0.2.1 line 183): 0 < s < 1 is unsupported (paper §7.1 marks those points ×).",
    "Only integer ratios are supported per the user guide (docs_roll/.../async_training.md: 'currently only "
    "integer is supported'); a non-integer s > 1 is therefore treated as unsupported too.",
    "s = 0 is supported: async_generation_ratio = 0 selects the synchronous pipeline ('0 means synchronous', "
    "roll/configs/base_config.py); with disjoint device_mapping ranges this is synchronous disaggregated "
    "training, modelled as no-borrow with s = 0.",
    "No partial-rollout knob: pause_sampling() aborts running requests (roll/distributed/scheduler/"
    "generate_scheduler.py). Modelled as partial rollout off, where the weight sync waits for running "
    "generations to finish; this is favourable to ROLL (an abort would also discard their tokens).",
    "Disjoint device_mapping = disaggregated fixed pools; partial_gpu_mode (shrink/expand) is agentic-only "
    "and does not apply to the RLVR pipeline used for Geo3K/GSM8K: runs no-borrow.",
)


def _roll_check(cfg: JobConfig) -> Optional[str]:
    s = cfg.rl.staleness
    if 0 < s < 1:
        return f"ROLL asserts async_generation_ratio ≥ 1.0; rl.staleness = {s:g} is fractional below 1"
    if not _is_integer(s):
        return f"ROLL supports only integer async_generation_ratio; rl.staleness = {s:g}"
    return None


def _roll_adapt(cfg: JobConfig) -> JobConfig:
    return cfg.with_overrides({"rl.staleness": float(int(cfg.rl.staleness)), "rl.partial_rollout": False})


# --------------------------------------------------------------------------------------------------

BASELINES: dict = {
    "verl-colocated": Baseline("verl-colocated", "veRL v0.7.1 (hybrid engine)", "no-borrow", True,
                               VERL_COLOCATED_RULES, _verl_colocated_check, _verl_colocated_adapt),
    "verl-async": Baseline("verl-async", "veRL v0.7.1 (fully_async_policy)", "no-borrow", False,
                           VERL_ASYNC_RULES, _verl_async_check, _verl_async_adapt),
    "areal": Baseline("areal", "AReaL v1.0.3", "no-borrow", False, AREAL_RULES, _areal_check, _areal_adapt),
    "roll": Baseline("roll", "ROLL v0.2.1", "no-borrow", False, ROLL_RULES, _roll_check, _roll_adapt),
}
assert tuple(BASELINES) == BASELINE_POLICIES, "sim/baselines.py and protocol.BASELINE_POLICIES name the same systems"


def unsupported_reason(name: str, config: JobConfig) -> Optional[str]:
    """The reason baseline ``name`` cannot run ``config`` (``None`` if it can, or if ``name`` is a core policy)."""
    base = BASELINES.get(name)
    return None if base is None else base.supports(config)


__all__ = ["Baseline", "BASELINES", "rollout_data_parallel", "unsupported_reason"]
