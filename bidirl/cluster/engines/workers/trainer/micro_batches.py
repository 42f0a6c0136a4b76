"""Token-budget micro-batches of a trainer rank (``rl.max_tokens_per_micro_batch``; veRL's ``actor.use_dynamic_bsz``
with ``ppo_max_token_len_per_gpu`` and, for the log-prob stages, ``log_prob_max_token_len_per_gpu``; paper §5.2's
micro-batch per device).

A rank's share of a chunk (the samples :func:`~.shares.rank_shares` deals it) runs as several forward (and
backward) passes of at most ``max_tokens_per_micro_batch`` tokens each instead of one pass over the whole share.
The engine pads a micro-batch to its longest sample (``Compute._batch``: right-padded ``[B, T]`` ids), so the
budget bounds the *padded* tokens ``B · T`` — what the activations of one pass hold (``perf.memory``'s
``activations`` term at the budget's tokens). :func:`token_micro_batches` packs the share's samples, longest first,
into consecutive runs whose padded size fits.

**The loss.** Every micro-batch's loss is divided by the same normaliser — the step's (``grpo.loss_normalizer``),
or without one the share's own count summed over the gang, as one pass would use — and their gradients accumulate
into ``p.grad``; the GRPO loss (token-mean or seq-mean-token-mean) is a sum over samples once its normaliser is
fixed, so the micro-batches' gradients sum to the one-pass gradient up to fp32 rounding.

**A gang.** Every pass of a sharded engine is a collective (FSDP2's all-gathers and, in a backward, the gradient
reduction), and every pass yields the gang's launch order at each block
(:mod:`~bidirl.cluster.engines.workers.launch_order`), so all ranks of the gang must run as many: the ranks agree on
the largest count (an all-reduce MAX over the whole gang, for log-probs as for gradients) and a rank with fewer
joins the remaining rounds with an empty share (``Compute._join_with_empty_share``), as veRL makes every rank run
the same number of micro-batches under dynamic batch sizes. A count agreed per replica is not enough: the passes of
two replicas need no common collective, but the leader logs a turn for each of its own yields, and a replica that
ran fewer passes would wait for ever on the turns it never takes (its weight send stalls behind them).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`; it uses the compute mixin's
single-pass ``_chunk_backward`` and ``_token_logprobs`` unchanged.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from bidirl.cluster.engines.workers.trainer.compute import ChunkGradient
from bidirl.cluster.engines.workers.trainer.tensors import as_1d
from bidirl.rl import grpo


def token_micro_batches(widths: Sequence[int], budget: int) -> list:
    """Pack samples of ``widths`` tokens (prompt + response) into micro-batches whose padded size (samples × the
    longest one) is at most ``budget`` tokens: the samples taken longest first (ties in order), each run as long as
    it fits. Returns lists of sample positions. A sample longer than the budget is refused by name."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"token_micro_batches: the budget must be a positive number of tokens, got {budget!r}")
    order = sorted(range(len(widths)), key=lambda i: -int(widths[i]))
    out: list = []
    for i in order:
        w = int(widths[i])
        if w > budget:
            raise ValueError(f"rl.max_tokens_per_micro_batch: a sample of {w} tokens (prompt + response) does not fit "
                             f"a micro-batch of {budget} tokens; raise the budget to at least the longest sample")
        if out and (len(out[-1]) + 1) * int(widths[out[-1][0]]) <= budget:   # the run's first is its longest
            out[-1].append(i)
        else:
            out.append([i])
    return out


def merge_stats(stats: Sequence[dict]) -> dict:
    """One share's :class:`~bidirl.rl.grpo.LossStats` dict from its micro-batches': the losses (already divided by
    the common normaliser) and the counts summed, the per-token means weighted by tokens."""
    stats = [s for s in stats if s.get("tokens") or s.get("sequences")]
    if not stats:
        return grpo.empty_stats()
    out = dict(stats[0])
    for key in ("loss", "pg_loss"):
        out[key] = float(sum(s[key] for s in stats))
    for key in ("tokens", "sequences"):
        out[key] = int(sum(s[key] for s in stats))
    for key in ("kl", "clip_frac", "ratio_mean"):
        out[key] = grpo.token_weighted(stats, key)
    return out


class MicroBatches:
    """A share's log-probs and gradient in token-budget micro-batches (the module docstring)."""

    def _share_widths(self, samples) -> list:
        return [len(s.prompt_ids) + len(s.response_ids) for s in samples]

    def _rounds(self, samples) -> list:
        """This rank's micro-batches, padded with empty ones to the count every rank of the gang runs."""
        batches = token_micro_batches(self._share_widths(samples), self.max_tokens_per_micro_batch) if samples else []
        if self.sharded and self._group is not None and self.world > 1:
            n = torch.tensor([len(batches)], dtype=torch.int64, device=self._comm_device())
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=self._group)
            batches += [[] for _ in range(int(n) - len(batches))]
        return batches

    def _budget_logprobs(self, net, samples: list) -> list:
        """:meth:`Compute.logprobs`'s result for ``samples``, one token-budget micro-batch at a time."""
        out: list = [None] * len(samples)
        for batch in self._rounds(samples):
            if not batch:
                self._join_with_empty_share(net, grad=False)
                continue
            lp, _, rlen = self._token_logprobs(net, [samples[i] for i in batch], grad=False)
            lp = lp.cpu()
            for j, (i, n) in enumerate(zip(batch, rlen)):
                out[i] = lp[j, :n].clone()
        self._reshard(net)
        return out

    def _share_backward(self, samples: list, advantages, old_logprobs, ref_logprobs,
                        normalizer: Optional[float]) -> ChunkGradient:
        """The share's loss backward into ``p.grad``: one pass (``Compute._chunk_backward``) without a budget, else
        one per token-budget micro-batch under the share's common normaliser."""
        if self.max_tokens_per_micro_batch is None:
            return self._chunk_backward(samples, advantages, old_logprobs, ref_logprobs, normalizer)
        t0 = time.perf_counter()
        if not samples and normalizer is None:
            raise ValueError("chunk_gradients: an empty share needs the step's normalizer")
        if samples and normalizer is None:          # the share's own count over the gang, as one pass takes it
            normalizer = grpo.loss_normalizer([len(s.response_ids) for s in samples], self.loss_agg)
            if self._group is not None and self.world > 1:
                n = torch.tensor([normalizer], dtype=torch.float64, device=self._comm_device())
                torch.distributed.all_reduce(n, group=self._group)
                normalizer = float(n)
        adv = as_1d(advantages) if samples else None
        if adv is not None and adv.numel() != len(samples):
            raise ValueError(f"chunk_gradients: got {adv.numel()} advantages for {len(samples)} samples")
        for name, rows in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
            if rows is not None and samples and len(rows) != len(samples):
                raise ValueError(f"chunk_gradients: got {len(rows)} {name} for {len(samples)} samples")
        stats, tokens = [], 0
        for batch in self._rounds(samples):
            part = self._chunk_backward(
                [samples[i] for i in batch], adv[batch] if batch else [], [old_logprobs[i] for i in batch],
                [ref_logprobs[i] for i in batch] if ref_logprobs is not None else None, normalizer)
            stats.append(part.stats)
            tokens += part.tokens
        return ChunkGradient(None, merge_stats(stats), len(samples), tokens, time.perf_counter() - t0)
