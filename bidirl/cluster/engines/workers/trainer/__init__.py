"""The torch trainer engine: log-prob stages, chunk gradients, ordered merge + AdamW, offload/onload, FSDP2.

One ``TrainerEngine`` is one rank of a trainer gang (paper §2.1, §5). It runs the three trainer stages of a
GRPO step (protocol ``STAGES``):

* ``old_logprob`` / ``ref_logprob`` — :meth:`TrainerEngine.logprobs` recomputes the per-token log-probs
  of response tokens under the actor (or the frozen reference = the initial weights);
* ``actor_update`` — :meth:`TrainerEngine.chunk_gradients` computes one chunk's gradient of the GRPO loss
  (``bidirl.rl.grpo.policy_loss``); primary and auxiliary trainers alike (§5.2, Trainer-on-RollPool). A
  primary gang accumulates it into its sharded ``p.grad`` on the device (``accumulate=True``: no host copy);
  :meth:`TrainerEngine.apply` (primary only) adds any received gradients, clips and takes one AdamW step
  there. The sum equals the in-order sum of the chunks up to fp32 summation order, so borrowing never changes
  what the update computes beyond rounding (§6.3, Table 2; the bound is in :meth:`TrainerEngine.apply`).

Log-probs run the LM head on response positions only, in chunks (:mod:`bidirl.cluster.engines.workers.logprob`); the
blocks are recomputed in the backward pass when ``activation_checkpointing`` is on (default on CUDA).

**Models.** Any causal LM that transformers builds with ``AutoModelForCausalLM`` from a local checkpoint
folder (checked by :mod:`bidirl.rl.model_folder`). **Precision**: ``"fp32"`` (the CPU default)
or ``"bf16-mixed"`` (the GPU default): fp32 master weights, fp32 AdamW state and fp32 gradient reduction,
bf16 parameters for compute through FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``; a bf16-mixed engine that joins no gang shards over a one-rank group of its own.

**Sharding (FSDP2).** :meth:`init_process_group` joins the gang's ``torch.distributed`` group (gloo on CPU,
NCCL on GPU) through the rendezvous store rank 0 opened with :meth:`listen` (listening on a port the OS picked as
it bound, held until the gang is gone) and shards the model with ``fully_shard`` — each transformer block, then
the root — over a device mesh of the gang's ranks, one rank per GPU slot: ``(replicas, ranks per replica)`` with the
parameters sharded inside a replica and replicated across replicas (HSDP; one replica is plain FSDP over the
gang). Parameters, gradients and optimizer state are sharded; a forward all-gathers a replica's weights
block by block. Gradients are reduced as a **sum** (divide factor 1: the GRPO loss is already normalised by
the step's token count), so after a chunk every rank holds its shard of the gang's chunk gradient:
:class:`ChunkGradient` ``.flat`` is that shard (the whole gradient on an unsharded engine).
:meth:`send_window` / :meth:`receive_window` move an auxiliary gang's accumulated window shard to shard to the
primary gang (:mod:`bidirl.cluster.engines.workers.bridge`), where it waits beside ``p.grad`` until :meth:`apply`
adds it.
Without the weight transport (``transport.weights: object_store``) :meth:`full_gradient` gathers a shard vector
into the full gradient (a gang collective: how an auxiliary gang's chunk gradient leaves it) and
:meth:`local_gradient` cuts a rank's shard out of a full one (how a primary rank keeps it); :meth:`apply`
accepts either. Every call that runs the model is a collective of the gang's replica and a chunk gradient one of
the whole gang (:func:`rank_shares` deals a chunk's samples to the ranks); every rank of a gang runs every such
call — a rank with no samples joins with an empty share — so the ranks take the same turns of the gang's launch
order (:mod:`.shares`).

**Loading.** An unsharded engine loads the checkpoint whole (``from_pretrained``). A rank of a sharded gang holds
only its shards, from the start: built with ``gang=True`` (the engine driver builds every rank of a gang of several
so), the engine makes the model on the meta device — parameters without storage, buffers as their constructors
compute them — and :meth:`init_process_group` shards it with ``fully_shard``, gives it storage for this rank's shards
(``to_empty``) and reads each parameter's rows of the checkpoint from its safetensors files (``get_slice``): the
same bytes as a whole load, so the same weights bit for bit, and host memory for the rank's shards instead of the
whole fp32 model on every rank (figures: ``benchmarks/trainer_scale.md``, "Loading"). :meth:`reset` reads the same.

**Weights.** :meth:`state_dict` gathers the full weights under the HF checkpoint's names (every rank must
call it; rank 0 gets them, on CPU) — the weight sync to rollouters (§6.2); :meth:`load_state_dict` copies
full weights into this rank's shards (no communication). :meth:`offload` / :meth:`onload` move this rank's
(sharded) weights, optimizer state and accumulated gradients to a host buffer and back and free the device
copy (the trainer half of a hot switch's C_in / C_out, §3.2): each storage is copied into one flat host buffer
allocated once per engine and reused (pinned when CUDA is present; :mod:`bidirl.cluster.engines.workers.host_buffer`)
and then resized to zero bytes, and restored by re-allocating and copying back — on CPU a real free and
re-allocation of the engine's memory, so the measured seconds are an honest CPU C_in/C_out figure. The
reference model (``kl_coef > 0``) is loaded at start, in bf16 on a bf16-mixed engine.

**Modules** (one concern each, combined by :class:`~.engine.TrainerEngine`): ``engine`` (settings, the class),
``loading`` (checkpoint → a rank's shards), ``distribution`` (process group, FSDP2), ``compute`` (stages, chunk
gradients, ``apply``), ``replay`` (the rollout's expert routes replayed in the forwards, R3), ``weights`` (state
dicts, publish / send / receive), ``windows`` (auxiliary windows),
``recovery`` (run checkpoints, snapshots), ``offload`` (hot switch), ``shares`` (samples to ranks), ``tensors``
(DTensor helpers), ``micro_batches`` (token-budget micro-batches, ``rl.max_tokens_per_micro_batch``),
``state_offload`` (weights and optimizer state in host memory between uses, ``rl.param_offload`` /
``rl.optimizer_offload``).
"""

from bidirl.cluster.engines.workers.trainer.compute import ChunkGradient
from bidirl.cluster.engines.workers.trainer.engine import PRECISIONS, TrainerEngine, resolve_precision, settings_from
from bidirl.cluster.engines.workers.trainer.shares import rank_shares

__all__ = ["ChunkGradient", "PRECISIONS", "TrainerEngine", "rank_shares", "resolve_precision", "settings_from"]
