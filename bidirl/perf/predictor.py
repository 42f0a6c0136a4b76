"""The stage-time predictor: what every driver and the coordinator ask of the appendix's models (§5.1).

As Vidur keeps its execution-time predictor apart from schedulers and the event loop, one object answers the
questions the control plane asks — how long a trainer chunk takes on a gang of ``d`` replicas, how long ``d``
rollout replicas need for a set of requests (M_r), how long the optimizer step and a weight sync take — and
gives the continuous-batching replica model (:mod:`bidirl.perf.replica`) its per-iteration cost terms, so
prediction, simulation and emulation share one model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bidirl.perf.flops import prefill_flops
from bidirl.perf.replica import EngineCosts
from bidirl.perf.rollout import RolloutModel
from bidirl.perf.trainer import TrainerModel

MAX_SEQS = 256   # vLLM's default max_num_seqs: the engine model and M_r share the same concurrency cap
#: records a stage needs before the online profiler refits its model
MIN_REFIT_RECORDS = 4
#: bytes moved per parameter by one AdamW step over fp32 master weights (read/write weights, m, v; read grads)
OPTIMIZER_BYTES_PER_PARAM = 16
#: achieved share of the memory bandwidth in the optimizer's element-wise kernels
OPTIMIZER_BANDWIDTH_SHARE = 0.5


#: bytes per parameter of the gradients averaged across trainer replicas: fp32 (FSDP's ``reduce_dtype``; veRL's
#: FSDP workers set ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``, ``verl/workers/fsdp_workers.py``)
GRADIENT_REDUCE_BYTES = 4


def optimizer_time(model, hardware, gpus: int) -> float:
    """One AdamW step over fp32 master weights sharded on ``gpus`` GPUs (memory-bound: ~16 B per parameter). A
    trainer replica shards its states over its ρ_t GPUs and the replicas hold copies (hybrid sharding), so each GPU
    steps ``N/ρ_t`` parameters: ``gpus`` is the shard group, not the trainer's GPU count."""
    return (model.params_total * OPTIMIZER_BYTES_PER_PARAM
            / (hardware.memory_bandwidth * OPTIMIZER_BANDWIDTH_SHARE) / max(1, int(gpus)))


def gradient_allreduce_time(model, hardware, layout: int, trainer_gpus: int) -> float:
    """Averaging the gradients across the ``R = trainer_gpus / ρ_t`` replicas before an optimizer step: each GPU
    all-reduces its fp32 gradient shard (``4·N/ρ_t`` bytes) with the GPUs holding the same shard in the other
    replicas. A ring all-reduce sends ``2·(R−1)/R`` times the buffer per GPU (Patarasuk & Yuan 2009, "Bandwidth
    optimal all-reduce algorithms"; NCCL's bus-bandwidth factor ``2(n−1)/n``, nccl-tests doc/PERFORMANCE.md), at
    the inter-node rate when the replicas span nodes (:func:`bidirl.perf.params.link_bandwidth` of the trainer's
    GPUs). 0 for one replica. ``trainer_gpus`` may be an array (the planner's candidates): one time each."""
    from bidirl.perf.params import link_bandwidth
    rho = max(1, int(layout))
    shard = GRADIENT_REDUCE_BYTES * model.params_total / rho
    if np.ndim(trainer_gpus):
        gpus = np.maximum(1, np.asarray(trainer_gpus, dtype=np.int64))
        replicas = gpus // rho
        ring = 2.0 * (replicas - 1) / np.maximum(replicas, 1) * shard / link_bandwidth(hardware, gpus)
        return np.where(replicas > 1, ring, 0.0)
    gpus = max(1, int(trainer_gpus))
    replicas = gpus // rho
    if replicas <= 1:
        return 0.0
    return 2.0 * (replicas - 1) / replicas * shard / link_bandwidth(hardware, gpus)


def optimizer_update_time(model, hardware, layout: int, trainer_gpus: int) -> float:
    """One optimizer update (one mini-batch) on ``trainer_gpus`` GPUs of ``layout``-GPU replicas: the gradient
    all-reduce across the replicas (:func:`gradient_allreduce_time`) and the AdamW step over each GPU's
    ``N/ρ_t`` shard (:func:`optimizer_time`)."""
    return gradient_allreduce_time(model, hardware, layout, trainer_gpus) + optimizer_time(model, hardware, layout)


def controller_seconds_per_local_update(cfg, hardware) -> float:
    """The driver's data path of one local update's trainer calls (:mod:`bidirl.perf.controller_data`): each stage
    of ``rl.stages`` is one call over the local update's ``prompts_per_step / updates_per_sync · group_size``
    samples (veRL's fully-async trainer calls ``update_actor`` once per ``require_batches`` mini-batches). 0 when
    ``hardware`` has no ``controller_data_rate``."""
    from bidirl.perf.controller_data import call_seconds
    rate = getattr(hardware, "controller_data_rate", None)
    if rate is None:
        return 0.0
    samples = cfg.prompts_per_local_update * cfg.workload.group_size
    return sum(call_seconds(stage, samples, cfg, rate) for stage in cfg.rl.stages)


@dataclass
class StagePredictor:
    rollout: RolloutModel
    trainer: TrainerModel
    group_size: int
    typical_context: float = 1.0     # mean prompt + half the mean response: the live length the KV cache holds
    #: seconds per local update the trainer spends besides its chunks and optimizer updates: offload copies
    #: (:func:`bidirl.perf.execution.offload_seconds`) and the driver's data path of its calls
    #: (:func:`controller_seconds_per_local_update`), charged with the optimizer step
    step_overhead: float = 0.0
    #: optimizer updates per local update (``rl.mini_batch_prompts``: one AdamW step per mini-batch; a step is one
    #: local update unless ``rl.updates_per_sync`` streams it)
    optimizer_updates: int = 1

    @classmethod
    def from_config(cls, cfg, rollout_layout: int, trainer_layout: int, hardware=None,
                    expert_parallel=None) -> "StagePredictor":
        """The presets' models for ``cfg`` (``hardware``: another :class:`~bidirl.job.presets.HardwareSpec` to use;
        ``expert_parallel``: the trainer's EP degree, default ``rl.expert_parallel`` or 1 — the planner passes the
        one it chose, ``Envelope.trainer_expert_parallel``)."""
        from bidirl.perf import execution
        from bidirl.perf.expert_parallel import with_expert_parallel
        from bidirl.perf.params import default_trainer_params
        m, hw = cfg.model_spec, hardware or cfg.hardware_spec
        stats, w, rl = cfg.workload_stats, cfg.workload, cfg.rl
        context = stats.prompt_mean + 0.5 * stats.response_mean_fraction * w.max_response_len
        params, recompute = default_trainer_params(m, hw, trainer_layout), rl.activation_checkpointing is True
        if recompute:
            params = execution.with_recompute(params, m, hw)
        params = execution.with_sequence_parallel(params, m, hw, rl.sequence_parallel, trainer_layout, recompute)
        ep = expert_parallel or getattr(rl, "expert_parallel", None) or 1
        params = with_expert_parallel(params, m, hw, ep, trainer_layout, recompute)
        updates = cfg.optimizer_updates_per_step // rl.updates_per_sync     # per local update
        overhead = execution.offload_seconds(m, hw, trainer_layout, rl.stages, rl.param_offload, rl.optimizer_offload)
        overhead += controller_seconds_per_local_update(cfg, hw)
        return cls(RolloutModel(m, hw, tp=rollout_layout, max_seqs=MAX_SEQS,
                                image_tokens_per_prompt=stats.image_tokens_per_prompt),
                   TrainerModel(m, hw, layout=trainer_layout, params=params, sequence_parallel=rl.sequence_parallel,
                                expert_parallel=ep, image_tokens_per_prompt=stats.image_tokens_per_prompt),
                   w.group_size, context, overhead, updates)

    def refit(self, records) -> dict:
        """Refit the rollout and trainer models' parameters to profiling records (the online profiler's, §5.1:
        ``bidirl.core.profiler.ProfileRecord`` with the unit's lengths), starting from the current parameters,
        with :mod:`bidirl.perf.fit`'s least squares. A stage needs a few records to be refitted; returns
        the calibration reports of what was refitted."""
        from bidirl.perf import fit as calibrate
        rollout = [{"prompt_lens": r.workload["prompt_lens"], "response_lens": r.workload["response_lens"],
                    "d": r.d, "observed": r.observed} for r in records if r.k == "r" and r.observed > 0]
        trainer = [{"stage": r.workload["stage"], "prompt_lens": r.workload["prompt_lens"],
                    "response_lens": r.workload["response_lens"], "d": r.d, "observed": r.observed}
                   for r in records if r.k == "t" and r.observed > 0]
        out = {}
        if len(rollout) >= MIN_REFIT_RECORDS:
            fit = calibrate.calibrate_rollout(rollout, self.rollout)
            self.rollout, out["rollout"] = fit.model, fit.report()
        if len(trainer) >= MIN_REFIT_RECORDS:
            fit = calibrate.calibrate_trainer(trainer, self.trainer)
            self.trainer, out["trainer"] = fit.model, fit.report()
        return out

    def chunk_time(self, stage, prompt_lens, response_lens, d) -> float:
        """M_t of one chunk (memoised by the trainer model: the scheduler re-evaluates the same chunks while it
        plans, and the simulator times the chunks the scheduler predicted)."""
        return self.trainer.chunk_time(stage, prompt_lens, response_lens, d)

    def warm_chunk_times(self, stage, prompt_lens, response_lens, d, chunk_size) -> None:
        """Predict the chunks of ``chunk_size`` samples these samples cut into, together, ahead of
        :meth:`chunk_time` asking for them one by one."""
        self.trainer.warm_chunk_times(stage, prompt_lens, response_lens, d, chunk_size)

    def span_times(self, stage, prompt_lens, response_lens, starts, stops, d) -> list:
        """:meth:`chunk_time` of the chunks ``[start, stop)`` of these samples, evaluated together."""
        return self.trainer.span_times(stage, prompt_lens, response_lens, starts, stops, d)

    def span_time_bounds(self, stage, prompt_lens, response_lens, starts, stops, d) -> list:
        """Lower bounds of :meth:`chunk_time` for the chunks ``[start, stop)`` of these samples, all at once."""
        return self.trainer.span_time_bounds(stage, prompt_lens, response_lens, starts, stops, d)

    def sharing_models(self) -> "StagePredictor":
        """Another predictor on the same (immutable) models and their memo: a driver's ``truth`` when the
        coordinator starts from the presets' models too. A refit replaces this one's models, not the other's."""
        return StagePredictor(self.rollout, self.trainer, self.group_size, self.typical_context, self.step_overhead,
                              self.optimizer_updates)

    def rollout_time(self, prompt_lens, response_lens, d) -> float:
        """M_r of a request set on ``d`` replicas (whole groups dealt when it is made of whole groups)."""
        if len(response_lens) == 0:
            return 0.0
        whole = len(response_lens) % self.group_size == 0
        return float(self.rollout.stage_time(np.asarray(prompt_lens), np.asarray(response_lens), d,
                                             group_size=self.group_size if whole else 1))

    def replica_time(self, context_lens, remaining_lens, prefill) -> float:
        """One rollout replica running these requests to completion: each request's context (prompt + tokens
        held), the tokens it still needs, and whether it first prefills its context (a resumed or moved request
        recomputes its KV cache). The appendix's T_r,rep with the prefill over the flagged requests only."""
        ctx = np.asarray(context_lens, dtype=float)
        if ctx.size == 0:
            return 0.0
        rem = np.maximum(np.ceil(np.asarray(remaining_lens, dtype=float)), 0).astype(np.int64)
        ctx_i = np.rint(ctx).astype(np.int64)
        pre = np.asarray(prefill, dtype=bool)
        t = self.rollout.decode_time(ctx_i, rem)
        if pre.any():
            t += self.rollout.prefill_time(ctx_i[pre])
        return float(t)

    def replica_times(self, request_sets) -> list:
        """:meth:`replica_time` of each ``(context_lens, remaining_lens, prefill)`` set — one replica each — in one
        vectorised pass (the same numbers: a replica's features are sums and counts of its own requests)."""
        sets = [(np.asarray(c, dtype=float).reshape(-1), np.asarray(m, dtype=float).reshape(-1),
                 np.asarray(f, dtype=bool).reshape(-1)) for c, m, f in request_sets]
        if not sets:
            return []
        sizes = [c.size for c, _, _ in sets]
        ctx = np.rint(np.concatenate([c for c, _, _ in sets])).astype(np.int64)
        rem = np.maximum(np.ceil(np.concatenate([m for _, m, _ in sets])), 0).astype(np.int64)
        pre = np.concatenate([f for _, _, f in sets])
        replica = np.repeat(np.arange(len(sets), dtype=np.int64), sizes)
        t = self.rollout.decode_times(ctx, rem, replica, len(sets))
        if pre.any():
            t = t + self.rollout.prefill_times(ctx[pre], replica[pre], len(sets))
        return np.where(np.array(sizes) > 0, t, 0.0).tolist()

    def iteration_time(self, context_lens) -> float:
        """One continuous-batching decode iteration over requests with these contexts."""
        return self.rollout.decode_iteration_time(context_lens)

    def concurrent_groups(self) -> int:
        """Prompt groups one rollout replica runs at once at the workload's typical context (the engine's
        sequence cap or its KV cache, whichever binds first); later groups queue behind them."""
        return max(1, int(self.rollout.n_max(self.typical_context)) // self.group_size)

    def optimizer_time(self, trainer_gpus: int) -> float:
        """The trainer's work per local update (per step without streaming) besides its chunks: per optimizer update
        (mini-batch) the gradients averaged across the ``trainer_gpus / ρ_t`` replicas
        (:func:`gradient_allreduce_time`) and one AdamW step over each GPU's ``N/ρ_t`` shard; and the offload copies
        (:attr:`step_overhead`)."""
        return self.optimizer_updates * self.optimizer_update_time(trainer_gpus) + self.step_overhead

    def step_optimizer_time(self, trainer_gpus, local_updates: int):
        """The trainer's optimizer work of one step of ``local_updates`` local updates (``rl.updates_per_sync``) on
        ``trainer_gpus`` GPUs (or an array of trainer GPU counts: one time each): :meth:`optimizer_time` each — every mini-batch's update and the once-per-local-update costs. What the
        simulator's ``OptimizerStep`` commands of one step add up to (``Assembly.optimizer_step_time`` splits each
        local update's :meth:`optimizer_time` into its mini-batches' updates), and what the planner's M_t charges
        (§4.2), so the two cannot drift."""
        return int(local_updates) * self.optimizer_time(trainer_gpus)

    def optimizer_update_time(self, trainer_gpus: int) -> float:
        """One optimizer update (one mini-batch) on ``trainer_gpus`` GPUs of ρ_t-GPU replicas: the gradient
        all-reduce across the replicas and the AdamW step over each GPU's ``N/ρ_t`` shard."""
        return optimizer_update_time(self.trainer.model, self.trainer.hardware, self.trainer.layout, trainer_gpus)

    def engine_costs(self) -> EngineCosts:
        p = self.rollout.params
        spec, images = self.rollout.model, self.rollout.image_tokens_per_prompt
        return EngineCosts(tau_pre=p.tau_pre, alpha_pre=p.alpha_pre, tau_dec=p.tau_dec, beta_tok=p.beta_tok,
                           beta_hist=p.beta_hist,
                           prefill_flops=lambda prompts: prefill_flops(spec, prompts, images),
                           kv_tokens=int(self.rollout.kv_budget_bytes // self.rollout.kv_bytes_per_token),
                           max_seqs=self.rollout.max_seqs or MAX_SEQS, gamma_req=p.gamma_req)
