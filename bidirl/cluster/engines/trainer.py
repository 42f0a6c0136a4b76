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

Log-probs run the LM head on response positions only, in chunks (:mod:`bidirl.cluster.engines.logprob`); the
blocks are recomputed in the backward pass when ``activation_checkpointing`` is on (default on CUDA).

**Models.** Any causal LM that transformers builds with ``AutoModelForCausalLM`` from a local checkpoint
folder (checked by :mod:`bidirl.rl.model_folder`). **Precision**: ``"fp32"`` (the CPU default)
or ``"bf16-mixed"`` (the GPU default): fp32 master weights, fp32 AdamW state and fp32 gradient reduction,
bf16 parameters for compute through FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``; a bf16-mixed engine that joins no gang shards over a one-rank group of its own.

**Sharding (FSDP2).** :meth:`init_process_group` joins the gang's ``torch.distributed`` group (gloo on CPU,
NCCL on GPU) and shards the model with ``fully_shard`` — each transformer block, then the root — over a
device mesh of the gang's ranks, one rank per GPU slot: ``(replicas, ranks per replica)`` with the
parameters sharded inside a replica and replicated across replicas (HSDP; one replica is plain FSDP over the
gang). Parameters, gradients and optimizer state are sharded; a forward all-gathers a replica's weights
block by block. Gradients are reduced as a **sum** (divide factor 1: the GRPO loss is already normalised by
the step's token count), so after a chunk every rank holds its shard of the gang's chunk gradient:
:class:`ChunkGradient` ``.flat`` is that shard (the whole gradient on an unsharded engine).
:meth:`send_window` / :meth:`receive_window` move an auxiliary gang's accumulated window shard to shard to the
primary gang (:mod:`bidirl.cluster.engines.bridge`), where it waits beside ``p.grad`` until :meth:`apply` adds it.
Without the weight transport (``transport.weights: object_store``) :meth:`full_gradient` gathers a shard vector
into the full gradient (a gang collective: how an auxiliary gang's chunk gradient leaves it) and
:meth:`local_gradient` cuts a rank's shard out of a full one (how a primary rank keeps it); :meth:`apply`
accepts either. Every call that runs the model is a collective of the gang's replica — a rank with no samples
still joins with an empty share (:func:`forward_ranks`) — and a chunk gradient one of the whole gang
(:func:`rank_shares` deals a chunk's samples to the ranks).

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
allocated once per engine and reused (pinned when CUDA is present; :mod:`bidirl.cluster.engines.host_buffer`)
and then resized to zero bytes, and restored by re-allocating and copying back — on CPU a real free and
re-allocation of the engine's memory, so the measured seconds are an honest CPU C_in/C_out figure. The
reference model (``kl_coef > 0``) is loaded at start, in bf16 on a bf16-mixed engine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from bidirl.cluster.engines import bridge, snapshot_files
from bidirl.cluster.engines.host_buffer import HostStash
from bidirl.cluster.engines.logprob import DEFAULT_CHUNK, response_logprobs
from bidirl.core.protocol import PRIMARY, ROLES
from bidirl.rl import grpo
from bidirl.rl import model_folder as checkpoint

#: ``precision=`` values: fp32 throughout, or bf16 compute over fp32 master weights (FSDP2 mixed precision)
PRECISIONS = ("fp32", "bf16-mixed")


@dataclass
class ChunkGradient:
    """One chunk's gradient on one rank: the rank's shard of every parameter's gradient, summed over the gang,
    flattened in parameter order (fp32, CPU). An unsharded engine's shard is the whole gradient. ``flat`` is
    ``None`` when the gradient was accumulated into the engine's (sharded) ``p.grad`` on its device instead
    (``chunk_gradients(accumulate=True)``, the primary gang's path)."""
    flat: Optional[torch.Tensor]
    stats: dict
    samples: int
    tokens: int
    seconds: float


def _as_1d(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).reshape(-1)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _local(t) -> torch.Tensor:
    """The rank's own tensor of a (possibly sharded) parameter, gradient or optimizer state."""
    if _is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def _local_index(like) -> tuple:
    """Where this rank's part of the (possibly sharded) tensor ``like`` lies in the full tensor: one slice per
    dimension (FSDP2 shards dimension 0; an unsharded tensor is all of it)."""
    if not _is_dtensor(like):
        return tuple(slice(0, n) for n in like.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _local_slice(full: torch.Tensor, like) -> torch.Tensor:
    """The part of the full tensor ``full`` that this rank holds of the (possibly sharded) tensor ``like``."""
    return full[_local_index(like)] if _is_dtensor(like) else full


def _on_meta(model) -> bool:
    """Whether ``model``'s parameters are still on the meta device (built, not yet loaded)."""
    return any(p.device.type == "meta" for p in model.parameters())


def _checkpoint_tensors(model) -> dict:
    """``{checkpoint name: parameter or persistent buffer}`` of ``model``, each tensor once (a tied head is the
    embedding's parameter); non-persistent buffers (RoPE's ``inv_freq``) are no checkpoint entries."""
    modules = dict(model.named_modules())
    out: dict = {}
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = checkpoint.hf_name(name)
        owner, _, leaf = name.rpartition(".")
        if id(t) in seen or key.endswith(checkpoint.NON_WEIGHT_SUFFIXES):
            continue
        if leaf in getattr(modules[owner], "_non_persistent_buffers_set", ()):
            continue
        seen.add(id(t))
        out[key] = t
    return out


def _like(local: torch.Tensor, param):
    """``local`` as a tensor of the same kind as ``param`` (a DTensor with the parameter's sharding)."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)


def _tree_map(obj, fn):
    """``obj`` with every tensor ``t`` replaced by ``fn(t)`` (dicts, lists and tuples rebuilt)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _tree_map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree_map(v, fn) for v in obj)
    return obj


def _rebuild(saved, template):
    """``saved`` (plain local tensors) shaped like ``template``: each tensor a copy on the template's device and, where
    the template holds a DTensor, a DTensor with the template's sharding.

    Always a copy: AdamW keeps the state tensors it is given, and a tensor ``torch.load`` read from a file (a
    recovery snapshot) sits in storage that cannot be resized — a hot switch frees state by resizing its storages
    (:mod:`bidirl.cluster.engines.host_buffer`), so a restored gang could not switch out."""
    if torch.is_tensor(template):
        local = saved.to(_local(template).device, copy=True)
        return _like(local, template) if _is_dtensor(template) else local
    if isinstance(template, dict):
        return {k: _rebuild(saved[k], v) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_rebuild(a, b) for a, b in zip(saved, template))
    return saved


def resolve_precision(precision: str, device) -> str:
    """``"auto"`` → ``"bf16-mixed"`` on CUDA, ``"fp32"`` elsewhere; other values are checked."""
    if precision == "auto":
        return "bf16-mixed" if torch.device(device).type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"TrainerEngine.precision must be 'auto' or one of {PRECISIONS}, got {precision!r}")
    return precision


def rank_shares(indices: Sequence, per_device: int, ranks: int) -> list:
    """A chunk's samples dealt to a gang's ranks (one list per rank, in rank order): rank ``r`` takes the
    ``r``-th contiguous run of ``per_device`` samples (the chunk's ``per_device``: one micro-batch per device),
    so the last ranks of a short chunk get fewer or none."""
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
        raise ValueError(f"rank_shares: per_device must be a positive integer, got {per_device!r}")
    if len(indices) > per_device * ranks:
        raise ValueError(f"rank_shares: {len(indices)} samples do not fit {ranks} ranks of {per_device}")
    return [list(indices[r * per_device:(r + 1) * per_device]) for r in range(ranks)]


def forward_ranks(shares: Sequence, ranks_per_replica: int = 1) -> list:
    """The ranks that run a forward-only stage: every rank of each replica that has a sample (the ranks of a
    replica gather its sharded weights together, so an empty rank joins with an empty share)."""
    busy = {r // ranks_per_replica for r, s in enumerate(shares) if len(s)}
    return [r for r in range(len(shares)) if r // ranks_per_replica in busy]


class TrainerEngine:
    """A GRPO trainer over a transformers causal LM (see the module docstring for stages and sharding).

    ``lr``, ``weight_decay``, ``betas``: AdamW; ``kl_coef``: β of the k3 KL to the reference (the initial
    weights); ``clip_eps`` / ``clip_eps_high``: PPO clip range; ``loss_agg``: see ``bidirl.rl.grpo``;
    ``max_grad_norm``: clip the summed gradient (``None``: no clipping); ``precision``: ``"auto"``, ``"fp32"``
    or ``"bf16-mixed"``. ``seed`` seeds the (forked) torch RNG while the model loads; training itself draws no
    random numbers (the model runs in eval mode, without dropout). ``threads`` sets torch's intra-op thread
    count for the whole process (for an engine that owns its process, e.g. inside a Ray actor). ``gang=True``: the
    engine will join a gang (:meth:`init_process_group`) before any work, so the model is built on the meta device
    and each rank reads only its shards from the checkpoint once the mesh is known (module docstring, "Loading");
    an engine built so that does work without joining loads the whole model then, as ``gang=False`` does at once.
    """

    def __init__(self, model_dir: Union[str, Path], lr: float = 1e-3, seed: int = 0, kl_coef: float = 0.0,
                 role: str = PRIMARY, device: str = "cpu", *, clip_eps: float = 0.2,
                 clip_eps_high: Optional[float] = None, loss_agg: str = "token-mean",
                 max_grad_norm: Optional[float] = 1.0, weight_decay: float = 0.0,
                 betas: tuple = (0.9, 0.999), precision: str = "auto", threads: Optional[int] = None,
                 activation_checkpointing: Optional[bool] = None, logprob_chunk: int = DEFAULT_CHUNK,
                 gang: bool = False):
        if role not in ROLES:
            raise ValueError(f"TrainerEngine.role must be one of {ROLES}, got {role!r}")
        if not lr > 0:
            raise ValueError(f"TrainerEngine.lr must be > 0, got {lr!r}")
        if kl_coef < 0:
            raise ValueError(f"TrainerEngine.kl_coef must be ≥ 0, got {kl_coef!r}")
        if loss_agg not in grpo.LOSS_AGGS:
            raise ValueError(f"TrainerEngine.loss_agg must be one of {grpo.LOSS_AGGS}, got {loss_agg!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"TrainerEngine.max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self.device = self._check_device(device)
        self.precision = resolve_precision(precision, self.device)
        if activation_checkpointing is None:
            activation_checkpointing = self.device.type == "cuda"
        if not isinstance(activation_checkpointing, bool):
            raise ValueError("TrainerEngine.activation_checkpointing must be True, False or None (on for CUDA), "
                             f"got {activation_checkpointing!r}")
        if isinstance(logprob_chunk, bool) or not isinstance(logprob_chunk, int) or logprob_chunk < 1:
            raise ValueError(f"TrainerEngine.logprob_chunk must be a positive integer (response tokens per LM-head "
                             f"chunk), got {logprob_chunk!r}")
        if not isinstance(gang, bool):
            raise ValueError(f"TrainerEngine.gang must be True or False, got {gang!r}")
        self.activation_checkpointing, self.logprob_chunk = activation_checkpointing, logprob_chunk
        if threads == "auto":
            threads = self.host_threads(self.device)
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"TrainerEngine.threads must be a positive integer, 'auto' or None, got {threads!r}")
            torch.set_num_threads(threads)   # the engine owns its process (a Ray actor) when this is set
        self.model_dir = checkpoint.model_folder(model_dir, "TrainerEngine.model_dir")
        self.config = checkpoint.causal_lm_config(self.model_dir, "TrainerEngine.model_dir")
        self.tied = checkpoint.tied_embeddings(self.config)
        self.role, self.seed, self.lr, self.kl_coef = role, int(seed), float(lr), float(kl_coef)
        self.clip_eps, self.clip_eps_high, self.loss_agg = float(clip_eps), clip_eps_high, loss_agg
        self.max_grad_norm = max_grad_norm
        self.betas, self.weight_decay = tuple(betas), float(weight_decay)
        self.mesh = None                 # the gang's device mesh once sharded (FSDP2)
        self._group = None
        self.rank, self.world, self.replicas = 0, 1, 1
        self._reference = None
        self.windows: dict = {}           # transfer id -> an auxiliary window's gradient shard (receive_window)
        self._host = HostStash()         # offload's host buffer: allocated once, reused by every switch
        self._snapshots = snapshot_files.SnapshotWriter()    # recovery snapshots on this node's disk (save_snapshot)
        self.published: dict = {}         # actor version -> {name: (shard in the wire dtype, rows or None)}
        self._transport_group = None      # the gang's second group, for the weight transport's gathers
        self.accumulated: list = []       # chunk gradients accumulated into p.grad since the last step (their ids)
        self.version = 0
        self._pending = gang              # built on the meta device for a gang: loaded once the mesh is known
        self.model = self._load_model(empty=gang)
        if self.kl_coef > 0:              # the reference is loaded at start (bf16 when computing in bf16)
            self._reference = self._load_model(frozen=True, empty=gang)
        self._track_parameters()

    @staticmethod
    def host_threads(device) -> int:
        """``threads="auto"``: inside a Ray actor, the whole CPUs Ray granted it (at least one) — what Ray sets
        ``OMP_NUM_THREADS`` to; on a GPU cluster the actor's half of its GPU slot's bundle, ``cluster.cpus_per_gpu``
        (``bidirl.cluster.pool.gpu_bundle_cpus``), so host work (optimizer bookkeeping, copies, batching) is not
        single-threaded. Outside Ray: this machine's CPUs shared evenly by its GPUs on a CUDA device, one thread on
        CPU (the engine's compute then owns a core, as the CPU gangs are laid out)."""
        import os
        import sys
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            return max(1, math.floor(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        if torch.device(device).type != "cuda":
            return 1
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cpus // max(1, torch.cuda.device_count()))

    @staticmethod
    def _check_device(device) -> torch.device:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"TrainerEngine.device must be 'cpu' or 'cuda[:i]', got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TrainerEngine.device={device!r} but this torch sees no CUDA device; use device='cpu'")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _load_model(self, frozen: bool = False, empty: bool = False):
        """The checkpoint's model on the engine's device, with its own (resizable) storage, sharded when the
        engine is: fp32 master weights, or — ``frozen``, the reference, which is never updated — held in bf16
        when the engine computes in bf16 (FSDP2 would cast it to bf16 for every forward anyway: same values,
        half the memory and no cast). The trained model gets activation checkpointing when configured.

        Unsharded it is loaded whole; sharded, or ``empty`` (a gang's mesh is not known yet), it is built on the
        meta device, and a sharded one is then filled with this rank's shards (:meth:`_materialise`)."""
        dtype = torch.bfloat16 if frozen and self.precision == "bf16-mixed" else torch.float32
        if self.mesh is None and not empty:
            model = self._from_pretrained(dtype).to(self.device)
            for p in model.parameters():     # own, resizable storage (from_pretrained may map the checkpoint file)
                p.data = p.data.clone()
        else:
            model = checkpoint.empty_causal_lm(self.model_dir, dtype, "TrainerEngine.model_dir")
        model.eval()             # no dropout: the same samples give the same gradient on every rank and run
        model.requires_grad_(not frozen)
        if not frozen and self.activation_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError(f"TrainerEngine.activation_checkpointing: {type(model).__name__} does not support "
                                 "gradient checkpointing; set activation_checkpointing=False")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.mesh is not None:
            self._fully_shard(model)
            self._materialise(model)
        return model

    def _from_pretrained(self, dtype):
        """The whole checkpoint loaded on CPU (weights it lacks drawn from the engine's seed)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return checkpoint.load_causal_lm(self.model_dir, dtype, "TrainerEngine.model_dir")

    def _materialise(self, model) -> None:
        """Storage on the engine's device for a model built on the meta device (sharded or not), filled from the
        checkpoint (:meth:`_fill`: a sharded rank reads its shards alone); the buffers keep the values their
        constructors computed (``to_empty`` would leave them uninitialised), and a parameter several modules share
        (a tied head) stays one (``to_empty`` gives each module a tensor of its own when leaving the meta device)."""
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        places: dict = {}
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
                places.setdefault(id(p), []).append((module, name))
        model.to_empty(device=self.device)
        for (first, name), *others in places.values():
            for module, other in others:
                setattr(module, other, getattr(first, name))
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
            self._fill(model)

    def _fill(self, model) -> None:
        """Copy the checkpoint's weights into ``model``'s parameters and persistent buffers, each rank reading only
        the part of each tensor it holds (:func:`_local_index`) from the files (:func:`checkpoint.checkpoint_slices`):
        the same bytes as a whole load, so the same weights bit for bit. A checkpoint whose names or shapes are not
        the model's (one transformers converts while loading) is loaded whole instead, with a warning."""
        targets = _checkpoint_tensors(model)
        params = {id(p) for p in model.parameters()}
        stored = checkpoint.checkpoint_shapes(self.model_dir)
        direct = all(stored.get(k) == tuple(t.shape) for k, t in targets.items() if id(t) in params)
        with checkpoint.checkpoint_slices(self.model_dir) as files:
            if not direct:
                import warnings
                warnings.warn(f"TrainerEngine: the parameters of {str(self.model_dir)!r} are not stored under the "
                              "model's names and shapes; every rank loads the whole checkpoint to take its shards",
                              stacklevel=2)
                files = checkpoint.hf_weights(self._from_pretrained(next(model.parameters()).dtype).state_dict(),
                                              self.tied)
            for key, t in targets.items():
                if key in files:                          # a buffer the checkpoint lacks keeps its constructor's value
                    _local(t).copy_(files[key][_local_index(t)])

    def _track_parameters(self) -> None:
        """(Re)build the parameter list, shard shapes and the optimizer (primary only) after loading/sharding."""
        self.params = list(self.model.parameters())
        self.local_shapes = [tuple(_local(p).shape) for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.local_numel = sum(math.prod(s) for s in self.local_shapes)
        self.optimizer = (torch.optim.AdamW(self.params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
                          if self.role == PRIMARY else None)

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded with FSDP2 (after :meth:`init_process_group`, or bf16-mixed on first use)."""
        return self.mesh is not None

    # ------------------------------------------------------------------------------------------
    # batching
    # ------------------------------------------------------------------------------------------
    def _batch(self, samples: Sequence):
        """Right-padded prompt+response ids, attention mask, and the gather indices of response tokens."""
        seqs, plen, rlen = [], [], []
        for s in samples:
            p, r = list(s.prompt_ids), list(s.response_ids)
            if not p:
                raise ValueError(f"sample ({s.group_id}, {s.index}) has an empty prompt")
            seqs.append(p + r)
            plen.append(len(p))
            rlen.append(len(r))
        width = max(len(x) for x in seqs)
        tmax = max(max(rlen), 1)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
            attn[i, :len(x)] = 1
        t = torch.arange(tmax)[None, :]
        mask = t < torch.tensor(rlen)[:, None]
        rows, steps = mask.nonzero(as_tuple=True)                        # response tokens, row-major
        cols = torch.tensor(plen)[rows] - 1 + steps                      # logits at col predict token col + 1
        tgt = ids[rows, cols + 1]
        dev = self.device
        return ids.to(dev), attn.to(dev), (rows.to(dev), steps.to(dev), cols.to(dev)), tgt.to(dev), mask.to(dev), rlen

    def _token_logprobs(self, model, samples, grad: bool):
        """``[B, T_resp]`` log-probs of the response tokens (zeros past each response), their mask and lengths:
        the head on response positions only, in chunks (:mod:`bidirl.cluster.engines.logprob`)."""
        ids, attn, (rows, steps, cols), tgt, mask, rlen = self._batch(samples)
        with torch.enable_grad() if grad else torch.no_grad():
            flat = response_logprobs(model, ids, attn, rows, cols, tgt, grad=grad, chunk=self.logprob_chunk)
            lp = torch.zeros(mask.shape, dtype=torch.float32, device=flat.device).index_put((rows, steps), flat)
        return lp, mask, rlen

    def _join_with_empty_share(self, model, grad: bool) -> None:
        """Run the model on one token so this rank joins the gang's collectives (weight all-gathers and, with
        ``grad``, the gradient reduction) while contributing nothing (a zero loss)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.enable_grad() if grad else torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            if grad:
                (logits.float().sum() * 0.0).backward()

    def _reshard(self, model) -> None:
        """Free the unsharded weights a forward left gathered (FSDP2 keeps the root's after a forward-only pass)."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _check_onloaded(self, what: str):
        if self._host.holding:
            raise RuntimeError(f"TrainerEngine.{what}: the engine is offloaded; call onload() first")
        self._load_if_pending()

    def _ready(self, what: str) -> None:
        """Checks shared by every call that touches the model: onloaded, and sharded when bf16-mixed needs it."""
        self._check_onloaded(what)
        if self.precision == "bf16-mixed" and not self.sharded:
            self._shard_alone()

    # ------------------------------------------------------------------------------------------
    # stages
    # ------------------------------------------------------------------------------------------
    def logprobs(self, samples: Sequence, model: str = "actor") -> list:
        """Per-token log-probs of each sample's response tokens (list of 1-D fp32 CPU tensors).

        ``model="actor"``: the current weights (the ``old_logprob`` stage); ``"reference"``: the initial
        weights from ``model_dir``, frozen (the ``ref_logprob`` stage, loaded on first use). On a sharded
        engine an empty ``samples`` still joins the replica's weight gathers (and returns ``[]``).
        """
        self._ready("logprobs")
        if model == "actor":
            net = self.model
        elif model == "reference":
            net = self.reference_model()
        else:
            raise ValueError(f"TrainerEngine.logprobs: model must be 'actor' or 'reference', got {model!r}")
        samples = list(samples)
        if not samples:
            if self.sharded:
                self._join_with_empty_share(net, grad=False)
                self._reshard(net)
            return []
        lp, _, rlen = self._token_logprobs(net, samples, grad=False)
        self._reshard(net)
        lp = lp.cpu()
        return [lp[i, :n].clone() for i, n in enumerate(rlen)]

    def reference_model(self):
        """The frozen initial weights (sharded like the actor), loaded on first use."""
        if self._reference is None:
            self._check_onloaded("reference_model")
            self._reference = self._load_model(frozen=True)
        return self._reference

    def _pad(self, rows: Sequence, rlen: list, name: str) -> torch.Tensor:
        if len(rows) != len(rlen):
            raise ValueError(f"chunk_gradients: got {len(rows)} {name} for {len(rlen)} samples")
        out = torch.zeros(len(rlen), max(max(rlen), 1), dtype=torch.float32)
        for i, (r, n) in enumerate(zip(rows, rlen)):
            v = _as_1d(r)
            if v.numel() != n:
                raise ValueError(f"chunk_gradients: {name}[{i}] has {v.numel()} values for a response of {n} tokens")
            out[i, :n] = v
        return out.to(self.device)

    def chunk_gradients(self, samples: Sequence, advantages, old_logprobs: Sequence,
                        ref_logprobs: Optional[Sequence] = None, normalizer: Optional[float] = None,
                        accumulate: bool = False, chunk_id=None) -> ChunkGradient:
        """This rank's shard of the gang's gradient of a chunk's share of the GRPO loss (fp32).

        ``samples`` is this rank's share of the chunk; ``advantages``: one per sample
        (``grpo.group_advantages``); ``old_logprobs`` / ``ref_logprobs``: per-sample per-token sequences as
        returned by :meth:`logprobs`. ``normalizer`` is the *step's* token (or sequence) count when the step is
        split into several chunks (``grpo.loss_normalizer``); ``None`` uses the chunk's own count, summed over
        the gang. On a gang every rank must call it (a rank without samples passes an empty share and the
        step's normalizer); each gets its shard of the sum of all ranks' gradients.

        ``accumulate=True`` (the primary gang's path, §6.3): the gradient is added into the engine's
        (sharded) ``p.grad`` on its device — FSDP2's reduce-scatter adds each chunk to the shard — and nothing
        is copied to the host (``flat`` is ``None``); :meth:`apply` then steps on the sum. ``chunk_id`` is
        recorded in :attr:`accumulated`. Otherwise the shard is returned as a CPU vector (``flat``: an
        auxiliary gang's or a test's) and gradients already accumulated are left as they were.
        """
        self._ready("chunk_gradients")
        samples = list(samples)
        if not accumulate:
            kept = [p.grad for p in self.params]          # set aside what earlier chunks accumulated
            for p in self.params:
                p.grad = None
            try:
                out = self._chunk_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
                out.flat = self._local_grad_vector().cpu()
            finally:
                for p, g in zip(self.params, kept):
                    p.grad = g
            return out
        out = self._chunk_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
        self.accumulated.append(chunk_id)
        return out

    def _chunk_backward(self, samples, advantages, old_logprobs, ref_logprobs, normalizer) -> ChunkGradient:
        """The chunk's loss backward into ``p.grad`` (added to what is there); statistics without ``flat``."""
        if len(samples) == 0:
            if normalizer is None:
                raise ValueError("chunk_gradients: an empty share needs the step's normalizer")
            if self.sharded:
                self._join_with_empty_share(self.model, grad=True)
            return ChunkGradient(None, grpo.empty_stats(), 0, 0, 0.0)
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("chunk_gradients: kl_coef > 0 needs ref_logprobs (run logprobs(samples, 'reference'))")
        t0 = time.perf_counter()
        adv = _as_1d(advantages).to(self.device)
        if adv.numel() != len(samples):
            raise ValueError(f"chunk_gradients: got {adv.numel()} advantages for {len(samples)} samples")
        self.model.train()
        try:
            lp, mask, rlen = self._token_logprobs(self.model, samples, grad=True)
            old = self._pad(old_logprobs, rlen, "old_logprobs")
            ref = self._pad(ref_logprobs, rlen, "ref_logprobs") if ref_logprobs is not None else None
            if normalizer is None:
                normalizer = grpo.loss_normalizer(rlen, self.loss_agg)
                if self._group is not None and self.world > 1:
                    n = torch.tensor([normalizer], dtype=torch.float64, device=self._comm_device())
                    torch.distributed.all_reduce(n, group=self._group)
                    normalizer = float(n)
            loss, stats = grpo.policy_loss(lp, old, adv, mask, clip_eps=self.clip_eps,
                                           clip_eps_high=self.clip_eps_high, ref_logprobs=ref, kl_coef=self.kl_coef,
                                           loss_agg=self.loss_agg, normalizer=normalizer if normalizer > 0 else None)
            loss.backward()
        finally:
            self.model.eval()
        return ChunkGradient(None, stats.to_dict(), len(samples), int(sum(rlen)), time.perf_counter() - t0)

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.accumulated = []
        self.windows = {}

    def _local_grad_vector(self) -> torch.Tensor:
        """This rank's gradient shards, flattened in parameter order (zeros where a parameter got none)."""
        parts = [(_local(p.grad).reshape(-1) if p.grad is not None else torch.zeros(math.prod(s), device=self.device))
                 for p, s in zip(self.params, self.local_shapes)]
        return torch.cat(parts).detach().to(torch.float32)

    def full_gradient(self, local_flat: torch.Tensor) -> torch.Tensor:
        """The full gradient (parameter order, fp32, CPU) from every rank's shard vector ``local_flat``.

        A collective on a sharded engine: every rank of the gang calls it with its own shard (it is how an
        auxiliary gang's chunk gradient leaves the gang once, unsharded). Unsharded: ``local_flat`` itself.
        """
        flat = _as_1d(local_flat)
        if flat.numel() != self.local_numel:
            raise ValueError(f"full_gradient: got {flat.numel()} values, this rank's shard has {self.local_numel}")
        if not self.sharded:
            return flat.cpu()
        parts, offset = [], 0
        for p, shape in zip(self.params, self.local_shapes):
            n = math.prod(shape)
            local = flat[offset:offset + n].view(shape).to(self.device)
            parts.append(_like(local, p).full_tensor().reshape(-1).cpu())
            offset += n
        return torch.cat(parts)

    def local_gradient(self, flat) -> torch.Tensor:
        """This rank's shard of a gradient vector: a full gradient (``numel`` values, parameter order) is cut
        to the shard; a shard vector (``local_numel`` values) is returned as is (no communication)."""
        flat = _as_1d(flat) if not isinstance(flat, ChunkGradient) else flat.flat.reshape(-1)
        if flat.numel() == self.local_numel:
            return flat
        if flat.numel() != self.numel:
            raise ValueError(f"chunk gradient has {flat.numel()} values; the model has {self.numel} and this rank's "
                             f"shard {self.local_numel}: pass a gradient of this model (full or this rank's shard)")
        parts, offset = [], 0
        for p in self.params:
            n = p.numel()
            parts.append(_local_slice(flat[offset:offset + n].view(p.shape), p).reshape(-1))
            offset += n
        return torch.cat(parts)

    def apply(self, grads_in_chunk_order: Iterable = (), windows: Optional[dict] = None) -> dict:
        """Clip the step's summed gradient and take one AdamW step on the device (primary only).

        The sum is what the chunks accumulated into ``p.grad`` (:meth:`chunk_gradients` with ``accumulate``,
        recorded in :attr:`accumulated`) plus the given gradients, each a :class:`ChunkGradient` or a vector,
        full or this rank's shard (:meth:`local_gradient`), added left to right in the given order;
        :class:`ChunkGradient` s whose ``flat`` is ``None`` are the accumulated ones and add nothing again; plus
        the auxiliary windows received under the transfer ids ``windows`` names (``{tid: its chunk ids}``,
        :meth:`receive_window`). Windows received and not named (a lost attempt's) are dropped.
        Chunks accumulate in the order they finish, not the original chunk order: the sum equals the in-order
        sum up to fp32 summation order (each element a sum of k terms: |error| ≤ (k − 1)·2⁻²⁴·Σ|gᵢ|) — so a
        borrowed chunk never changes what the update computes beyond rounding (§6.3, Table 2). On a sharded gang
        every rank applies its shards (the norm is global).
        """
        if self.role != PRIMARY:
            raise RuntimeError(f"TrainerEngine.apply: an {self.role} trainer computes chunk gradients only; "
                               "send them to the primary trainer, which applies the update")
        self._ready("apply")
        t0 = time.perf_counter()
        total = None
        count = len(self.accumulated)
        for g in grads_in_chunk_order:
            if isinstance(g, ChunkGradient) and g.flat is None:
                continue                                   # accumulated into p.grad already (counted above)
            try:
                flat = self.local_gradient(g).to(self.device)
            except ValueError as exc:
                raise ValueError(f"apply: chunk gradient {count}: {exc}") from None
            total = flat.clone() if total is None else total.add_(flat)
            count += 1
        for tid, ids in (windows or {}).items():
            if tid not in self.windows:
                raise ValueError(f"apply: no auxiliary window was received under transfer {tid!r} (chunks "
                                 f"{list(ids)}); receive_window first")
            flat = self.windows[tid]
            total = flat.clone() if total is None else total.add_(flat)
            count += len(ids)
        if count == 0:
            raise ValueError("apply: no chunk gradients given or accumulated")
        if total is not None:
            self._add_to_grads(total)
        for p in self.params:                              # a parameter no chunk reached: a zero gradient
            if p.grad is None:
                p.grad = _like(torch.zeros_like(_local(p)), p)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self._clear_grads()
        self.version += 1
        return {"version": self.version, "grad_norm": grad_norm, "chunks": count,
                "seconds": time.perf_counter() - t0}

    def _add_to_grads(self, flat: torch.Tensor) -> None:
        """Add a flat vector of this rank's shards (parameter order) into each parameter's ``grad``."""
        offset = 0
        for p, shape in zip(self.params, self.local_shapes):
            n = math.prod(shape)
            part = flat[offset:offset + n].view(shape)
            if p.grad is None:
                p.grad = _like(part.clone(), p)
            else:
                _local(p.grad).add_(part)
            offset += n

    def discard_gradients(self) -> int:
        """Forget the chunk gradients accumulated since the last step (a step started over); returns how many."""
        n = len(self.accumulated)
        self._clear_grads()
        return n

    # ------------------------------------------------------------------------------------------
    # auxiliary gradients shard to shard (bidirl.cluster.engines.bridge)
    # ------------------------------------------------------------------------------------------
    def shard_signature(self) -> tuple:
        """Which elements of every parameter this rank holds (:func:`bridge.shard_signature`)."""
        return bridge.shard_signature(self.params)

    def send_window(self, transfer, chunk_ids: Optional[Sequence[int]] = None) -> dict:
        """Send this rank's shard of the window's accumulated gradient (the chunks :attr:`accumulated`, which must be
        ``chunk_ids`` when given) to the primary ranks that receive ``transfer`` (:func:`bridge.send_shard`: one
        transfer per rank pair, nothing through Ray) and forget it. The shard is flattened once on the device."""
        self._check_onloaded("send_window")
        ids = bridge.check_window(self.accumulated, chunk_ids, "send_window")
        flat = self._local_grad_vector()
        report = bridge.send_shard(transfer, flat, self._comm_device())
        self._clear_grads()
        return dict(report, chunks=ids)

    def receive_window(self, transfer, rank: int) -> dict:
        """Receive an auxiliary rank's shard of its window's gradient as member ``rank`` of ``transfer`` and keep it
        under ``transfer.tid`` beside this rank's ``p.grad`` (:meth:`apply` adds the windows it is given). It runs
        beside a chunk in flight: nothing the chunk touches is changed, and a transfer that breaks off (raising
        ``WeightTransferError``) leaves the step's gradient as it was."""
        flat, report = bridge.receive_shard(transfer, rank, self.local_numel, self._comm_device())
        self.windows[transfer.tid] = flat
        return dict(report, tid=transfer.tid)

    def _clip_gradients(self) -> float:
        """The global L2 norm of the summed gradient (before clipping); clips to ``max_grad_norm`` if set."""
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params])
        if _is_dtensor(norm):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full weights under the HF checkpoint's names, on CPU (the tied ``lm_head.weight`` included, as
        vLLM's reload needs). On a sharded gang every rank must call it: rank 0 gets the weights, the others
        ``{}``."""
        self._ready("state_dict")
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        else:
            state = self.model.state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in checkpoint.hf_weights(state, self.tied).items()}

    def load_state_dict(self, state: dict, version: Optional[int] = None) -> float:
        """Overwrite the weights with full weights (HF names, e.g. :meth:`state_dict` of another trainer of the
        model); a sharded rank copies its own shards (no communication). Returns the seconds spent."""
        self._ready("load_state_dict")
        t0 = time.perf_counter()
        weights = checkpoint.hf_weights(state, self.tied)
        targets = {checkpoint.hf_name(k): v for k, v in self.model.state_dict(keep_vars=True).items()}
        missing = [k for k in targets if k not in weights and not (k == "lm_head.weight" and self.tied)]
        unexpected = [k for k in weights if k not in targets]
        wrong = [f"{k} {tuple(weights[k].shape)} != {tuple(t.shape)}" for k, t in targets.items()
                 if k in weights and tuple(weights[k].shape) != tuple(t.shape)]
        if missing or unexpected or wrong:
            raise ValueError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, shape "
                             f"mismatches {wrong[:5]}; pass the state_dict() of a trainer of the same model")
        with torch.no_grad():
            for k, t in targets.items():
                if k in weights:
                    _local(t).copy_(_local_slice(weights[k].to(t.dtype), t))
        if version is not None:
            self.version = int(version)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------
    # the weight transport (bidirl.cluster.engines.weight_transport): published versions, send, receive
    # ------------------------------------------------------------------------------------------
    def named_weights(self) -> dict:
        """``{checkpoint name: parameter or persistent buffer}`` of the trained model, each tensor once (a tied
        head is the embedding's parameter: the transport delivers it under both names)."""
        self._load_if_pending()
        return _checkpoint_tensors(self.model)

    def publish(self, version: int, dtype: str, keep: Sequence[int] = ()) -> int:
        """Keep this rank's shards of the current weights, cast to the wire ``dtype``, as actor ``version`` — what
        :meth:`send_weights` sends whatever the engine does next (a rollouter may need a version after the next
        optimizer step changed the weights: §3.2's sync follows the step, and a restarted rollouter's load may come
        later still). Versions other than ``version`` and ``keep`` are dropped. On CPU in fp32 this is a copy of
        the shards; on GPU a bf16 copy on the device (moved to the host while the engine is offloaded). Returns the
        bytes kept for ``version``. Every rank of a gang calls it (no communication)."""
        from bidirl.cluster.engines.weight_transport import DTYPES
        if dtype not in DTYPES:
            raise ValueError(f"TrainerEngine.publish: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self._check_onloaded("publish")
        shards = {}
        with torch.no_grad():
            for name, t in self.named_weights().items():
                shards[name] = (_local(t).detach().to(DTYPES[dtype], copy=True),
                                self._dim0_sharding(name, t) if _is_dtensor(t) else None)
        wanted = {int(v) for v in keep} | {int(version)}
        published = {v: p for v, p in self.published.items() if v in wanted}     # a new dict: a send in flight
        published[int(version)] = shards                                            # keeps what it reads
        self.published = published
        return sum(t.numel() * t.element_size() for t, _ in shards.values())

    def _dim0_sharding(self, name: str, param) -> int:
        """The global row count of a parameter FSDP2 shards by rows (``Shard(0)``, replicated across replicas);
        checks that this rank holds rows ``[j·c, min(N, (j + 1)·c))``, c = ⌈N / S⌉, j its index in the replica —
        ``torch.chunk``'s split, which :meth:`_gather_bucket` reassembles."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        placements = tuple(param.placements)
        if placements[-1] != Shard(0) or any(p != Replicate() for p in placements[:-1]):
            raise ValueError(f"publish: {name} is sharded as {placements}; the weight transport gathers FSDP2's "
                             "row sharding (Shard(0), replicated across replicas) only")
        n, shards = int(param.shape[0]), int(self.mesh.shape[-1])
        chunk = -(-n // shards)
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        j = self.rank % shards
        if int(offset[0]) != min(n, j * chunk) or int(shape[0]) != max(0, min(n, (j + 1) * chunk) - j * chunk):
            raise ValueError(f"publish: {name}'s shard on rank {self.rank} holds rows {offset[0]}+{shape[0]} of {n}, "
                             f"not torch.chunk's split over {shards} ranks")
        return n

    def _move_published(self, device) -> None:
        """Published shards follow the engine out of the device and back (CUDA only: on CPU they never move). New
        dicts: a send in flight keeps reading the tensors it started with."""
        if self.device.type != "cuda":
            return
        pin = torch.device(device).type == "cpu"
        self.published = {v: {k: (t.pin_memory() if pin else t.to(device, non_blocking=True), n)
                              for k, (t, n) in shards.items()} for v, shards in self.published.items()}

    def _gather_bucket(self, shards: dict, names: Sequence[str]) -> list:
        """Full tensors of ``names`` from published ``shards``: one all-gather of the bucket's row shards (each
        padded to ⌈N / S⌉ rows) over the gang's transport group, replica 0's pieces concatenated and cut to N rows
        (every rank calls it with the same names). Touches no live parameter: it runs beside training."""
        import torch.distributed as dist

        dev = self._comm_device()
        parts, pieces = [], []
        shards_per_replica = int(self.mesh.shape[-1]) if self.mesh is not None else 1
        for name in names:
            local, rows = shards[name]
            local = local.to(dev)
            if rows is None:
                parts.append((local, None))
                continue
            chunk = -(-rows // shards_per_replica)
            padded = torch.zeros((chunk,) + tuple(local.shape[1:]), dtype=local.dtype, device=dev)
            padded[:local.shape[0]] = local
            pieces.append(padded.reshape(-1))
            parts.append((padded, rows))
        if pieces:
            flat = torch.cat(pieces)
            gathered = [torch.empty_like(flat) for _ in range(self.world)]
            dist.all_gather(gathered, flat, group=self._transport_group)
        out, offset = [], 0
        for local, rows in parts:
            if rows is None:
                out.append(local)
                continue
            n = local.numel()
            full = torch.cat([gathered[j][offset:offset + n].view(local.shape) for j in range(shards_per_replica)])
            out.append(full[:rows])
            offset += n
        return out

    def send_weights(self, transfer) -> dict:
        """Send published version ``transfer.version`` to the transfer's receivers: every rank of the gang calls it
        (the gathers are collectives over the gang's transport group, bucket by bucket); rank 0 sends
        (:func:`weight_transport.send_buckets`). It reads only what :meth:`publish` kept, so it may run beside
        training (the actor runs it on a thread of its own). A receiver that dies or times out is dropped, never
        an error here; returns rank 0's report."""
        from bidirl.cluster.engines import weight_transport as wt
        version = int(transfer.version)
        shards = self.published.get(version)
        if shards is None:
            raise ValueError(f"send_weights: version {version} is not published on this rank (published: "
                             f"{sorted(self.published)}); publish(version, dtype) after the optimizer step")
        wanted = transfer.layout.shapes()
        aliases = dict(transfer.layout.aliases)
        missing = sorted(k for k in wanted if k not in shards and k not in aliases)
        wrong = sorted(k for k in wanted if k in shards and tuple(self._global_shape(k, *shards[k])) != tuple(wanted[k]))
        if missing or wrong or any(t.dtype != transfer.layout.torch_dtype for t, _ in shards.values()):
            raise ValueError(f"send_weights: the layout does not fit this model (missing {missing[:5]}, shape "
                             f"mismatches {wrong[:5]}, or another dtype than {transfer.layout.dtype}); build it from "
                             "this trainer's model folder (weight_transport.model_layout)")
        broadcast = None
        if self.world > 1:
            import torch.distributed as dist

            def broadcast(n: int) -> int:
                flag = torch.tensor([n], dtype=torch.int64, device=self._comm_device())
                dist.broadcast(flag, src=0, group=self._transport_group)
                return int(flag.item())
        with torch.no_grad():
            return wt.send_buckets(transfer, self.rank, lambda names: self._gather_bucket(shards, names),
                                   self._comm_device(), broadcast)

    @staticmethod
    def _global_shape(name: str, local: torch.Tensor, rows) -> tuple:
        return tuple(local.shape) if rows is None else (int(rows),) + tuple(local.shape[1:])

    def receive_weights(self, transfer, rank: int) -> dict:
        """Load ``transfer.version`` as receiver ``rank`` (an auxiliary gang's ranks each receive every bucket and
        copy their own shards in: no communication within the gang). Returns the receiver's report."""
        from bidirl.cluster.engines import weight_transport as wt
        self._ready("receive_weights")
        t0 = time.perf_counter()
        weights = self.named_weights()
        shapes = transfer.layout.shapes()
        missing = sorted(k for k in weights if k not in shapes)
        wrong = sorted(k for k in shapes if k in weights and tuple(weights[k].shape) != tuple(shapes[k]))
        unexpected = sorted(k for k in shapes if k not in weights and k != "lm_head.weight")
        receiver = wt.Receiver(transfer, rank, self._comm_device())
        if missing or wrong or unexpected:
            receiver.abandon("layout mismatch")
            raise ValueError(f"receive_weights: the weights sent do not fit this model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, shape mismatches {wrong[:5]}")
        receiver.connect()
        with torch.no_grad():
            for name, full in receiver.items():
                t = weights.get(name)
                if t is not None:
                    _local(t).copy_(_local_slice(full.to(t.dtype), t))
        self.version = int(transfer.version)
        return dict(receiver.close(), seconds=time.perf_counter() - t0)

    def reset(self) -> float:
        """Back to what a fresh engine holds — the model folder's weights, a new optimizer, version 0 — for a
        new run on the same process (the sharding and the gang stay). Returns seconds."""
        t0 = time.perf_counter()
        self.onload()
        self._ready("reset")
        with torch.no_grad():
            self._fill(self.model)           # a sharded rank reads its shards alone, as at start
        self.version = 0
        self._clear_grads()
        if self.optimizer is not None:
            self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, betas=self.betas,
                                               weight_decay=self.weight_decay)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------
    # training state: run checkpoints and recovery
    # ------------------------------------------------------------------------------------------
    def _train_state(self, what: str) -> dict:
        """Weights and AdamW state as ``torch.distributed.checkpoint`` state dicts under the model's parameter
        names (DTensors holding this rank's shards when sharded; the optimizer state is initialised first if no
        step ran yet). Primary engines only: an auxiliary one holds no optimizer state."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            raise RuntimeError(f"TrainerEngine.{what}: an {self.role} trainer holds no training state; the "
                               "primary trainer's is saved and restored")
        self._ready(what)
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def _set_train_state(self, state: dict, version: int) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.version = int(version)

    def save_train_state(self, path: Union[str, Path]) -> float:
        """Write weights and optimizer state into the folder ``path`` with ``torch.distributed.checkpoint``: on
        a gang every rank calls it and writes its own shards (one file per rank). Returns seconds."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(self._train_state("save_train_state"), checkpoint_id=str(path), process_group=self._dcp_group())
        return time.perf_counter() - t0

    def load_train_state(self, path: Union[str, Path], version: int) -> float:
        """Read what :meth:`save_train_state` wrote (every rank of a gang of the same layout calls it) and
        become actor ``version``. Returns seconds."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        state = self._train_state("load_train_state")          # the layout to fill, this rank's shards
        dcp.load(state, checkpoint_id=str(path), process_group=self._dcp_group())
        self._set_train_state(state, version)
        return time.perf_counter() - t0

    def train_state_shard(self) -> dict:
        """This rank's part of the training state as plain CPU tensors, with its version: what a recovery snapshot
        writes (:meth:`save_snapshot`) and :meth:`restore_train_state_shard` takes back."""
        state = self._train_state("train_state_shard")
        return {"version": self.version,
                "state": _tree_map(state, lambda t: _local(t).detach().to("cpu", copy=True))}

    def save_snapshot(self, folder: Union[str, Path], version: int) -> float:
        """Copy this rank's training state (:meth:`train_state_shard`) and write it to ``folder`` on this node's disk
        in the background (:mod:`bidirl.cluster.engines.snapshot_files`); :meth:`flush_snapshot` waits for the
        write. Returns the seconds of the copy (what the caller waits for)."""
        if int(version) != self.version:
            raise ValueError(f"save_snapshot: this engine holds version {self.version}, not {version}")
        t0 = time.perf_counter()
        self._snapshots.write(folder, self.version, self.rank, self.train_state_shard())
        return time.perf_counter() - t0

    def flush_snapshot(self) -> dict:
        """Wait for the snapshot write in flight; its report (``version``, ``bytes``, ``seconds``), ``{}`` if none."""
        return self._snapshots.flush()

    def load_snapshot(self, folder: Union[str, Path], version: int) -> float:
        """Take back the snapshot ``version`` this rank wrote to ``folder`` (a restarted rank of the same gang
        layout, on the same node). Returns seconds."""
        return self.restore_train_state_shard(snapshot_files.read(folder, version, self.rank))

    def restore_train_state_shard(self, shard: dict) -> float:
        """Take back what :meth:`train_state_shard` returned on the same rank of a gang of the same layout (the
        sharding comes from this engine's own parameters). Returns seconds."""
        t0 = time.perf_counter()
        template = self._train_state("restore_train_state_shard")
        try:
            state = _rebuild(shard["state"], template)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"restore_train_state_shard: the shard does not fit this engine's state ({exc}); pass "
                             "train_state_shard() of the same rank of a gang with the same model and layout") from None
        self._set_train_state(state, shard["version"])
        return time.perf_counter() - t0

    def _dcp_group(self):
        return self._group if self._group is not None and self.world > 1 else None

    # ------------------------------------------------------------------------------------------
    # hot switching: offload / onload
    # ------------------------------------------------------------------------------------------
    def _state_tensors(self, freed: bool = False) -> list:
        """This rank's weight, optimizer-state and accumulated-gradient tensors, one per storage (``freed``:
        offloaded ones too)."""
        tensors = [_local(p) for p in self.params]
        tensors += [_local(p.grad) for p in self.params if p.grad is not None]
        if self._reference is not None:
            tensors += [_local(p) for p in self._reference.parameters()]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                tensors += [_local(v) for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
        seen, unique = set(), []
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and (freed or t.untyped_storage().nbytes() > 0):
                seen.add(key)
                unique.append(t)
        return unique

    @property
    def offloaded(self) -> bool:
        return self._host.holding

    @property
    def host_buffer_allocations(self) -> int:
        """How many times the offload host buffer was allocated (once per state size, not once per switch)."""
        return self._host.allocations

    def offload(self) -> float:
        """Copy this rank's weights, optimizer state, accumulated gradients (and the reference model, if
        loaded) — its shards when sharded — into the engine's host buffer (:mod:`bidirl.cluster.engines.host_buffer`:
        allocated once, pinned where CUDA is present, reused by every switch) and free the device copy;
        returns seconds."""
        if self._host.holding:
            return 0.0
        self._load_if_pending()
        t0 = time.perf_counter()
        self._reshard(self.model)
        if self._reference is not None:
            self._reshard(self._reference)
        self._host.offload(self._state_tensors())
        self._move_published("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def onload(self) -> float:
        """Re-allocate and restore what :meth:`offload` moved out (the host buffer is kept); returns seconds."""
        if not self._host.holding:
            return 0.0
        t0 = time.perf_counter()
        self._host.restore()
        self._move_published(self.device)
        return time.perf_counter() - t0

    def state_bytes(self) -> int:
        """Bytes of weights + optimizer state (+ accumulated gradients) this rank holds (what offload moves)."""
        if self._host.holding:
            return self._host.nbytes
        self._load_if_pending()
        return sum(t.untyped_storage().nbytes() for t in self._state_tensors())

    def resident_bytes(self) -> int:
        """Bytes of weights + optimizer state allocated on the engine's device now (0 while offloaded)."""
        self._load_if_pending()
        return sum(t.untyped_storage().nbytes() for t in self._state_tensors(freed=True))

    # ------------------------------------------------------------------------------------------
    # the gang: process group and FSDP2 sharding
    # ------------------------------------------------------------------------------------------
    def _backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def init_process_group(self, rank: int, world: int, addr: str, backend: Optional[str] = None,
                           replicas: int = 1) -> None:
        """Join a ``world``-rank gang rendezvousing at ``addr`` (``host:port``; gloo on CPU, NCCL on GPU) and
        shard the model with FSDP2 over a ``(replicas, world / replicas)`` mesh (module docstring); an engine built
        with ``gang=True`` reads only its shards from the checkpoint now.

        Call it before any other work (the optimizer is rebuilt over the sharded parameters).
        """
        import torch.distributed as dist

        if not (0 <= rank < world):
            raise ValueError(f"init_process_group: rank must be in [0, world), got rank={rank}, world={world}")
        if ":" not in addr:
            raise ValueError(f"init_process_group: addr must be 'host:port', got {addr!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or world % replicas:
            raise ValueError(f"init_process_group: replicas must be a positive divisor of world={world}, "
                             f"got {replicas!r}")
        if self.sharded:
            raise RuntimeError("init_process_group: the engine is already sharded; join the gang before any work")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group(backend or self._backend(), init_method=f"tcp://{addr}", rank=rank,
                                    world_size=world)
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise RuntimeError(f"init_process_group: this process already is rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not rank {rank} of {world}")
        self._group = dist.group.WORLD
        self.rank, self.world, self.replicas = rank, world, replicas
        # the weight transport's gathers run beside training (on another thread): a group of their own
        self._transport_group = dist.new_group(backend=backend or self._backend()) if world > 1 else None
        self._shard(self._device_mesh(replicas, world // replicas))

    def _device_mesh(self, replicas: int, shard: int):
        from torch.distributed.device_mesh import init_device_mesh
        if replicas == 1:
            return init_device_mesh(self.device.type, (shard,), mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))

    def _shard_alone(self) -> None:
        """Shard over a one-rank group of this process (bf16-mixed compute needs FSDP2 even without a gang)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(self._backend(), store=dist.HashStore(), rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            raise RuntimeError(f"TrainerEngine: precision 'bf16-mixed' shards the model, and this process is in a "
                               f"group of {dist.get_world_size()} ranks; call init_process_group(rank, world, addr) "
                               "on every rank of the gang before any work")
        self._group = dist.group.WORLD
        self._shard(self._device_mesh(1, 1))

    def _shard(self, mesh) -> None:
        """Shard the model (and the reference) over ``mesh``; one still on the meta device (``gang=True``) is then
        filled with this rank's shards alone."""
        if self.optimizer is not None and self.optimizer.state:
            raise RuntimeError("TrainerEngine: shard the model before the first optimizer step")
        self.mesh = mesh
        for model in (self.model, self._reference):
            if model is not None:
                self._fully_shard(model)
                if _on_meta(model):
                    self._materialise(model)
        self._pending = False
        self._track_parameters()

    def _load_if_pending(self) -> None:
        """An engine built for a gang (``gang=True``) asked for work before joining one: load it as a lone engine
        (sharded over its own one-rank group when it computes in bf16-mixed, whole otherwise)."""
        if not self._pending:
            return
        if self.precision == "bf16-mixed":
            self._shard_alone()
            return
        for model in (self.model, self._reference):
            if model is not None:
                self._materialise(model)
        self._pending = False
        self._track_parameters()

    def _fully_shard(self, model) -> None:
        """FSDP2 over the engine's mesh: each transformer block, then the root; gradients reduced as sums."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if self.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        for block in checkpoint.transformer_blocks(model):
            fully_shard(block, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)                   # sum, not mean, over the gang
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)      # plain SUM collectives (gloo has no PREMUL_SUM)
                elif self._backend() == "gloo":
                    raise RuntimeError("TrainerEngine: this torch's FSDP2 cannot reduce gradients as sums over gloo "
                                       "(no set_force_sum_reduction_for_comms); use torch >= 2.8")

    def destroy_process_group(self) -> None:
        """Leave the gang's process group (the engine cannot run sharded work afterwards)."""
        import torch.distributed as dist

        if self._group is not None and dist.is_initialized() and self.world > 1:
            dist.destroy_process_group()
        self._group = None
        self.rank, self.world = 0, 1
