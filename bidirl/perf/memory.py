"""Per-GPU memory of one trainer or rollout replica, for the planner's minimal feasible layouts (paper §4.1).

A *layout* ρ is the number of GPUs one replica occupies: powers of two up to a node, then whole nodes
(:func:`layout_candidates`). The planner takes the smallest ρ whose per-GPU need fits in
``memory_bytes · memory_utilization`` (the minimal-replica principle of §4.1). All sizes are bytes per GPU.

Trainer replica (FSDP full sharding over its ρ GPUs, mixed precision as in veRL's FSDP workers):

* model states, sharded: ``N_total · (b_w + 4 + 4 + 8) / ρ`` — weights in the model dtype (b_w = 2 for bf16),
  fp32 gradients (veRL reduces in fp32), fp32 master weights and the two fp32 Adam moments;
* activations, not sharded (every GPU runs its own micro-batch): ``T · (b_w·(L·H + 8·H + 4·I) + 4·V)`` for
  ``T = micro_batch_per_device · max_seq_len`` tokens, where ``max_seq_len = prompt_max + max_response_len``
  of the workload. With activation checkpointing each layer keeps its input (``L·H`` per token); one layer
  is recomputed at a time (attention Q/K/V/O and norms ≈ ``8·H``, the MLP's gate/up/activation/product
  ≈ ``4·I``, FlashAttention so no ``seq²`` term); the vocabulary head materialises one fp32 logit row per
  token (``4·V``; the log-softmax is fused).

Rollout replica (vLLM, tensor parallel ``tp`` = ρ):

* weights ``N_total · b_w / tp`` (the vision encoder included);
* a prefill activation reserve: :data:`PREFILL_CHUNK_TOKENS` tokens × ``b_w·(8·H + 4·I) / tp`` (vLLM profiles
  its peak activation memory with one full chunk of batched tokens);
* the minimum KV cache: one whole GRPO group of maximum-length requests,
  ``group_size · max_seq_len · b_kv(tp)``, so a replica can always hold at least one group at full length
  (a group never has to wait for its own members to finish). The rest of the usable memory becomes the
  KV cache budget B_kv of the rollout model.
"""

from __future__ import annotations

from dataclasses import dataclass

#: tokens of one batched prefill chunk whose activations vLLM reserves (its default max_num_batched_tokens)
PREFILL_CHUNK_TOKENS = 8192
#: bytes per parameter of the trainer's optimiser-side state besides the weights: fp32 grads, master, Adam m, v
TRAIN_STATE_EXTRA_BYTES = 4 + 4 + 8


def usable_bytes(hw) -> float:
    """Memory one engine may use on a GPU: ``memory_bytes · memory_utilization``."""
    return float(hw.memory_bytes) * float(hw.memory_utilization)


def layout_candidates(gpus_per_node: int, max_gpus: int) -> list:
    """1, 2, 4, … up to ``gpus_per_node`` (powers of two), then whole nodes 2·n, 3·n, … up to ``max_gpus``."""
    if gpus_per_node < 1 or max_gpus < 1:
        raise ValueError("gpus_per_node and max_gpus must be ≥ 1")
    out, k = [], 1
    while k <= min(gpus_per_node, max_gpus):
        out.append(k)
        k *= 2
    if gpus_per_node not in out and gpus_per_node <= max_gpus:
        out.append(gpus_per_node)
    k = 2 * gpus_per_node
    while k <= max_gpus:
        out.append(k)
        k += gpus_per_node
    return out


def trainer_state_bytes(model, layout: int = 1) -> float:
    """Sharded model states of one trainer GPU: ``N_total·(b_w + 16)/ρ``."""
    return model.params_total * (model.dtype_bytes + TRAIN_STATE_EXTRA_BYTES) / layout


def trainer_activation_bytes(model, tokens: int) -> float:
    """Activations of a ``tokens``-token micro-batch on one GPU (checkpointed layers + one layer + logits)."""
    per_token = (model.dtype_bytes * (model.layers * model.hidden + 8 * model.hidden + 4 * model.intermediate)
                 + 4 * model.vocab)
    return float(tokens) * per_token


def rollout_weight_bytes(model, tp: int = 1) -> float:
    return model.params_total * model.dtype_bytes / tp


def rollout_reserve_bytes(model, tp: int = 1) -> float:
    """Prefill activation reserve of a vLLM engine (one batched-token chunk)."""
    return PREFILL_CHUNK_TOKENS * model.dtype_bytes * (8 * model.hidden + 4 * model.intermediate) / tp


def kv_budget_bytes(model, hw, tp: int = 1) -> float:
    """B_kv: what is left of the usable memory for the KV cache after weights and the reserve (≥ 0)."""
    return max(0.0, usable_bytes(hw) - rollout_weight_bytes(model, tp) - rollout_reserve_bytes(model, tp))


@dataclass(frozen=True)
class MemoryNeed:
    """One replica's per-GPU memory at layout ``layout``; ``fits`` compares ``total`` with ``usable``."""
    role: str
    layout: int
    parts: dict
    usable: float

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


def trainer_need(model, hw, layout: int, micro_batch_per_device: int, max_seq_len: int) -> MemoryNeed:
    return MemoryNeed("trainer", layout, {
        "model_states": trainer_state_bytes(model, layout),
        "activations": trainer_activation_bytes(model, micro_batch_per_device * max_seq_len),
    }, usable_bytes(hw))


def rollout_need(model, hw, tp: int, group_size: int, max_seq_len: int) -> MemoryNeed:
    return MemoryNeed("rollout", tp, {
        "weights": rollout_weight_bytes(model, tp),
        "activation_reserve": rollout_reserve_bytes(model, tp),
        "min_kv_cache": group_size * max_seq_len * model.kv_bytes_per_token(tp),
    }, usable_bytes(hw))


def min_feasible_layout(need_at, candidates) -> tuple:
    """``(ρ, need)`` for the smallest candidate ρ whose ``need_at(ρ)`` fits, else ``(None, need at the largest)``."""
    need = None
    for rho in candidates:
        need = need_at(rho)
        if need.fits:
            return rho, need
    return None, need
