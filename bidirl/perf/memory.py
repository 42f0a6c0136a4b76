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

Engine runs (paper §3.2, §5): the "trainer need" above counts model states and activations, as the planner's
replica sizing does; what a primary trainer rank of the real runtime keeps on its GPU — published weight versions,
auxiliary windows, the optimizer step's temporaries, FSDP2's unsharded blocks, the transport's buckets, the
sleeping rollouter beside it — is :class:`DeviceBudget` (:func:`device_budget`), which an engine run checks before
any actor starts (``bidirl.job.planner.check_device_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


#: bytes per vocabulary entry of a token's logits in the trainer: fp32 (registered with its source as
#: :data:`bidirl.perf.costs.LOGIT_BYTES`, which this lower module cannot import)
LOGIT_BYTES = 4


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
        per_token = UNCHECKPOINTED_BYTES_PER_HIDDEN * model.layers * model.hidden + LOGIT_BYTES * model.vocab
        return float(tokens) * per_token
    per_token = (model.dtype_bytes * (model.layers * model.hidden + 8 * model.hidden
                                      + 4 * model.mlp_intermediate_per_token)
                 + LOGIT_BYTES * model.vocab)
    return float(tokens) * per_token


def rollout_weight_bytes(model, tp: int = 1) -> float:
    return model.params_total * model.dtype_bytes / tp


def rollout_reserve_bytes(model, tp: int = 1) -> float:
    """Prefill activation reserve of a vLLM engine (one batched-token chunk)."""
    return PREFILL_CHUNK_TOKENS * model.dtype_bytes * (8 * model.hidden + 4 * model.mlp_intermediate_per_token) / tp


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


# --------------------------------------------------------------------------------------------------
# the device budget of one trainer-pool GPU slot in an engine run (everything the engines keep there)
# --------------------------------------------------------------------------------------------------

#: bytes per parameter of the engine's trained weights: fp32 master weights (``TrainerEngine._load_model``)
ENGINE_WEIGHT_BYTES = 4
#: bytes per parameter of a gradient shard: fp32 (``MixedPrecisionPolicy(reduce_dtype=float32)``; ``p.grad`` has the
#: parameter's fp32 dtype), and of a received auxiliary window's shard (``bridge.receive_shard``: fp32)
ENGINE_GRAD_BYTES = 4
#: bytes per parameter of AdamW's two moments, ``exp_avg`` and ``exp_avg_sq`` (``torch.optim.AdamW``: the
#: parameter's dtype, fp32)
ADAMW_MOMENT_BYTES = 8
#: published versions a primary rank keeps between steps: the new one and the one it held before
#: (``WeightSync.snapshot_spec``: ``keep=[before]``; ``TrainerEngine.publish`` drops the others)
PUBLISHED_KEPT = 2
#: one more published version at times: the one ``TrainerEngine.publish`` casts while the two kept ones are still
#: held, or a dropped one a send in flight still reads (``publish`` builds a new dict; a send keeps the one it began
#: with)
PUBLISHED_TRANSIENT = 1
#: FSDP2 unshards one transformer block ahead of the one computing (its default forward/backward prefetch)
FSDP_PREFETCH_BLOCKS = 2

#: the phases of a primary trainer rank's cycle and the terms each holds at once (:class:`DeviceBudget`)
BUDGET_PHASES = {
    # a chunk's forward + backward (``chunk_gradients(accumulate=True)``); windows may arrive beside it
    # (``receive_window``) and a send of a published version may gather beside it (``send_weights``)
    "chunk": ("weights", "gradients", "optimizer_state", "reference", "published_versions", "window_shards",
              "order_buffers", "activations", "fsdp_unsharded", "transport_buckets", "rollout_beside",
              "offload_buffer"),
    # the optimizer step (``apply``): the windows and the sum's clone are alive through ``optimizer.step()``
    "apply": ("weights", "gradients", "optimizer_state", "reference", "published_versions", "window_shards",
              "order_buffers", "apply_sum", "optimizer_step", "transport_buckets", "rollout_beside",
              "offload_buffer"),
}


@dataclass(frozen=True)
class DeviceBudget:
    """What one primary trainer rank of an engine run keeps on its GPU, term by term (bytes), and the usable memory
    it must fit (paper §3.2: the slot also holds the trainer pool's borrowing rollouter, asleep while the trainer
    computes; §4.1's minimal feasible layouts). Each term mirrors the code that allocates it:

    * ``weights`` — fp32 master weights, sharded over the replica's ρ GPUs (``TrainerEngine._load_model``, FSDP2
      ``fully_shard``): ``4·N/ρ``;
    * ``gradients`` — the step's accumulated gradient shard, fp32 (``chunk_gradients(accumulate=True)``): ``4·N/ρ``;
    * ``optimizer_state`` — AdamW's ``exp_avg`` and ``exp_avg_sq`` (``torch.optim.AdamW``, fp32): ``8·N/ρ``; with
      ``rl.optimizer_offload`` they live in host memory from the end of one optimizer step to the start of the next
      (``TrainerEngine``'s ``state_offload``), so only the ``apply`` phase holds them (:meth:`phases`);
    * ``reference`` — the frozen reference model when ``kl_coef > 0``, in the compute dtype
      (``_load_model(frozen=True)``: bf16 on a bf16-mixed engine, fp32 otherwise): ``b_c·N/ρ``;
    * ``published_versions`` — the versions the weight transport sends from, in the wire dtype, on the device
      (``TrainerEngine.publish``): ``(PUBLISHED_KEPT + PUBLISHED_TRANSIENT)·b_wire·N/ρ``; 0 on the object-store path;
    * ``window_shards`` — one fp32 shard per auxiliary window received and kept until ``apply``
      (``TrainerEngine.receive_window``): ``windows·4·N/ρ``;
    * ``order_buffers`` — the reproducible mode (``rl.reproducible``) sums the step's gradient in unit order
      (``trainer/ordered_sum.py``): the auxiliary gang's update chunks arrive as one fp32 shard each and wait for their
      place in the sum, so a primary rank keeps ``order_chunks`` shards where a window would be one:
      ``max(0, order_chunks − windows)·4·N/ρ`` beyond ``window_shards`` (its own chunks arrive in order: the
      auxiliaries pull from the back of the queue);
    * ``apply_sum`` — ``apply``'s ``total = flat.clone()`` of the first received window, alive through the optimizer
      step: ``4·N/ρ`` when the step has a window, else 0; on the object-store path the auxiliary chunks' gradients
      come from the host instead (no ``window_shards``), and the device copy of the last one (``flat``) is alive
      beside the sum: ``2·4·N/ρ``;
    * ``optimizer_step`` — AdamW's temporaries. On CUDA torch takes the multi-tensor path (``foreach``, its
      default for CUDA tensors and DTensors: ``torch.optim.optimizer._default_to_fused_or_foreach``), whose
      ``torch._foreach_sqrt(exp_avg_sqs)`` holds a new fp32 copy of every second moment at once: ``4·N/ρ``
      (measured on an H200 at 4B, ``benchmarks/trainer_scale.md``: both optimizer steps of ``bench gpu_path`` peak
      within 0.6 GiB of the budget with this term, 12.6 GiB above it with the single-tensor term). On CPU
      (``foreach`` is CUDA-only) the single-tensor path (``torch.optim.adam._single_tensor_adam``), whose
      ``(exp_avg_sq.sqrt() / c).add_(eps)`` holds two fp32 tensors of one parameter at once: ``2·4·P_max/ρ``
      for the largest parameter ``P_max`` (the embedding or the head, ``V·H``);
    * ``activations`` — one micro-batch (:func:`trainer_activation_bytes`; not sharded): ``micro_batch_per_device ·
      max_seq_len`` tokens, or with ``rl.max_tokens_per_micro_batch`` the budget itself — the engine packs a rank's
      share into passes of at most that many padded tokens (``TrainerEngine``'s ``micro_batches``);
    * ``fsdp_unsharded`` — what FSDP2 unshards around a micro-batch on a sharded engine (a gang of several ranks,
      or bf16-mixed on CUDA), in the compute dtype
      ``b_c``: the root module's parameters (the embedding and an untied head, ``R = V·H·(1 or 2)``; the root is
      not resharded between forward and backward) and :data:`FSDP_PREFETCH_BLOCKS` blocks' parameters
      (``B = (N − R)/L`` each), the unsharded gradients of the root and one block in ``b_c``, and one fp32
      reduce-scatter input of the larger: ``b_c·(R + 2B) + b_c·(R + B) + 4·max(R, B)``; 0 unsharded;
    * ``transport_buckets`` — a send of a published version (``TrainerEngine._gather_bucket`` and
      ``weight_transport.send_buckets``) on rank 0's device: a bucket's padded shards and their concatenation
      (``2·K/S``), the pieces gathered from every rank of the gang (``W·K/S``, W = ``gang_ranks``), the full
      tensors cut from them (``K``), the send's flat bucket (``K``) and the previous bucket still posted (``K``),
      with ``K = max(min(transport.bucket_mb, the model), the largest tensor)`` in the wire dtype and S = ρ:
      ``K·(3 + (2 + W)/S)``; 0 on the object-store path;
    * ``rollout_beside`` — the trainer pool's borrowing rollouter on the same GPU, switched out while the trainer
      computes (:func:`rollout_asleep_bytes`: its activation reserve on CUDA; weights too on CPU);
    * ``offload_buffer`` — on CPU only, where the device is the host: the hot switch's host buffer
      (:class:`~bidirl.cluster.engines.workers.host_buffer.HostStash`), reserved once the engine is loaded and kept
      for its life, sized for the largest state it holds (``TrainerEngine.host_capacity``) — weights, moments, a
      mid-step gradient, the reference and, on the collective path, the ``PUBLISHED_KEPT`` published versions that
      an offload moves beside them: ``(4 + 8 + 4)·N/ρ + reference + 2·b_w·N/ρ`` — plus the buffers of
      ``rl.param_offload`` (the weights, ``4·N/ρ``) and ``rl.optimizer_offload`` (the moments, ``8·N/ρ``), also kept
      for the engine's life; 0 on CUDA (pinned host memory, not the device's). ``rl.param_offload`` lowers no phase:
      a stage brings the weights back before it computes (veRL's ``param_offload`` likewise), so they are on the
      device through every phase; it frees them between stages only.

    The rank's peak is the largest phase (:data:`BUDGET_PHASES`): a chunk (activations and FSDP2's unsharded
    blocks) or the optimizer step (the windows, the sum and AdamW's temporaries), since ``apply`` runs between
    chunks. The publish after the step holds less than either (its gradients and windows are freed:
    ``_clear_grads``). An auxiliary rank holds less than a primary one: no AdamW state, no published versions, and
    its send's flattened shard (``4·N/ρ``) is half the moments a primary holds. What is left out: the CUDA context
    and allocator fragmentation, in the ``1 − memory_utilization`` margin of ``usable``.
    """
    layout: int
    usable: float
    weights: float
    gradients: float
    optimizer_state: float
    reference: float
    published_versions: float
    window_shards: float
    order_buffers: float
    apply_sum: float
    optimizer_step: float
    activations: float
    fsdp_unsharded: float
    transport_buckets: float
    rollout_beside: float
    offload_buffer: float
    optimizer_offload: bool = False

    def phases(self) -> dict:
        """``{phase: the terms it holds}``: :data:`BUDGET_PHASES`, less the moments in a chunk with
        ``rl.optimizer_offload`` (they are in host memory between optimizer steps)."""
        if not self.optimizer_offload:
            return BUDGET_PHASES
        return {p: tuple(t for t in names if not (p == "chunk" and t == "optimizer_state"))
                for p, names in BUDGET_PHASES.items()}

    def terms(self) -> dict:
        """``{term: bytes}`` in the order of the fields."""
        return {name: float(getattr(self, name)) for name in BUDGET_TERMS}

    def phase_bytes(self) -> dict:
        """``{phase: bytes held at once}`` (:data:`BUDGET_PHASES`)."""
        return {phase: sum(float(getattr(self, t)) for t in names) for phase, names in self.phases().items()}

    @property
    def peak(self) -> float:
        return max(self.phase_bytes().values())

    @property
    def peak_phase(self) -> str:
        held = self.phase_bytes()
        return max(held, key=held.get)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    @property
    def over_by(self) -> float:
        """How far the peak exceeds the usable memory (≤ 0: it fits)."""
        return self.peak - self.usable

    def blocking_terms(self) -> list:
        """The terms without any one of which every phase would fit, largest first: what to change. Empty when it
        fits, or when no single term is enough (the weights, gradients and moments together are then the cause)."""
        if self.fits:
            return []
        out = [t for t in BUDGET_TERMS
               if float(getattr(self, t)) > 0 and all(held - (float(getattr(self, t)) if t in self.phases()[p] else 0.0)
                                                      <= self.usable for p, held in self.phase_bytes().items())]
        return sorted(out, key=lambda t: -float(getattr(self, t)))


BUDGET_TERMS = tuple(f for f in DeviceBudget.__dataclass_fields__ if f not in ("layout", "usable", "optimizer_offload"))


def device_budget(model, hw, layout: int, *, micro_batch_per_device: int, max_seq_len: int, device: str = "cuda",
                  kl_coef: float = 0.0, weights_transport: str = "collective", bucket_bytes: float = 512 * 2 ** 20,
                  windows: int = 1, gang_ranks: Optional[int] = None, tokens: Optional[float] = None,
                  checkpointing: Optional[bool] = None, param_offload: bool = False,
                  optimizer_offload: bool = False, order_chunks: int = 0) -> DeviceBudget:
    """The :class:`DeviceBudget` of one primary trainer rank of a replica of ``layout`` GPUs in an engine run on
    ``device`` (``"cuda"``: bf16-mixed compute, bf16 on the wire; ``"cpu"``: fp32 throughout, the engines'
    ``precision="auto"`` and the rollouters' dtype), with ``windows`` auxiliary windows received per step (0: the
    policy never lends the rollout pool to training) and the weight transport ``weights_transport``
    (``transport.weights``) in buckets of ``bucket_bytes``. ``gang_ranks``: the primary gang's ranks (its pool's
    GPUs; default ``layout``) — a gang of several ranks runs FSDP2 even at ``layout`` 1 (replicated shards).
    ``tokens``: one micro-batch's tokens on the rank (:func:`micro_batch_tokens`; default ``micro_batch_per_device
    · max_seq_len``); ``checkpointing``: whether the trainer recomputes its blocks (``rl.activation_checkpointing``
    as the engine resolves it; None: the checkpointed form), both as :func:`trainer_activation_bytes` takes them.
    ``param_offload`` / ``optimizer_offload``: ``rl.param_offload`` / ``rl.optimizer_offload`` (the class docstring).
    ``order_chunks``: the auxiliary update chunks of a step kept one shard each in the reproducible mode (0: off)."""
    if layout < 1 or windows < 0 or micro_batch_per_device < 1 or max_seq_len < 1 or order_chunks < 0:
        raise ValueError("device_budget: layout, micro_batch_per_device and max_seq_len must be ≥ 1, windows and "
                         "order_chunks ≥ 0")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device_budget: device must be 'cuda' or 'cpu', got {device!r}")
    n, rho = float(model.params_total), int(layout)
    compute = 2 if device == "cuda" else 4                  # bf16-mixed on CUDA, fp32 on CPU
    wire = compute                                          # the rollouters' dtype (WeightSync.dtype)
    # FSDP2 on a gang of several ranks, and on CUDA even alone (bf16-mixed shards over one rank: _shard_alone)
    sharded = device == "cuda" or rho > 1 or (gang_ranks or rho) > 1
    root = model.vocab * model.hidden * (1 if model.tie_word_embeddings else 2)
    block = max(0.0, n - root) / max(1, model.layers)
    largest = max(model.vocab * model.hidden, model.intermediate * model.hidden)
    collective = weights_transport == "collective"
    bucket = max(min(float(bucket_bytes), wire * n), wire * largest)        # a bucket holds at least one tensor
    return DeviceBudget(
        layout=rho, usable=usable_bytes(hw),
        weights=ENGINE_WEIGHT_BYTES * n / rho,
        gradients=ENGINE_GRAD_BYTES * n / rho,
        optimizer_state=ADAMW_MOMENT_BYTES * n / rho,
        reference=compute * n / rho if kl_coef > 0 else 0.0,
        published_versions=(PUBLISHED_KEPT + PUBLISHED_TRANSIENT) * wire * n / rho if collective else 0.0,
        window_shards=windows * ENGINE_GRAD_BYTES * n / rho if collective else 0.0,
        order_buffers=max(0, order_chunks - windows) * ENGINE_GRAD_BYTES * n / rho if windows else 0.0,
        apply_sum=(1 if collective else 2) * ENGINE_GRAD_BYTES * n / rho if windows else 0.0,
        optimizer_step=(4 * n if device == "cuda" else 2 * 4 * largest) / rho,
        activations=trainer_activation_bytes(
            model, micro_batch_per_device * max_seq_len if tokens is None else tokens, checkpointing),
        fsdp_unsharded=(compute * (root + FSDP_PREFETCH_BLOCKS * block) + compute * (root + block)
                        + 4 * max(root, block)) if sharded else 0.0,
        transport_buckets=bucket * (3 + (2 + (gang_ranks or rho)) / rho) if collective else 0.0,
        rollout_beside=rollout_asleep_bytes(model, 1, device),
        offload_buffer=0.0 if device == "cuda" else (
            (ENGINE_WEIGHT_BYTES + ADAMW_MOMENT_BYTES + ENGINE_GRAD_BYTES) * n / rho
            + (compute * n / rho if kl_coef > 0 else 0.0)
            + (PUBLISHED_KEPT * wire * n / rho if collective else 0.0)
            + (ENGINE_WEIGHT_BYTES * n / rho if param_offload else 0.0)
            + (ADAMW_MOMENT_BYTES * n / rho if optimizer_offload else 0.0)),
        optimizer_offload=bool(optimizer_offload))
