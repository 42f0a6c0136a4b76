"""What a trainer's execution settings cost (issue 37): activation checkpointing, parameter / optimizer offload and
Ulysses sequence parallelism, as changes to the trainer model M_t (appendix, "Trainer Model") and to the step's
host copies. Each term is the setting's mechanism over the hardware preset's numbers; docs/architecture.md,
"Execution settings", gives each with its source and its veRL key.

* **Activation checkpointing** (``rl.activation_checkpointing: true``; veRL ``enable_gradient_checkpointing``): the
  backward pass recomputes each block's forward, so ``actor_update`` does ``m + 1 = 4`` forward-equivalents of work
  instead of ``m = 3`` (:data:`RECOMPUTE_FORWARDS`; Chen et al. 2016, arXiv:1604.06174 §4: checkpointing costs "one
  extra forward pass"; Korthikanti et al. 2022, arXiv:2205.05198 §5: full recomputation adds one forward, ≈ 33 % of
  a training step's FLOPs), with one more forward's kernel launches. ``null`` keeps today's model (no recompute
  charged; activations budgeted as checkpointed, :mod:`bidirl.perf.memory`).
* **Offload** (``rl.param_offload`` / ``rl.optimizer_offload``; veRL ``actor.fsdp_config.param_offload`` /
  ``optimizer_offload``): veRL loads the FSDP-sharded parameters onto the GPU before each actor stage
  (``compute_log_prob``, ``update_actor``) and offloads them after (``load_fsdp_model_to_gpu`` /
  ``offload_fsdp_model_to_cpu``), and the optimizer state around each update (``load_fsdp_optimizer`` /
  ``offload_fsdp_optimizer``). Each GPU copies its shard both ways over its host link at the pageable rate
  (``host_bandwidth · PAGEABLE_FRACTION`` of :mod:`bidirl.perf.costs`): parameters
  ``2 · (actor stages) · 4·N/ρ_t`` bytes (fp32 sharded master weights), optimizer ``2 · 8·N/ρ_t`` bytes
  (Adam's two fp32 moments) once around the update stage, whatever its mini-batches. The copies sit on the
  trainer's critical path; the simulator charges them with the optimizer step (:func:`offload_seconds`).
* **Sequence parallelism** (``rl.sequence_parallel`` = k; veRL ``ulysses_sequence_parallel_size``): k GPUs share
  each sample's tokens, so data parallel is trainer GPUs / k and a chunk holds ``1/k`` of the samples
  (``bidirl.core.protocol.chunk_size``); activations per GPU are divided by k (:mod:`bidirl.perf.memory`). Each
  layer's attention does all-to-alls of Q, K, V and the output: ``4·H·b`` bytes per token per layer, of which a GPU
  sends ``(k−1)/k`` of its ``1/k`` share (Jacobs et al. 2023, DeepSpeed-Ulysses, arXiv:2309.14509 §3.2:
  communication volume ``4Nh/P`` per layer), at the intra-node bandwidth; the backward pass repeats them
  (``actor_update``: twice as many; a third time when it recomputes). They are added to the stage's per-token
  cost as the time those bytes take relative to the linear layers' FLOPs per token (``2·N_nonemb``): exact for the
  linear layers, the attention's quadratic FLOPs carry no extra all-to-all (:func:`with_sequence_parallel`).
"""

from __future__ import annotations

import dataclasses

from bidirl.perf.costs import PAGEABLE_FRACTION
from bidirl.perf.flops import STAGE_MULTIPLIER, STAGES, decoder_params_nonembedding
from bidirl.perf.params import TrainerParams, knob, link_bandwidth

#: forward-equivalents of ``actor_update`` with activation checkpointing: forward + backward (3) + the recompute (1)
RECOMPUTE_FORWARDS = STAGE_MULTIPLIER["actor_update"] + 1
#: bytes per parameter of the sharded parameters veRL moves with param offload (fp32 FSDP flat parameters)
OFFLOAD_PARAM_BYTES = 4
#: bytes per parameter of the optimizer state veRL moves with optimizer offload (AdamW's fp32 exp_avg, exp_avg_sq)
OFFLOAD_OPTIMIZER_BYTES = 8
#: Ulysses all-to-alls per layer per pass move Q, K, V and the attention output: 4 hidden-size tensors per token
ULYSSES_TENSORS_PER_LAYER = 4
#: passes over the layers whose all-to-alls a stage pays: forward stages 1, the update forward + backward 2
ULYSSES_PASSES = {"old_logprob": 1, "ref_logprob": 1, "actor_update": 2}


def with_recompute(params: TrainerParams, model, hardware) -> TrainerParams:
    """``params`` with ``actor_update`` doing one more forward (activation checkpointing): α scaled by
    :data:`RECOMPUTE_FORWARDS` / m, and one more forward's kernel launches on τ
    (L · ``kernel_overhead_per_layer``)."""
    m = STAGE_MULTIPLIER["actor_update"]
    alpha, tau = dict(params.alpha), dict(params.tau)
    alpha["actor_update"] *= RECOMPUTE_FORWARDS / m
    tau["actor_update"] += model.layers * knob(hardware, "kernel_overhead_per_layer")
    return dataclasses.replace(params, alpha=alpha, tau=tau)


def all_to_all_seconds_per_token(model, hardware, degree: int, stage: str, recompute: bool = False) -> float:
    """Seconds of Ulysses all-to-all per token a GPU holds, for one micro-batch of ``stage`` at degree ``degree``:
    ``passes · 4·L·H·b · (k−1)/k`` bytes over the intra-node link (module doc; 0 at degree 1)."""
    if degree <= 1:
        return 0.0
    passes = ULYSSES_PASSES[stage] + (1 if recompute and stage == "actor_update" else 0)
    sent = passes * ULYSSES_TENSORS_PER_LAYER * model.layers * model.hidden * model.dtype_bytes * (degree - 1) / degree
    return float(sent / link_bandwidth(hardware, degree))


def with_sequence_parallel(params: TrainerParams, model, hardware, degree: int, layout: int,
                           recompute: bool = False) -> TrainerParams:
    """``params`` with each stage's α raised by Ulysses' all-to-all time: a replica micro-batch of T tokens puts
    T/ρ on each GPU, whose all-to-alls take ``T/ρ ·`` :func:`all_to_all_seconds_per_token`; over the linear layers'
    ``2·N_nonemb · m_s · T`` FLOPs that is ``Δα = seconds_per_token / (ρ · 2·N_nonemb · m_s)`` per FLOP."""
    if degree <= 1:
        return params
    return with_all_to_all_time(params, model, layout, recompute,
                                lambda s: all_to_all_seconds_per_token(model, hardware, degree, s, recompute))


def with_all_to_all_time(params: TrainerParams, model, layout: int, recompute: bool,
                         seconds_per_token) -> TrainerParams:
    """``params`` with each stage's α raised by an all-to-all of ``seconds_per_token(stage)`` per token on a GPU:
    a replica micro-batch of T tokens puts T/ρ on each GPU, over the linear layers' ``2·N_act · m_s · T`` FLOPs,
    so ``Δα = seconds_per_token / (ρ · 2·N_act · m_s)`` per FLOP (Ulysses' and expert parallelism's all-to-alls
    alike; the attention's quadratic FLOPs carry none). ``N_act`` is the decoder's
    (:func:`bidirl.perf.flops.decoder_params_nonembedding`): a vision encoder's parameters are not charged per
    token."""
    alpha = dict(params.alpha)
    for s in STAGES:
        multiplier = STAGE_MULTIPLIER[s] + (1 if recompute and s == "actor_update" else 0)
        alpha[s] += seconds_per_token(s) / (layout * 2.0 * decoder_params_nonembedding(model) * multiplier)
    return dataclasses.replace(params, alpha=alpha)


def offload_seconds(model, hardware, layout: int, stages, param_offload: bool, optimizer_offload: bool) -> float:
    """Seconds per local update of offload copies on a trainer GPU of a ρ_t = ``layout`` replica (module doc): the
    sharded parameters in and out around each actor stage (``old_logprob``, ``actor_update``; the reference model
    is a separate worker), the optimizer state in and out around the ``actor_update`` stage — once, whatever its
    mini-batches: veRL's ``update_actor`` calls ``load_fsdp_optimizer`` before ``update_policy`` runs every
    mini-batch and ``offload_fsdp_optimizer`` after (``verl/workers/fsdp_workers.py``)."""
    rate = float(hardware.host_bandwidth) * PAGEABLE_FRACTION
    seconds = 0.0
    if param_offload:
        actor_stages = sum(1 for s in stages if s in ("old_logprob", "actor_update"))
        seconds += 2 * actor_stages * OFFLOAD_PARAM_BYTES * model.params_total / layout / rate
    if optimizer_offload:
        seconds += 2 * OFFLOAD_OPTIMIZER_BYTES * model.params_total / layout / rate
    return seconds
