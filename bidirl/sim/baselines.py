"""The external systems the paper compares against (§7.1 "Baselines"), modelled by their mechanisms.

The paper compares BiDiRL with veRL v0.7.1, AReaL v1.0.3 and ROLL v0.2.1. None of the three borrows GPUs between
pools at those versions, but they differ in how they admit run-ahead work, form batches, handle generation cut by
a weight sync, sync weights and what their trainer computes. Each :class:`Baseline` models those mechanisms as its
code does them — every rule cites ``repository@tag:path:function`` (read at the tagged commit: veRL
``verl-project/verl`` v0.7.1 ``bec9ef7``, AReaL ``inclusionAI/AReaL`` v1.0.3 ``376ecbb``, ROLL ``alibaba/ROLL``
v0.2.1 ``2eba7c3``) — and lists what is *not* modelled:

* ``supports(config)`` — ``None`` when the system can run the job, else why not (the point is marked ×);
* ``adapt(config)`` — the job with the system's own settings applied (partial rollout, staleness, the trainer's
  stages, the weight-sync path);
* ``policy_for(config)`` — the control-plane :class:`~bidirl.core.policies.Policy` that runs it: no borrowing,
  the system's batch-formation rule, in-flight cap and drops (``bidirl.core.buffer.BATCH_RULES``);
* ``colocated`` — veRL's hybrid engine runs on one time-shared pool instead (``bidirl.sim.colocated``);
* ``rules`` / ``not_modelled`` — what the model does and does not capture, with sources, so a reader can check
  it against the system.

The paper does not give the baselines' own settings (veRL's ``trigger_parameter_sync_step``, AReaL's
``max_concurrent_rollouts`` and log-prob recomputation, ROLL's strategy); each assumption is a rule below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from bidirl.core.policies import Policy
from bidirl.core.protocol import BASELINE_POLICIES
from bidirl.job.config import JobConfig


@dataclass(frozen=True)
class Baseline:
    """One modelled external system (paper §7.1, "Baselines")."""
    name: str
    version: str
    colocated: bool
    rules: tuple
    not_modelled: tuple
    _check: Callable[[JobConfig], Optional[str]]
    _adapt: Callable[[JobConfig], JobConfig]
    _policy: Callable[[JobConfig], Policy]

    def supports(self, config: JobConfig) -> Optional[str]:
        """``None`` if this system runs ``config``, else the reason it cannot (as the paper marks ×)."""
        return self._check(config)

    def adapt(self, config: JobConfig) -> JobConfig:
        """``config`` with this system's settings applied; raises ``ValueError`` if unsupported."""
        reason = self._check(config)
        if reason is not None:
            raise ValueError(f"{self.name} ({self.version}) cannot run this job: {reason}")
        return self._adapt(config)

    def policy_for(self, config: JobConfig) -> Policy:
        """The control-plane policy that executes this system on ``config`` (already adapted)."""
        return self._policy(config)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------

def _is_integer(x: float) -> bool:
    return float(x).is_integer()


def _envelope(config: JobConfig):
    from bidirl.job.planner import plan
    return plan(config).envelope


def rollout_replicas(config: JobConfig) -> int:
    """Rollout data parallelism: rollout GPUs / GPUs per rollout replica (the planner's layout)."""
    env = _envelope(config)
    rollout_gpus = config.cluster.partition.rollout if config.cluster.partition is not None else env.rollout_gpus
    return max(1, rollout_gpus // max(1, env.rollout_layout))


def trainer_data_parallel(config: JobConfig) -> int:
    """The trainer's data parallelism under FSDP over the whole trainer pool: one rank per trainer GPU, or one per
    sequence-parallel group of ``rl.sequence_parallel`` GPUs."""
    env = _envelope(config)
    gpus = config.cluster.partition.trainer if config.cluster.partition is not None else env.trainer_gpus
    return gpus // config.rl.sequence_parallel


def _no_borrow(name: str, **rules) -> Policy:
    return Policy(name, rollout_on_trainer_pool=False, trainer_on_rollout_pool=False, **rules)


# --------------------------------------------------------------------------------------------------
# veRL v0.7.1, colocated hybrid engine
# --------------------------------------------------------------------------------------------------

VERL_COLOCATED_RULES = (
    "Synchronous on-policy only (s = 0): the hybrid engine generates a batch on all GPUs, then trains on the "
    "same GPUs (veRL verl/trainer/ppo/ray_trainer.py, actor_rollout_ref.hybrid_engine=True; the paper compares "
    "it at s = 0 only, §7.2).",
    "One time-shared pool of all G GPUs: rollout and training never overlap.",
    "Each step pays the reshard between rollout and training: vLLM sleep + FSDP onload before the update, FSDP "
    "offload + vLLM wake + in-place weight load after it (charged with the Rollouter-on-TrainerPool C_in / C_out "
    "plus the weight-sync time by bidirl.sim.colocated).",
    "No partial rollout: a step's generation ends with its slowest response.",
)
VERL_COLOCATED_NOT_MODELLED = (
    "veRL's sequence balancing across data-parallel ranks beyond the trainer model's serpentine split; the "
    "colocated recipe itself was not re-read at v0.7.1.",
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
    "Fixed disaggregated pools, no borrowing: verl/experimental/separation/utils.py:create_resource_pool_manager "
    "builds the trainer pool, rollout replicas get standalone pools (workers/rollout/replica.py:init_standalone), "
    "hybrid_engine must be off. Dynamic scheduling of idle trainer GPUs (fully_async_policy/dynamic_schedule, "
    "PR #6556) first ships in v0.9.0.",
    "Run-ahead budget: fully_async_rollouter.py:FullyAsyncRollouter.set_max_required_samples allows "
    "int((1 + s)·B) groups per sync window and reset_staleness charges in-flight and queued groups to the next "
    "window — written cumulatively, floor((v + 1 + s)·B), the rule bidirl.core.staleness implements; s is a float.",
    "At most 16 × (rollout replicas) groups generate at once (fully_async_rollouter.py:"
    "set_max_required_samples, max_concurrent_samples): Policy.max_in_flight.",
    "Batches are the first B groups to complete, FIFO by completion, with no version check at consumption "
    "(fully_async_trainer.py:FullyAsyncTrainer._get_samples_from_queue, message_queue.py:MessageQueue): batch "
    "rule 'completion', staleness not asserted on batches.",
    "Every sync aborts in-flight generation (checkpoint_engine/base.py:CheckpointEngineManager.update_weights, "
    "abort_all_requests) and resumes it with the kept prefix "
    "(fully_async_policy/agent_loop/agent_loop.py:FullyAsyncLLMServerManager.generate): partial rollout on.",
    "Old log-probs: the recipe's default skips their recomputation (config/fully_async_ppo_trainer.yaml: "
    "algorithm.rollout_correction.bypass_mode: True; separation/ray_trainer.py:"
    "SeparateRayPPOTrainer._fit_compute_log_prob), but the paper configures every system with the same "
    "settings where supported (§7.1) and BiDiRL recomputes them, so the model runs the old_logprob stage as "
    "bidirl does (set rl.recompute_old_logprob: false to model the default instead).",
    "Weights: NCCL bucketed broadcast from trainer rank 0 (nccl_checkpoint_engine.py) while generation is paused "
    "and the trainer blocks (fully_async_trainer.py:_fit_update_weights): the weight-sync time, as for bidirl.",
    "Assumed trigger_parameter_sync_step = 1 and require_batches = 1 (config/fully_async_ppo_trainer.yaml "
    "defaults the trigger to 4): one weight sync per training step, as BiDiRL does, so versions count the same; "
    "the paper does not give veRL's values.",
)
VERL_ASYNC_NOT_MODELLED = (
    "trigger_parameter_sync_step > 1 (several local updates per sync, a mini-batch stream within a version).",
    "Per-response routing to the least-loaded replica and sticky resumption on the same replica "
    "(GlobalRequestLoadBalancer); the model dispatches whole groups to the least-loaded rollouter.",
)


def _verl_async_check(cfg: JobConfig) -> Optional[str]:
    return None


def _verl_async_adapt(cfg: JobConfig) -> JobConfig:
    return cfg.with_overrides({"rl.partial_rollout": True})


def _verl_async_policy(cfg: JobConfig) -> Policy:
    return _no_borrow("verl-async", batch_rule="completion", enforce_staleness=False,
                      max_in_flight=16 * rollout_replicas(cfg))


# --------------------------------------------------------------------------------------------------
# AReaL v1.0.3
# --------------------------------------------------------------------------------------------------

AREAL_RULES = (
    "Integer staleness only: InferenceEngineConfig.max_head_offpolicyness is an int (areal/api/cli_args.py); "
    "fractional 0 < s < 1 is unsupported (the paper marks those points ×, §7.1).",
    "Admission: areal/infra/staleness_manager.py:StalenessManager.get_capacity = min(max_concurrent_rollouts − "
    "running, (s + v + 1)·B − (accepted + running)) — bidirl.core.staleness's cap for integer s, plus an "
    "in-flight cap: max_concurrent_rollouts defaults to the batch B (cli_args.py; rollout_controller.py), so at "
    "most B groups generate at once even when s ≥ 1 (Policy.max_in_flight = B; the paper does not give AReaL's "
    "value).",
    "Batches take the earliest-submitted of the completed groups and never wait for a straggler "
    "(infra/async_task_runner.py:TimedResult, BatchTaskDispatcher.wait_results): batch rule 'submission', "
    "staleness enforced at admission only.",
    "Interruptible generation: a sync aborts requests (engine/vllm_ext/areal_vllm_server.py:"
    "/areal_pause_generation) and infra/remote_inf_engine.py:RemoteInfEngine.agenerate resubmits them with the "
    "prefix: partial rollout on.",
    "The batch must split into whole groups over the trainer's data parallelism "
    "(utils/seqpack.py:balanced_greedy_partition via TrainController._dispatch_tensors raises otherwise) — the "
    "paper states it for rollout data parallelism; both mark the batch-120 16-16 point ×.",
    "Weights: every trainer rank all-gathers, rank 0 broadcasts buckets over NCCL while generation is paused "
    "(engine/fsdp_engine.py:_update_weights_from_distributed): the weight-sync time.",
)
AREAL_NOT_MODELLED = (
    "The proximal log-prob recomputation (one more forward pass per step) that examples/math/gsm8k_grpo.yaml "
    "turns on (use_decoupled_loss, recompute_logprob; off in the dataclass defaults).",
    "Round-robin placement of groups on rollout instances (RolloutController._choose_worker) and sticky "
    "resumption; aborted requests waiting until rollout.resume() at the end of the step (save, checkpoint and "
    "evaluation are off in the measured steps, so the wait is the sync).",
)


def _areal_check(cfg: JobConfig) -> Optional[str]:
    s = cfg.rl.staleness
    if not _is_integer(s):
        return f"AReaL's rollout.max_head_offpolicyness is an integer; rl.staleness = {s:g} is fractional"
    dp = trainer_data_parallel(cfg)
    batch = cfg.workload.prompts_per_step
    if batch % dp:
        return (f"AReaL splits the batch into whole groups over its {dp} trainer ranks; {batch} groups do not "
                f"divide ({batch} % {dp} = {batch % dp})")
    return None


def _areal_adapt(cfg: JobConfig) -> JobConfig:
    return cfg.with_overrides({"rl.staleness": float(int(cfg.rl.staleness)), "rl.partial_rollout": True})


def _areal_policy(cfg: JobConfig) -> Policy:
    return _no_borrow("areal", batch_rule="submission", enforce_staleness=False,
                      max_in_flight=cfg.workload.prompts_per_step)


# --------------------------------------------------------------------------------------------------
# ROLL v0.2.1
# --------------------------------------------------------------------------------------------------

ROLL_RULES = (
    "Asynchronous RLVR needs async_generation_ratio ≥ 1.0 (roll/pipeline/rlvr/rlvr_config.py:"
    "RLVRConfig.__post_init__ asserts it): 0 < s < 1 is unsupported (the paper marks those points ×); s = 0 "
    "selects the synchronous pipeline; a non-integer ratio ≥ 1 is accepted by the code (the user guide says "
    "integer only).",
    "Admission: distributed/scheduler/generate_scheduler.py:ReplayBuffer.advance_step / _check_send_new_request "
    "admit at most ceil(r·B) + (v + 1)·B prompts — bidirl.core.staleness's cap for integer r.",
    "Batches take the oldest start step first and wait for its prompts still generating "
    "(distributed/scheduler/generate_scheduler.py:ReplayBuffer.get_batch, ItemsGroup.get_batch): batch rule "
    "'oldest-first'.",
    "At each sync, prompts too old for any future batch are cancelled and their slots refilled "
    "(ReplayBuffer.gc from DynamicSamplingScheduler.pause_sampling): Policy.drop_stale; the others are aborted "
    "and resumed with their prefix and original start step (pipeline/rlvr/user_defined_rollout_loop.py:"
    "postprocess_paused_data with collect_unfinished): partial rollout on.",
    "Every step offloads the trainer's parameters and optimizer state to host memory and reloads them at the "
    "next compute (pipeline/rlvr/rlvr_pipeline.py:RLVRPipeline.run calls actor_train.offload_states "
    "unconditionally): charged on the weight-sync path as a host round trip of the trainer state "
    "(bidirl.perf.costs.trainer_offload_reload_time).",
    "Weights: per pipeline stage, the DP-0/TP-0 rank gathers HF weights and NCCL-broadcasts them to the "
    "inference workers under a global lock (third_party/megatron/model_update.py:"
    "MegatronWeightUpdater._separated_model_update).",
)
ROLL_NOT_MODELLED = (
    "Least-loaded re-placement of resumed prompts and the 128-sequence cap per rollout rank "
    "(distributed/scheduler/router.py:PromptAffinityRouter).",
    "Old log-prob recomputation only when a step has more than one backward mini-batch or a KL term "
    "(base_config.py:set_old_logprobs_status): the model always runs it, as for bidirl.",
)


def _roll_check(cfg: JobConfig) -> Optional[str]:
    s = cfg.rl.staleness
    if 0 < s < 1:
        return f"ROLL asserts async_generation_ratio ≥ 1.0; rl.staleness = {s:g} is fractional below 1"
    return None


def _roll_adapt(cfg: JobConfig) -> JobConfig:
    from bidirl.perf.costs import trainer_offload_reload_time
    env = _envelope(cfg)
    sync = (cfg.weight_sync_time(rollout_layout=env.rollout_layout)
            + trainer_offload_reload_time(cfg.hardware_spec, cfg.model_spec, trainer_layout=env.trainer_layout))
    return cfg.with_overrides({"rl.partial_rollout": True, "scheduler.weight_sync": sync})


def _roll_policy(cfg: JobConfig) -> Policy:
    return _no_borrow("roll", batch_rule="oldest-first", drop_stale=True)


# --------------------------------------------------------------------------------------------------

BASELINES: dict = {
    "verl-colocated": Baseline("verl-colocated", "veRL v0.7.1 (hybrid engine)", True, VERL_COLOCATED_RULES,
                               VERL_COLOCATED_NOT_MODELLED, _verl_colocated_check, _verl_colocated_adapt,
                               lambda cfg: _no_borrow("verl-colocated")),
    "verl-async": Baseline("verl-async", "veRL v0.7.1 (fully_async_policy)", False, VERL_ASYNC_RULES,
                           VERL_ASYNC_NOT_MODELLED, _verl_async_check, _verl_async_adapt, _verl_async_policy),
    "areal": Baseline("areal", "AReaL v1.0.3", False, AREAL_RULES, AREAL_NOT_MODELLED, _areal_check, _areal_adapt,
                      _areal_policy),
    "roll": Baseline("roll", "ROLL v0.2.1", False, ROLL_RULES, ROLL_NOT_MODELLED, _roll_check, _roll_adapt,
                     _roll_policy),
}
assert tuple(BASELINES) == BASELINE_POLICIES, "sim/baselines.py and protocol.BASELINE_POLICIES name the same systems"


def unsupported_reason(name: str, config: JobConfig) -> Optional[str]:
    """The reason baseline ``name`` cannot run ``config`` (``None`` if it can, or if ``name`` is a core policy)."""
    base = BASELINES.get(name)
    return None if base is None else base.supports(config)


__all__ = ["Baseline", "BASELINES", "rollout_replicas", "trainer_data_parallel", "unsupported_reason"]
