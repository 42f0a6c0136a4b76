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

Both roles on one GPU (hot switching, §3.2: each pool hosts a primary role and the other role's borrowing
worker, on the same GPUs, one of them switched out at a time). The real runtime's rollouter gets its KV
cache from :func:`colocated_kv_limit`, so that what the two roles hold together fits ``usable``:

* a rollouter awake: ``W_r + A_r + B_kv + T_beside ≤ usable``, where ``T_beside`` is the most the trainer
  rank on the same GPU holds while the rollouter may be awake — :func:`trainer_load_bytes`, its unsharded fp32
  weights (and the reference model) while it loads at start or restart, before its gang shards them; a
  switched-out trainer rank holds nothing on the GPU (its offload moves weights, gradients and AdamW state
  to host memory and frees the device copies);
* a trainer active: ``trainer need + R_r ≤ usable``, where ``R_r`` is what a switched-out rollouter keeps
  (:func:`rollout_asleep_bytes`: vLLM's level-2 sleep discards weights and KV cache; the activation
  workspace stays).

CUDA contexts, CUDA-graph pools and allocator fragmentation of the two processes live in the
``1 − memory_utilization`` share left out of ``usable`` (e.g. 12 GiB of an 80 GiB H100 at 0.85).
"""

from __future__ import annotations

from dataclasses import dataclass

#: tokens of one batched prefill chunk whose activations vLLM reserves (its default max_num_batched_tokens)
PREFILL_CHUNK_TOKENS = 8192
#: bytes per parameter of the trainer's optimiser-side state besides the weights: fp32 grads, master, Adam m, v
TRAIN_STATE_EXTRA_BYTES = 4 + 4 + 8
#: bytes per parameter of the unsharded fp32 weights a trainer rank loads on its device before its gang shards
#: them (``TrainerEngine._load_model``: fp32 master weights)
TRAINER_LOAD_BYTES = 4
#: tokens per KV-cache block of vLLM 0.32 by engine device, when the engine is given none: 16 on CUDA (the
#: CacheConfig default), 128 on CPU (``vllm.platforms.cpu`` sets it). vLLM holds a sequence in whole blocks.
KV_BLOCK_TOKENS = {"cuda": 16, "cpu": 128}


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


#: bytes of activations per token per transformer layer kept for the backward pass without checkpointing, in
#: units of the hidden size: ``34·H`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
#: Transformer Models", arXiv:2205.05198 §4.1, Eq. 1: ``sbh(34 + 5as/h)`` bytes per layer in 16-bit, whose
#: ``5as/h`` attention-score term FlashAttention removes)
UNCHECKPOINTED_BYTES_PER_HIDDEN = 34


def micro_batch_tokens(cfg, max_seq_len: int) -> float:
    """Tokens of one trainer micro-batch on one GPU: ``rl.max_tokens_per_micro_batch`` when the job packs by
    tokens (veRL's ``ppo_max_token_len_per_gpu``: the budget is per GPU, with or without sequence parallelism), else
    ``micro_batch_per_device · max_seq_len / rl.sequence_parallel`` (Ulysses splits each sample's tokens over the
    group's GPUs)."""
    r = cfg.rl
    if r.max_tokens_per_micro_batch is not None:
        return float(r.max_tokens_per_micro_batch)
    return r.micro_batch_per_device * max_seq_len / r.sequence_parallel


def trainer_activation_bytes(model, tokens: int, checkpointing=None) -> float:
    """Activations of a ``tokens``-token micro-batch on one GPU (checkpointed layers + one layer + logits).
    ``checkpointing`` False (``rl.activation_checkpointing: false``): every layer keeps its activations,
    :data:`UNCHECKPOINTED_BYTES_PER_HIDDEN` · H bytes per token per layer, plus the fp32 logits; None or True: the
    checkpointed form above (today's budget)."""
    if checkpointing is False:
        per_token = UNCHECKPOINTED_BYTES_PER_HIDDEN * model.layers * model.hidden + 4 * model.vocab
        return float(tokens) * per_token
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


def trainer_load_bytes(model, reference_bytes: int = 0) -> float:
    """What a trainer rank holds on its device while it loads (start, restart): ``N_total · 4`` unsharded fp32
    weights, plus ``N_total · reference_bytes`` for a reference model (0: none; 2: bf16 on a bf16-mixed engine)."""
    return model.params_total * (TRAINER_LOAD_BYTES + reference_bytes)


def rollout_asleep_bytes(model, tp: int = 1, device: str = "cuda") -> float:
    """What a switched-out rollouter keeps on its device: on CUDA the activation reserve (vLLM's level-2 sleep
    discards the weights and the KV cache); on CPU, where vLLM has no sleep mode and only the KV cache is freed,
    the weights as well."""
    if device == "cpu":
        return rollout_weight_bytes(model, tp) + rollout_reserve_bytes(model, tp)
    return rollout_reserve_bytes(model, tp)


def colocated_kv_limit(model, hw, tp: int, trainer_beside: float) -> float:
    """The largest KV cache per GPU for which an awake rollouter and the trainer rank beside it fit ``usable``
    (module docstring): ``usable − W_r − A_r − T_beside`` (may be negative: nothing fits)."""
    return usable_bytes(hw) - rollout_weight_bytes(model, tp) - rollout_reserve_bytes(model, tp) - trainer_beside


def attention_kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """b_kv of a checkpoint on one GPU of a ``tp``-way replica: ``layers · kv_heads_per_gpu · head_dim · 2 · b``
    (keys and values), where a GPU holds ``⌊kv_heads / tp⌋`` KV heads, or one replicated when ``tp > kv_heads``
    (vLLM's tensor-parallel attention)."""
    return int(layers) * max(1, int(kv_heads) // int(tp)) * int(head_dim) * 2 * int(dtype_bytes)


def sequence_blocks(tokens: int, block_tokens: int) -> int:
    """Whole KV blocks one sequence of ``tokens`` tokens occupies: ``⌈tokens / block_tokens⌉``."""
    return -(-int(tokens) // int(block_tokens))


def kv_cache_tokens(budget_bytes: float, bytes_per_token: float, block_tokens: int) -> int:
    """Tokens a KV cache of ``budget_bytes`` holds, in whole blocks of ``block_tokens`` (vLLM's paging:
    ``⌊B / (block · b_kv)⌋`` blocks, each shared by all layers' pages)."""
    if budget_bytes <= 0:
        return 0
    return int(budget_bytes // (block_tokens * bytes_per_token)) * int(block_tokens)


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


def trainer_need(model, hw, layout: int, micro_batch_per_device: int, max_seq_len: int, *, tokens=None,
                 checkpointing=None) -> MemoryNeed:
    """A trainer GPU's memory: sharded model states and one micro-batch's activations (``tokens`` per GPU when
    given, else ``micro_batch_per_device · max_seq_len``). Parameter / optimizer offload (``rl.param_offload``,
    ``rl.optimizer_offload``) does not lower this peak: veRL loads the states onto the GPU before a stage computes
    and offloads them after, so they are all there while it runs; offload frees the GPU between stages."""
    tokens = micro_batch_per_device * max_seq_len if tokens is None else tokens
    return MemoryNeed("trainer", layout, {
        "model_states": trainer_state_bytes(model, layout),
        "activations": trainer_activation_bytes(model, tokens, checkpointing),
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
