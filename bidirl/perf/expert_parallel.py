"""Expert parallelism (EP) as a layout dimension of MoE replicas (docs/architecture.md, "MoE"; paper §4.1's layouts).

A replica of ρ GPUs may shard an MoE model's routed experts over an *EP group* of ``ep`` GPUs (veRL's rollout
``expert_parallel_size``, vLLM's ``enable_expert_parallel``, Megatron's ``expert_model_parallel_size``): EP rank
``i`` holds whole experts ``[i·E/ep, (i+1)·E/ep)`` of every MoE layer, and a token is sent to the GPUs that hold its
k experts and back (dispatch and combine all-to-alls). GPU ``g`` of a replica is EP rank ``g mod ep`` of EP group
``⌊g / ep⌋``; the ρ/ep GPUs with the same EP rank (the *expert-data-parallel* group, Megatron's EDP) hold the same
experts.

**Trainer (FSDP2 + EP, as torchtitan and veRL's FSDP engines lay it out).** The non-expert parameters are sharded
over the replica's ρ GPUs; an EP rank's experts are sharded over its EDP group of ρ/ep GPUs. Either way each GPU
keeps ``1/ρ`` of every parameter class, so the model states per GPU (``perf.memory``'s ``N·(b_w + 16)/ρ``) do not
change with ``ep`` (:func:`expert_params_per_gpu`; EP conserves the expert parameters, a property test). What
changes is what a micro-batch moves:

* **FSDP gathers** (:func:`fsdp_message_bytes`): a forward pass all-gathers the non-expert parameters over the ρ
  GPUs, ``W_ne·(ρ−1)/ρ`` bytes per GPU, and only its own experts over the EDP group, ``(W_e/ep)·(ρ/ep − 1)/(ρ/ep)``
  — where FSDP alone gathers all ``W_e`` of them; the update adds the backward gather and the fp32 reduce-scatter;
* **all-to-alls** (:func:`all_to_all_seconds_per_token`): each MoE layer's forward dispatches every token's hidden
  state to its k experts and combines the k results back, ``k·H·b`` bytes per token each way (Megatron-LM's
  ``alltoall`` token dispatcher permutes one copy per selected expert, ``moe/token_dispatcher.py``), of which
  ``(ep − 1)/ep`` leaves the GPU under uniform routing; the backward pass does both again and a recomputing
  backward a third time (:data:`A2A_PASSES`).

**Bandwidths** (the hardware preset's ``intra_node_bandwidth``, per GPU and direction, and
``inter_node_bandwidth``, the per-GPU share of the node's network, whose sources the presets list):

* a collective over ρ GPUs that fit in a node runs at the intra-node bandwidth;
* a ring over ρ > ``gpus_per_node`` contiguous GPUs crosses each node boundary once per ring channel, NCCL
  spreading its channels over the node's NICs, so its bus bandwidth is bounded by the slowest link of the ring:
  ``min(intra, gpus_per_node · inter)`` (:func:`bidirl.perf.params.ring_bandwidth`; NVIDIA nccl-tests
  ``doc/PERFORMANCE.md``: bus bandwidth is the figure to compare with the hardware's peak link bandwidth);
* the EDP groups of a replica that spans nodes are strided: ``min(ep, gpus_per_node)`` of them run at once and
  share each node's network, ``min(intra, gpus_per_node · inter / min(ep, gpus_per_node))`` each
  (:func:`edp_bandwidth`; at ep = 1 the ring's bandwidth);
* an all-to-all sends ``(min(ep, n) − 1)/ep`` of its bytes over NVLink and ``max(0, ep − n)/ep`` over the network
  (n = ``gpus_per_node``, an EP group of whole nodes), both links at once: the slower share sets the time.

**Rollout (vLLM).** A rollout replica is one tensor-parallel engine (data parallel 1); veRL requires its
``expert_parallel_size`` to be 1 or ``tensor_model_parallel_size × data_parallel_size`` (``RolloutConfig``), so
``ep_r`` ∈ {1, ρ_r}. vLLM uses all-to-all kernels only with data-parallel attention (``dp_size > 1``); at data
parallel 1 every GPU already holds every token after attention's all-reduce, runs its own experts on them and the
MoE output is all-reduced as under TP. The weight bytes per GPU are ``N/ρ_r`` either way, so rollout EP changes
neither memory nor time in these models (:func:`rollout_expert_parallel_sizes`).

**Hot-switch compatibility** (§4.1 ``Compatible``) with EP: an EP group lies inside its replica (``ep | ρ``,
``ep | E``, and an EP group wider than a node is whole nodes), so a pool holding whole replicas of both roles holds
whole EP groups of both. A GPU's trainer and rollout workers each keep their own role's expert shard, and a switch
offloads and loads the GPU's own state only: the two roles' EP degrees may differ without constraining the split
(:func:`compatible`). What a difference costs is in the weight sync, which gathers whole tensors on the trainer
side in any case (``perf.costs``).
"""

from __future__ import annotations

import numpy as np

from bidirl.perf.execution import with_all_to_all_time
from bidirl.perf.flops import STAGE_MULTIPLIER, STAGES
from bidirl.perf.params import ring_bandwidth

#: all-to-alls per MoE layer per pass: dispatch (tokens to their experts) and combine (results back)
A2A_PER_PASS = 2
#: passes over the MoE layers whose all-to-alls a stage pays: forward stages 1, the update forward + backward 2
#: (a recomputing backward one more: :func:`all_to_all_seconds_per_token`)
A2A_PASSES = {"old_logprob": 1, "ref_logprob": 1, "actor_update": 2}
#: bytes per parameter of the update's gradient reduce-scatter (fp32, ``perf.trainer``'s message)
GRAD_BYTES = 4


def _whole(value, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be a whole number ≥ {low}, got {value!r}")
    return int(value)


def ep_problem(model, layout: int, ep: int, gpus_per_node: int) -> str:
    """Why an EP group of ``ep`` GPUs cannot shard ``model``'s experts in a replica of ``layout`` GPUs ('' if it
    can): it must divide the replica and the expert count, and an EP group wider than a node must be whole
    nodes."""
    layout, ep, gpn = _whole(layout, "layout"), _whole(ep, "expert_parallel"), _whole(gpus_per_node, "gpus_per_node")
    if ep == 1:
        return ""
    if not model.is_moe:
        return f"{model.name} is a dense model (no experts to shard)"
    if layout % ep:
        return f"{ep} does not divide the replica's {layout} GPUs (an EP group lies inside one replica)"
    if model.experts % ep:
        return f"{ep} does not divide {model.name}'s {model.experts} experts (each EP rank holds whole experts)"
    if ep > gpn and ep % gpn:
        return f"an EP group of {ep} GPUs spans nodes but is not whole nodes of {gpn} GPUs"
    return ""


def expert_parallel_sizes(model, layout: int, gpus_per_node: int) -> list:
    """The EP degrees a trainer replica of ``layout`` GPUs may use: 1 and every divisor of the replica that passes
    :func:`ep_problem`, increasing ([1] for a dense model)."""
    layout = _whole(layout, "layout")
    return [ep for ep in range(1, layout + 1) if layout % ep == 0 and not ep_problem(model, layout, ep, gpus_per_node)]


def rollout_expert_parallel_sizes(model, tp: int) -> list:
    """A rollout replica's EP degrees: 1, and its tensor-parallel degree when that divides the experts (veRL: 1 or
    ``tensor_model_parallel_size × data_parallel_size``, data parallel 1 here)."""
    tp = _whole(tp, "tp")
    return [1] + ([tp] if tp > 1 and model.is_moe and model.experts % tp == 0 else [])


def experts_of_rank(model, ep: int, rank: int) -> range:
    """The experts (of every MoE layer) EP rank ``rank`` of ``ep`` holds: ``[rank·E/ep, (rank+1)·E/ep)``."""
    ep = _whole(ep, "expert_parallel")
    if model.experts % ep or not 0 <= rank < ep:
        raise ValueError(f"EP rank {rank} of {ep} cannot hold whole experts of {model.experts}")
    per = model.experts // ep
    return range(rank * per, (rank + 1) * per)


def expert_params_per_gpu(model, layout: int, ep: int) -> np.ndarray:
    """Routed-expert parameters each GPU of a trainer replica keeps (length ``layout``): GPU g is EP rank g mod ep,
    whose experts are sharded over its EDP group of layout/ep GPUs — ``routed / layout`` each, whatever ``ep``."""
    layout, ep = _whole(layout, "layout"), _whole(ep, "expert_parallel")
    if layout % ep:
        raise ValueError(f"expert_parallel {ep} does not divide layout {layout}")
    edp = layout // ep
    held = np.array([len(experts_of_rank(model, ep, g % ep)) * model.moe_layers * model.expert_params
                     for g in range(layout)], dtype=float) if model.is_moe else np.zeros(layout)
    return held / edp


def edp_bandwidth(hw, layout: int, ep: int) -> float:
    """Bandwidth of one expert-data-parallel group's ring in a replica of ``layout`` GPUs with EP ``ep`` (module
    doc): intra-node inside a node, else the node's network shared by the ``min(ep, n)`` groups running at once."""
    layout, ep, n = _whole(layout, "layout"), _whole(ep, "expert_parallel"), int(hw.gpus_per_node)
    if layout <= n:
        return float(hw.intra_node_bandwidth)
    return min(float(hw.intra_node_bandwidth), n * float(hw.inter_node_bandwidth) / min(ep, n))


def fsdp_message_bytes(model, hw, layout: int, ep: int, stage: str) -> float:
    """n_s(b) of :class:`~bidirl.perf.trainer.TrainerModel` with EP ``ep``: the bytes one GPU moves in the FSDP
    collectives of one micro-batch of ``stage``, the experts' share weighted by ``ring / edp`` bandwidth so that the
    whole is timed at the replica's ring bandwidth (``β_comm``). At ep = 1: ``W·(ρ−1)/ρ`` for a forward stage and
    ``(2·W + 4·N)·(ρ−1)/ρ`` for the update (``W = N·b_w``), the dense form."""
    layout, ep = _whole(layout, "layout"), _whole(ep, "expert_parallel")
    if stage not in STAGE_MULTIPLIER:
        raise ValueError(f"unknown trainer stage {stage!r}; use one of {', '.join(STAGES)}")
    per_param = (2 * model.dtype_bytes + GRAD_BYTES) if stage == "actor_update" else model.dtype_bytes
    experts = float(model.routed_expert_params)
    rest = float(model.params_total) - experts
    edp = layout // ep
    shared = rest * (layout - 1) / layout
    own = experts / ep * (edp - 1) / edp * ring_bandwidth(hw, layout) / edp_bandwidth(hw, layout, ep)
    return per_param * (shared + own)


def all_to_all_seconds_per_token(model, hw, ep: int, stage: str, recompute: bool = False) -> float:
    """Seconds of EP all-to-all per token a GPU holds, for one micro-batch of ``stage`` (module doc): ``passes ·
    2 · n_moe · k·H·b`` bytes, ``(min(ep, n) − 1)/ep`` of them over NVLink and ``max(0, ep − n)/ep`` over the
    network, both at once; 0 at ep = 1 or for a dense model."""
    ep, n = _whole(ep, "expert_parallel"), int(hw.gpus_per_node)
    if ep == 1 or not model.is_moe:
        return 0.0
    passes = A2A_PASSES[stage] + (1 if recompute and stage == "actor_update" else 0)
    moved = passes * A2A_PER_PASS * model.moe_layers * model.experts_per_token * model.hidden * model.dtype_bytes
    on_node = moved * (min(ep, n) - 1) / ep / float(hw.intra_node_bandwidth)
    off_node = moved * max(0, ep - n) / ep / float(hw.inter_node_bandwidth)
    return float(max(on_node, off_node))


def with_expert_parallel(params, model, hw, ep: int, layout: int, recompute: bool = False):
    """``params`` (:class:`~bidirl.perf.params.TrainerParams`) with each stage's α raised by the EP all-to-alls, as
    Ulysses' are (``perf.execution.with_sequence_parallel``): a replica micro-batch of T tokens puts T/ρ on each GPU,
    whose all-to-alls take ``T/ρ ·`` :func:`all_to_all_seconds_per_token`; over the linear layers' ``2·N_act · m_s ·
    T`` FLOPs that is ``Δα = seconds_per_token / (ρ · 2·N_act · m_s)`` per FLOP — exact for the linear layers, the
    attention's quadratic FLOPs carry none. They add to the compute side: a token's experts cannot run before its
    dispatch, so they do not overlap it."""
    if ep == 1 or not model.is_moe:
        return params
    return with_all_to_all_time(params, model, layout, recompute,
                                lambda s: all_to_all_seconds_per_token(model, hw, ep, s, recompute))


def compatible(rollout_gpus: int, trainer_gpus: int, rollout_layout: int, trainer_layout: int,
               rollout_ep: int = 1, trainer_ep: int = 1) -> bool:
    """§4.1's Compatible with EP (module doc): each pool holds whole replicas of both roles, and each role's EP
    group lies inside its replica; the two roles' EP degrees need not agree."""
    if rollout_layout % rollout_ep or trainer_layout % trainer_ep:
        return False
    return all(g > 0 and g % rho == 0 for g in (rollout_gpus, trainer_gpus) for rho in (rollout_layout, trainer_layout))


def unsharded_block_params(model, ep: int) -> float:
    """Parameters FSDP unshards for one transformer block of an MoE replica with EP ``ep``: the block's non-expert
    parameters and its EP rank's ``E/ep`` experts (all E without EP) — the working set a gather brings in."""
    ep = _whole(ep, "expert_parallel")
    experts = float(model.routed_expert_params)
    root = model.vocab * model.hidden * (1 if model.tie_word_embeddings else 2)
    rest = max(0.0, float(model.params_total) - experts - root)
    return (rest + experts / ep) / max(1, model.layers)
