"""The trainer's compute: the log-prob stages, one chunk's gradient, and the ordered merge + AdamW step (paper
§2.1, §5.2, §6.3; the ``TrainerEngine`` docstring).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: it uses the engine's ``model``,
``params``, ``local_shapes``, ``optimizer``, ``accumulated``, ``windows`` and the loss settings, and its
distribution mixin for the gang's collectives.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from bidirl.cluster.engines.workers.logprob import response_logprobs
from bidirl.cluster.engines.workers.launch_order import gang_call
from bidirl.cluster.engines.workers.trainer.ordered_sum import OrderedSum
from bidirl.cluster.engines.workers.trainer.tensors import as_1d, is_dtensor, like_param, local_part, local_slice
from bidirl.core.protocol import PRIMARY
from bidirl.rl import grpo
from bidirl.rl import model_folder as checkpoint


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


class Compute:
    """Log-probs, chunk gradients (accumulated on the device or returned), and ``apply``."""

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
        the head on response positions only, in chunks (:mod:`bidirl.cluster.engines.workers.logprob`)."""
        ids, attn, (rows, steps, cols), tgt, mask, rlen = self._batch(samples)
        self.passes_run += 1
        with torch.enable_grad() if grad else torch.no_grad(), self._replaying(model, samples, ids.shape[1]):
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

    @gang_call
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
        if self.max_tokens_per_micro_batch is not None:      # token-budget micro-batches (.micro_batches)
            return self._budget_logprobs(net, samples)
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
            if self._launches is not None:               # its blocks are yield points too (launch_order)
                from bidirl.cluster.engines.workers import launch_order
                launch_order.yield_at_blocks(checkpoint.transformer_blocks(self._reference), lambda: self._launches)
        return self._reference

    def _pad(self, rows: Sequence, rlen: list, name: str) -> torch.Tensor:
        if len(rows) != len(rlen):
            raise ValueError(f"chunk_gradients: got {len(rows)} {name} for {len(rlen)} samples")
        out = torch.zeros(len(rlen), max(max(rlen), 1), dtype=torch.float32)
        for i, (r, n) in enumerate(zip(rows, rlen)):
            v = as_1d(r)
            if v.numel() != n:
                raise ValueError(f"chunk_gradients: {name}[{i}] has {v.numel()} values for a response of {n} tokens")
            out[i, :n] = v
        return out.to(self.device)

    @gang_call
    def chunk_gradients(self, samples: Sequence, advantages, old_logprobs: Sequence,
                        ref_logprobs: Optional[Sequence] = None, normalizer: Optional[float] = None,
                        accumulate: bool = False, chunk_id=None, position: Optional[tuple] = None) -> ChunkGradient:
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

        ``position`` = ``(first unit, units)`` of the chunk in the step's update segment (with ``accumulate``): the
        step's gradient is then summed in unit order (:mod:`.ordered_sum`) — a primary rank adds the chunk into
        ``p.grad`` if it is the next in order and keeps it in a buffer of its own otherwise; an auxiliary rank keeps
        every chunk apart for its window. Without it chunks add in the order they finish.
        """
        self._ready("chunk_gradients")
        samples = list(samples)
        if accumulate and position is not None:
            first, units = (int(x) for x in position)
            if self.role == PRIMARY and self.order.expects(first):
                out = self._share_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
                self.order.advance(first, units)
                self._fold_ready()
            else:
                out = self._chunk_apart(samples, advantages, old_logprobs, ref_logprobs, normalizer)
                self.order.hold(first, units, out.flat, chunk_id)
                out.flat = None
            self.accumulated.append(chunk_id)
            return out
        if not accumulate:
            kept = [p.grad for p in self.params]          # set aside what earlier chunks accumulated
            for p in self.params:
                p.grad = None
            try:
                out = self._share_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
                out.flat = self._local_grad_vector().cpu()
            finally:
                for p, g in zip(self.params, kept):
                    p.grad = g
            return out
        out = self._share_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
        self.accumulated.append(chunk_id)
        return out

    def _chunk_apart(self, samples, advantages, old_logprobs, ref_logprobs, normalizer) -> ChunkGradient:
        """The chunk's gradient shard on its own (``flat``, on the device), ``p.grad`` left as it was."""
        kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            out = self._share_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
            out.flat = self._local_grad_vector()
        finally:
            for p, g in zip(self.params, kept):
                p.grad = g
        return out

    def _fold_ready(self) -> None:
        """Add the held chunks that are now next in order into ``p.grad``, in order."""
        for flat in self.order.ready():
            self._add_to_grads(flat)

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
        adv = as_1d(advantages).to(self.device)
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
        self.order = OrderedSum()

    def _local_grad_vector(self) -> torch.Tensor:
        """This rank's gradient shards, flattened in parameter order (zeros where a parameter got none)."""
        parts = [(local_part(p.grad).reshape(-1) if p.grad is not None
                  else torch.zeros(math.prod(s), device=self.device))
                 for p, s in zip(self.params, self.local_shapes)]
        return torch.cat(parts).detach().to(torch.float32)

    @gang_call
    def full_gradient(self, local_flat: torch.Tensor) -> torch.Tensor:
        """The full gradient (parameter order, fp32, CPU) from every rank's shard vector ``local_flat``.

        A collective on a sharded engine: every rank of the gang calls it with its own shard (it is how an
        auxiliary gang's chunk gradient leaves the gang once, unsharded). Unsharded: ``local_flat`` itself.
        """
        flat = as_1d(local_flat)
        if flat.numel() != self.local_numel:
            raise ValueError(f"full_gradient: got {flat.numel()} values, this rank's shard has {self.local_numel}")
        if not self.sharded:
            return flat.cpu()
        parts, offset = [], 0
        for p, shape in zip(self.params, self.local_shapes):
            n = math.prod(shape)
            local = flat[offset:offset + n].view(shape).to(self.device)
            parts.append(like_param(local, p).full_tensor().reshape(-1).cpu())
            offset += n
        return torch.cat(parts)

    def local_gradient(self, flat) -> torch.Tensor:
        """This rank's shard of a gradient vector: a full gradient (``numel`` values, parameter order) is cut
        to the shard; a shard vector (``local_numel`` values) is returned as is (no communication)."""
        flat = as_1d(flat) if not isinstance(flat, ChunkGradient) else flat.flat.reshape(-1)
        if flat.numel() == self.local_numel:
            return flat
        if flat.numel() != self.numel:
            raise ValueError(f"chunk gradient has {flat.numel()} values; the model has {self.numel} and this rank's "
                             f"shard {self.local_numel}: pass a gradient of this model (full or this rank's shard)")
        parts, offset = [], 0
        for p in self.params:
            n = p.numel()
            parts.append(local_slice(flat[offset:offset + n].view(p.shape), p).reshape(-1))
            offset += n
        return torch.cat(parts)

    @gang_call
    def apply(self, grads_in_chunk_order: Iterable = (), windows: Optional[dict] = None, final: bool = True) -> dict:
        """Clip the step's summed gradient and take one AdamW step on the device (primary only). ``final``: the
        local update's last optimizer update, which makes the next version; an optimizer mini-batch's update before
        it (``rl.mini_batch_prompts``: one per mini-batch, veRL's ``update_policy``) changes the weights and keeps the
        version (the rollouters get the weights once per step).

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
        self._wait_state_copy("apply")                       # the snapshot's copy reads the weights it changes
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
            if isinstance(flat, list):                   # a window of chunks kept apart: each to its place in order
                for first, units, cid, piece in flat:
                    self.order.hold(first, units, piece, cid)
            else:
                total = flat.clone() if total is None else total.add_(flat)
            count += len(ids)
        if count == 0:
            raise ValueError("apply: no chunk gradients given or accumulated")
        if self.order.upto or self.order.held:
            if total is not None:
                raise ValueError("apply: a step summed in unit order takes its other gradients with their positions "
                                 "(held in order), not as a sum")
            self._fold_ready()
            self.order.check_complete("apply")
        if total is not None:
            self._add_to_grads(total)
        for p in self.params:                              # a parameter no chunk reached: a zero gradient
            if p.grad is None:
                p.grad = like_param(torch.zeros_like(local_part(p)), p)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self._clear_grads()
        if final:
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
                p.grad = like_param(part.clone(), p)
            else:
                local_part(p.grad).add_(part)
            offset += n

    def discard_gradients(self) -> int:
        """Forget the chunk gradients accumulated since the last step (a step started over); returns how many."""
        n = len(self.accumulated)
        self._clear_grads()
        return n

    def _clip_gradients(self) -> float:
        """The global L2 norm of the summed gradient (before clipping); clips to ``max_grad_norm`` if set."""
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params])
        if is_dtensor(norm):
            norm = norm.full_tensor()
        return float(norm)
