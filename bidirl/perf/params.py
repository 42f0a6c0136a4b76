"""Default stage-time model parameters derived from a hardware preset's specifications.

These are priors: :mod:`bidirl.perf.calibrate` refits them from profiling records (paper §5.1, online
profiler; appendix: "τ_s, α_s and r_s are calibrated from profiling runs"). Every number below is either a
datasheet value times an achieved-efficiency factor from the hardware preset (``train_mfu``,
``prefill_mfu``, ``decode_mbu``, whose sources the preset lists) or one of the few named overhead
constants, each stated as an assumption.

Trainer, for a replica of ρ = ``layout`` GPUs (FSDP data parallel inside the replica; each GPU runs
``micro_batch_per_device`` samples, so the replica computes at ρ times one GPU's rate):

* ``alpha_s = 1 / (ρ · peak_flops · train_mfu)`` seconds per FLOP, every stage;
* ``tau_s = m_s · L · KERNEL_OVERHEAD_PER_LAYER`` — eager PyTorch launches ≈20 kernels per layer per pass,
  ≈10 µs each;
* ``alpha_comm_s = k_s · L · collective latency`` with ``k_s`` collectives per layer (1 all-gather for the
  forward stages; all-gather, all-gather, reduce-scatter for the update); 0 for ρ = 1 (no collectives);
* ``beta_comm_s = 1 / link bandwidth`` (intra-node for ρ ≤ gpus_per_node, else inter-node);
* ``r_s = 2`` (partial overlap of FSDP prefetch with compute).

Rollout, for a vLLM replica with tensor parallelism ``tp`` (the decoder only: the vision encoder runs in
prefill and is inside N_nonemb there):

* ``alpha_pre = 1 / (tp · peak_flops · prefill_mfu)``;
* ``tau_pre = L · KERNEL_OVERHEAD_PER_LAYER + SCHEDULER_OVERHEAD`` per prefill wave (prefill is not
  CUDA-graphed);
* ``tau_dec = decoder weight bytes / (tp · memory_bandwidth · decode_mbu) + SCHEDULER_OVERHEAD`` — every decode
  iteration streams the weights once; the scheduler/sampler step is the overhead;
* ``beta_tok = (2·N_dec + 2·H·V) / (tp · peak_flops · prefill_mfu)`` — the per-token matmul FLOPs of the
  decoder (``N_dec = N_nonemb − vision params``) and the head;
* ``beta_hist = b_kv(tp) / (memory_bandwidth · decode_mbu) + 4·L·H / (tp · peak_flops · prefill_mfu)`` — every
  context token's KV cache is read once per iteration, plus its attention FLOPs;
* ``c_pre``, ``c_dec``: seconds per prompt / generated token of tensor-parallel communication,
  ``2·L`` all-reduces of ``H·b_dtype`` bytes per token moving ``2(tp−1)/tp`` of the message over the link;
  0 for ``tp = 1``. The appendix names C_pre and C_dec without a form; this package uses
  ``C_pre = c_pre·Σp`` and ``C_dec = c_dec·N_tok`` (see :mod:`bidirl.perf.rollout`).
* ``r = 2``.
"""

from __future__ import annotations

from bidirl.perf.flops import STAGE_MULTIPLIER, STAGES

#: seconds of kernel-launch overhead per layer per forward pass (≈20 kernels × ≈10 µs, eager PyTorch)
KERNEL_OVERHEAD_PER_LAYER = 2.0e-4
#: seconds of engine-side work per prefill wave / decode iteration (vLLM scheduler, sampler, graph replay)
SCHEDULER_OVERHEAD = 1.0e-3
#: latency of one NCCL collective inside a node / across nodes (seconds)
COLLECTIVE_LATENCY_INTRA = 3.0e-5
COLLECTIVE_LATENCY_INTER = 1.0e-4
#: FSDP collectives per layer per micro-batch: forward all-gather; update adds the backward all-gather and
#: the gradient reduce-scatter
COLLECTIVES_PER_LAYER = {"old_logprob": 1, "ref_logprob": 1, "actor_update": 3}
#: default p-norm overlap exponent (appendix: fitted; 1 = no overlap, ∞ = perfect overlap)
DEFAULT_OVERLAP_R = 2.0


def _check_layout(layout, name):
    if isinstance(layout, bool) or int(layout) != layout or layout < 1:
        raise ValueError(f"{name} must be a whole number of GPUs ≥ 1, got {layout!r}")
    return int(layout)


def link_bandwidth(hw, gpus: int) -> float:
    """The collective bandwidth of a ``gpus``-GPU group: intra-node if it fits in one node, else inter-node."""
    return hw.intra_node_bandwidth if gpus <= hw.gpus_per_node else hw.inter_node_bandwidth


def collective_latency(hw, gpus: int) -> float:
    return COLLECTIVE_LATENCY_INTRA if gpus <= hw.gpus_per_node else COLLECTIVE_LATENCY_INTER


def default_trainer_params(model, hw, layout: int = 1):
    """:class:`~bidirl.perf.trainer.TrainerParams` for ``model`` on ``hw`` with ρ = ``layout`` GPUs per replica."""
    from bidirl.perf.trainer import TrainerParams
    rho = _check_layout(layout, "layout")
    alpha = 1.0 / (rho * hw.peak_flops * hw.train_mfu)
    lat = collective_latency(hw, rho) if rho > 1 else 0.0
    return TrainerParams(
        tau={s: STAGE_MULTIPLIER[s] * model.layers * KERNEL_OVERHEAD_PER_LAYER for s in STAGES},
        alpha={s: alpha for s in STAGES},
        r={s: DEFAULT_OVERLAP_R for s in STAGES},
        alpha_comm={s: COLLECTIVES_PER_LAYER[s] * model.layers * lat for s in STAGES},
        beta_comm={s: 1.0 / link_bandwidth(hw, rho) for s in STAGES},
    )


def default_rollout_params(model, hw, tp: int = 1):
    """:class:`~bidirl.perf.rollout.RolloutParams` for ``model`` on ``hw`` with tensor parallelism ``tp``."""
    from bidirl.perf.rollout import RolloutParams
    tp = _check_layout(tp, "tp")
    compute = tp * hw.peak_flops * hw.prefill_mfu
    decoder_params = model.params_total - model.vision_params
    decoder_nonemb = max(model.params_nonembedding - model.vision_params, 0.0)
    if tp > 1:
        per_token_bytes = 2 * model.layers * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp
        c_tok = per_token_bytes / link_bandwidth(hw, tp)
    else:
        c_tok = 0.0
    return RolloutParams(
        tau_pre=model.layers * KERNEL_OVERHEAD_PER_LAYER + SCHEDULER_OVERHEAD,
        alpha_pre=1.0 / compute,
        tau_dec=decoder_params * model.dtype_bytes / (tp * hw.memory_bandwidth * hw.decode_mbu) + SCHEDULER_OVERHEAD,
        beta_tok=(2.0 * decoder_nonemb + 2.0 * model.hidden * model.vocab) / compute,
        beta_hist=(model.kv_bytes_per_token(tp) / (hw.memory_bandwidth * hw.decode_mbu)
                   + 4.0 * model.layers * model.hidden / compute),
        r=DEFAULT_OVERLAP_R,
        c_pre=c_tok,
        c_dec=c_tok,
    )
