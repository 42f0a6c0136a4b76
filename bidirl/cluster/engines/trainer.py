"""The torch trainer engine: log-prob stages, chunk gradients, ordered merge + AdamW, offload/onload, DP.

One ``TrainerEngine`` is one data-parallel rank of a trainer gang (paper §2.1, §5). It runs the three
trainer stages of a GRPO step (protocol ``STAGES``):

* ``old_logprob`` / ``ref_logprob`` — :meth:`TrainerEngine.logprobs` recomputes the per-token log-probs
  of response tokens under the actor (or the frozen reference = the initial weights);
* ``actor_update`` — :meth:`TrainerEngine.chunk_gradients` computes one chunk's gradient of the GRPO loss
  (``bidirl.rl.grpo.policy_loss``) as a flat fp32 vector; primary and auxiliary trainers alike (§5.2,
  Trainer-on-RollPool). :meth:`TrainerEngine.apply` (primary only) sums the chunk gradients **in the
  order given** — the original chunk order, so borrowing never changes what the update computes (§6.3,
  Table 2) — and takes one AdamW step.

Weights move with :meth:`state_dict` / :meth:`load_state_dict` (weight sync to rollouters and auxiliary
trainers, §6.2). :meth:`offload` / :meth:`onload` move the weights and optimizer state to a host buffer
and back and free the device copy (the trainer half of a hot switch's C_in / C_out, §3.2): each tensor's
storage is copied to host memory (pinned when CUDA is present) and then resized to zero bytes, and
restored by re-allocating and copying back — on CPU this is a real free and re-allocation of the
engine's memory, so the measured seconds are an honest CPU C_in/C_out figure.

Data parallelism: :meth:`init_process_group` joins a ``torch.distributed`` gloo (CPU) / nccl (GPU)
group; each rank computes the gradient of its own micro-batch and :meth:`chunk_gradients` all-reduces
(sums) it, so every rank holds the gang's chunk gradient and applies the same update (DDP semantics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from bidirl.core.protocol import PRIMARY, ROLES
from bidirl.rl import grpo


@dataclass
class ChunkGradient:
    """One chunk's gradient as a flat fp32 vector (parameter order of ``model.parameters()``)."""
    flat: torch.Tensor
    stats: dict
    samples: int
    tokens: int
    seconds: float


@dataclass
class _HostCopy:
    tensors: list = field(default_factory=list)     # (device tensor, host tensor) pairs, one per storage
    nbytes: int = 0


def _as_1d(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).reshape(-1)


class TrainerEngine:
    """A GRPO trainer over ``Qwen2ForCausalLM`` in fp32 (see the module docstring for the stages).

    ``lr``, ``weight_decay``, ``betas``: AdamW; ``kl_coef``: β of the k3 KL to the reference (the initial
    weights); ``clip_eps`` / ``clip_eps_high``: PPO clip range; ``loss_agg``: see ``bidirl.rl.grpo``;
    ``max_grad_norm``: clip the summed gradient (``None``: no clipping). ``seed`` seeds the (forked) torch
    RNG while the model loads; training itself draws no random numbers (the tiny model has no dropout).
    ``threads`` sets torch's intra-op thread count for the whole process (for an engine that owns its
    process, e.g. inside a Ray actor; one thread is fastest for the tiny model on a shared 2-core machine).
    """

    def __init__(self, model_dir: Union[str, Path], lr: float = 1e-3, seed: int = 0, kl_coef: float = 0.0,
                 role: str = PRIMARY, device: str = "cpu", *, clip_eps: float = 0.2,
                 clip_eps_high: Optional[float] = None, loss_agg: str = "token-mean",
                 max_grad_norm: Optional[float] = 1.0, weight_decay: float = 0.0,
                 betas: tuple = (0.9, 0.999), threads: Optional[int] = None):
        from transformers import Qwen2ForCausalLM

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
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"TrainerEngine.threads must be a positive integer or None, got {threads!r}")
            torch.set_num_threads(threads)   # the engine owns its process (a Ray actor) when this is set
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"TrainerEngine.model_dir {str(self.model_dir)!r} holds no config.json; create the "
                             "model first (bidirl.rl.bootstrap.ensure_tiny_model())")
        self.device = torch.device(device)
        self.role, self.seed, self.lr, self.kl_coef = role, int(seed), float(lr), float(kl_coef)
        self.clip_eps, self.clip_eps_high, self.loss_agg = float(clip_eps), clip_eps_high, loss_agg
        self.max_grad_norm = max_grad_norm
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = Qwen2ForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device)
        self.model.eval()        # no dropout in the tiny model; eval() also keeps HF from caching
        self.params = [p for p in self.model.parameters()]
        for p in self.params:    # own, resizable storage (from_pretrained may map the checkpoint file)
            p.data = p.data.clone()
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer = (torch.optim.AdamW(self.params, lr=self.lr, betas=tuple(betas), weight_decay=weight_decay)
                          if role == PRIMARY else None)
        self._reference = None
        self.version = 0
        self.rank, self.world = 0, 1
        self._group = None
        self._host: Optional[_HostCopy] = None

    # ------------------------------------------------------------------------------------------
    # batching
    # ------------------------------------------------------------------------------------------
    def _batch(self, samples: Sequence):
        """Right-padded prompt+response ids, attention mask, and the gather indices of response tokens."""
        if len(samples) == 0:
            raise ValueError("TrainerEngine: got an empty list of samples")
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
        P = torch.tensor(plen)[:, None]
        R = torch.tensor(rlen)[:, None]
        mask = t < R
        pos = torch.where(mask, P - 1 + t, torch.zeros_like(t))        # logits at pos predict token pos + 1
        tgt = torch.gather(ids, 1, torch.where(mask, P + t, torch.zeros_like(t)))
        return ids.to(self.device), attn.to(self.device), pos.to(self.device), tgt.to(self.device), \
            mask.to(self.device), rlen

    def _token_logprobs(self, model, samples, grad: bool):
        ids, attn, pos, tgt, mask, rlen = self._batch(samples)
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            logits = model(input_ids=ids, attention_mask=attn).logits.float()
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
            picked = logits[rows, pos]                                   # [B, T, V]
            lp = torch.log_softmax(picked, dim=-1).gather(-1, tgt[..., None]).squeeze(-1)
            lp = lp * mask
        return lp, mask, rlen

    def _check_onloaded(self, what: str):
        if self._host is not None:
            raise RuntimeError(f"TrainerEngine.{what}: the engine is offloaded; call onload() first")

    # ------------------------------------------------------------------------------------------
    # stages
    # ------------------------------------------------------------------------------------------
    def logprobs(self, samples: Sequence, model: str = "actor") -> list:
        """Per-token log-probs of each sample's response tokens (list of 1-D fp32 CPU tensors).

        ``model="actor"``: the current weights (the ``old_logprob`` stage); ``"reference"``: the initial
        weights from ``model_dir``, frozen (the ``ref_logprob`` stage, loaded on first use).
        """
        self._check_onloaded("logprobs")
        if model == "actor":
            net = self.model
        elif model == "reference":
            net = self.reference_model()
        else:
            raise ValueError(f"TrainerEngine.logprobs: model must be 'actor' or 'reference', got {model!r}")
        lp, _, rlen = self._token_logprobs(net, samples, grad=False)
        lp = lp.cpu()
        return [lp[i, :n].clone() for i, n in enumerate(rlen)]

    def reference_model(self):
        if self._reference is None:
            from transformers import Qwen2ForCausalLM
            self._check_onloaded("reference_model")
            ref = Qwen2ForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device)
            ref.eval().requires_grad_(False)
            for p in ref.parameters():       # own, resizable storage (offloaded with the actor)
                p.data = p.data.clone()
            self._reference = ref
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
                        reduce: bool = True) -> ChunkGradient:
        """The gradient of this chunk's share of the GRPO loss, flattened (fp32, CPU).

        ``advantages``: one per sample (``grpo.group_advantages``); ``old_logprobs`` / ``ref_logprobs``:
        per-sample per-token sequences as returned by :meth:`logprobs`. ``normalizer`` is the *step's*
        token (or sequence) count when the step is split into several chunks
        (``grpo.loss_normalizer``); ``None`` uses this chunk's own count, summed over the DP group.
        With ``reduce`` and a DP group, the gradient is all-reduced (summed) over the gang.
        """
        self._check_onloaded("chunk_gradients")
        if len(samples) == 0:
            # A DP rank with no share of a small chunk still joins the gang's all-reduce.
            if normalizer is None:
                raise ValueError("chunk_gradients: an empty share needs the step's normalizer")
            flat = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
            if self._group is not None and reduce:
                torch.distributed.all_reduce(flat, group=self._group)
            return ChunkGradient(flat.cpu(), grpo.empty_stats(), 0, 0, 0.0)
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("chunk_gradients: kl_coef > 0 needs ref_logprobs (run logprobs(samples, 'reference'))")
        t0 = time.perf_counter()
        adv = _as_1d(advantages).to(self.device)
        if adv.numel() != len(samples):
            raise ValueError(f"chunk_gradients: got {adv.numel()} advantages for {len(samples)} samples")
        for p in self.params:
            p.grad = None
        self.model.train()
        try:
            lp, mask, rlen = self._token_logprobs(self.model, samples, grad=True)
        finally:
            self.model.eval()
        old = self._pad(old_logprobs, rlen, "old_logprobs")
        ref = self._pad(ref_logprobs, rlen, "ref_logprobs") if ref_logprobs is not None else None
        if normalizer is None:
            normalizer = grpo.loss_normalizer(rlen, self.loss_agg)
            if self._group is not None and reduce:
                n = torch.tensor([normalizer], dtype=torch.float64)
                torch.distributed.all_reduce(n, group=self._group)
                normalizer = float(n)
        loss, stats = grpo.policy_loss(lp, old, adv, mask, clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high,
                                       ref_logprobs=ref, kl_coef=self.kl_coef, loss_agg=self.loss_agg,
                                       normalizer=normalizer if normalizer > 0 else None)
        loss.backward()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None
        flat = flat.detach().to(torch.float32)
        if self._group is not None and reduce:
            torch.distributed.all_reduce(flat, group=self._group)
        flat = flat.cpu()
        return ChunkGradient(flat, stats.to_dict(), len(samples), int(sum(rlen)), time.perf_counter() - t0)

    def apply(self, grads_in_chunk_order: Iterable) -> dict:
        """Sum chunk gradients left to right in the given order, clip, take one AdamW step (primary only)."""
        if self.role != PRIMARY:
            raise RuntimeError(f"TrainerEngine.apply: an {self.role} trainer computes chunk gradients only; "
                               "send them to the primary trainer, which applies the update")
        self._check_onloaded("apply")
        t0 = time.perf_counter()
        total = None
        count = 0
        for g in grads_in_chunk_order:
            flat = g.flat if isinstance(g, ChunkGradient) else torch.as_tensor(g, dtype=torch.float32)
            flat = flat.reshape(-1)
            if flat.numel() != self.numel:
                raise ValueError(f"apply: chunk gradient {count} has {flat.numel()} values, the model has {self.numel}")
            total = flat.clone() if total is None else total.add_(flat)
            count += 1
        if total is None:
            raise ValueError("apply: no chunk gradients given")
        total = total.to(self.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset:offset + n].view_as(p).clone()
            offset += n
        grad_norm = float(torch.linalg.vector_norm(total))
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.version += 1
        return {"version": self.version, "grad_norm": grad_norm, "chunks": count,
                "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full model ``state_dict`` on CPU (tied ``lm_head.weight`` included, as vLLM's reload needs)."""
        self._check_onloaded("state_dict")
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict, version: Optional[int] = None) -> float:
        """Overwrite the weights (weight sync to an auxiliary trainer); returns the seconds spent."""
        self._check_onloaded("load_state_dict")
        t0 = time.perf_counter()
        state = dict(state)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {list(unexpected)[:5]}; "
                             "pass the state_dict() of a trainer of the same model")
        if version is not None:
            self.version = int(version)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------
    # hot switching: offload / onload
    # ------------------------------------------------------------------------------------------
    def _state_tensors(self) -> list:
        tensors = [p.data for p in self.params]
        if self._reference is not None:
            tensors += [p.data for p in self._reference.parameters()]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
        seen, unique = set(), []
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and t.untyped_storage().nbytes() > 0:
                seen.add(key)
                unique.append(t)
        return unique

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def offload(self) -> float:
        """Copy weights, optimizer state (and the reference model, if loaded) to a host buffer and free the
        engine's copy; returns seconds."""
        if self._host is not None:
            return 0.0
        t0 = time.perf_counter()
        pin = torch.cuda.is_available()
        host = _HostCopy()
        for t in self._state_tensors():
            storage = t.untyped_storage()
            buf = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            buf.untyped_storage().copy_(storage, non_blocking=pin)
            host.tensors.append((t, buf))
            host.nbytes += storage.nbytes()
        if pin:
            torch.cuda.synchronize()
        for t, _ in host.tensors:
            t.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._host = host
        return time.perf_counter() - t0

    def onload(self) -> float:
        """Re-allocate and restore what :meth:`offload` moved out; returns seconds."""
        if self._host is None:
            return 0.0
        t0 = time.perf_counter()
        for t, buf in self._host.tensors:
            storage = t.untyped_storage()
            storage.resize_(buf.numel())
            storage.copy_(buf.untyped_storage(), non_blocking=buf.is_pinned())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._host = None
        return time.perf_counter() - t0

    def state_bytes(self) -> int:
        """Bytes of weights + optimizer state the engine holds (what offload moves)."""
        if self._host is not None:
            return self._host.nbytes
        return sum(t.untyped_storage().nbytes() for t in self._state_tensors())

    # ------------------------------------------------------------------------------------------
    # data parallelism
    # ------------------------------------------------------------------------------------------
    def init_process_group(self, rank: int, world: int, addr: str, backend: Optional[str] = None) -> None:
        """Join a ``world``-rank DP group rendezvousing at ``addr`` (``host:port``); gloo on CPU."""
        import torch.distributed as dist

        if not (0 <= rank < world):
            raise ValueError(f"init_process_group: rank must be in [0, world), got rank={rank}, world={world}")
        if ":" not in addr:
            raise ValueError(f"init_process_group: addr must be 'host:port', got {addr!r}")
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{addr}", rank=rank, world_size=world)
        self._group = dist.group.WORLD
        self.rank, self.world = rank, world

    def destroy_process_group(self) -> None:
        import torch.distributed as dist

        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._group = None
        self.rank, self.world = 0, 1
