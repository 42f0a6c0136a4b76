"""GRPO: group-normalised advantages and the clipped policy-gradient loss with an optional k3 KL term.

The paper trains with GRPO (§2.1, §7.1; Shao et al. 2024, DeepSeekMath): each prompt's ``G`` responses form
a group, and response ``i``'s advantage is its reward normalised within the group,

    A_i = (r_i − mean(r_1..G)) / (std(r_1..G) + eps),                                         (GRPO adv.)

broadcast to every token of the response. The actor-update stage minimises the PPO clipped surrogate
(Schulman et al. 2017) per token, with ratio ρ_t = exp(log π(o_t) − log π_old(o_t)),

    ℓ_t = max(−A·ρ_t, −A·clip(ρ_t, 1 − ε_low, 1 + ε_high)) + β · KL_t,                       (PPO clip)

where KL_t is the k3 estimator of KL(π ‖ π_ref) (Schulman, "Approximating KL divergence", 2020):
``KL_t = exp(log π_ref − log π) − (log π_ref − log π) − 1 ≥ 0``.

Aggregation is explicit because chunked execution (§5.2, §6.3 and Table 2) splits one step's batch into chunks
whose gradients are summed in order: every chunk divides by the *step's* normaliser, so the sum of chunk
gradients equals the gradient of the whole batch (``normalizer`` below). Two rules are offered:

* ``"token-mean"`` — Σ_i Σ_t ℓ_it / N_tokens (DAPO-style; every token weighs the same);
* ``"seq-mean-token-mean"`` — Σ_i (mean_t ℓ_it) / N_sequences (the original GRPO objective).

All functions are pure torch; shapes are ``[B, T]`` (padded responses) with a ``mask`` of valid tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch

LOSS_AGGS: tuple = ("token-mean", "seq-mean-token-mean")


def group_advantages(rewards, group_size: Optional[int] = None, eps: float = 1e-6,
                     unbiased: bool = True) -> torch.Tensor:
    """GRPO advantages (mean/std over each group).

    ``rewards``: ``[n_groups, group_size]``, or 1-D with ``group_size`` given (consecutive responses form a
    group). The result has the input's shape. ``unbiased`` uses the sample standard deviation (Bessel's
    correction, as veRL's GRPO estimator does); a group of one response has no relative signal and gets
    advantage 0. A group whose rewards are all equal gets advantage 0 (the numerator is 0).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64 if not torch.is_tensor(rewards) else None)
    if not torch.is_floating_point(r):
        r = r.to(torch.float32)
    shape = r.shape
    if r.dim() == 1:
        if group_size is None:
            raise ValueError("group_advantages: 1-D rewards need group_size (responses per prompt)")
        if group_size < 1 or r.numel() % group_size:
            raise ValueError(f"group_advantages: {r.numel()} rewards do not split into groups of {group_size}; "
                             "pass group_size dividing the number of rewards")
        r = r.view(-1, group_size)
    elif r.dim() != 2:
        raise ValueError(f"group_advantages: rewards must be 1-D or [n_groups, group_size], got shape {tuple(shape)}")
    elif group_size is not None and r.shape[1] != group_size:
        raise ValueError(f"group_advantages: rewards have groups of {r.shape[1]} but group_size={group_size}")
    if not torch.isfinite(r).all():
        raise ValueError("group_advantages: rewards must be finite (check the reward function)")
    if eps < 0:
        raise ValueError(f"group_advantages: eps must be ≥ 0, got {eps}")
    n = r.shape[1]
    if n == 1:
        return torch.zeros(shape, dtype=r.dtype)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=1 if unbiased else 0)
    centred = r - mean
    adv = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return adv.reshape(shape)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref): ``exp(d) − d − 1`` with ``d = log π_ref − log π`` (≥ 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class LossStats:
    """Detached diagnostics of one :func:`policy_loss` call (token-level means over the mask)."""
    loss: float
    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float
    tokens: int
    sequences: int

    def to_dict(self) -> dict:
        return asdict(self)


def token_weighted(stats, key: str) -> float:
    """The token-weighted mean of ``key`` over chunk statistics (``LossStats`` dicts with ``tokens``)."""
    w = np.array([st["tokens"] for st in stats], dtype=np.float64)
    return float(np.dot(w, [st[key] for st in stats]) / max(w.sum(), 1.0))


def empty_stats() -> dict:
    """The :class:`LossStats` dict of a share with no samples (a DP rank left out of a small chunk)."""
    return LossStats(0.0, 0.0, 0.0, 0.0, 1.0, 0, 0).to_dict()


def _check(name, t, shape):
    if t.shape != shape:
        raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}; "
                         "pad every per-token tensor to the same [batch, max_response_len]")


def aggregate(values: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token-mean",
              normalizer: Optional[float] = None) -> torch.Tensor:
    """Reduce per-token ``values`` under ``mask`` by ``loss_agg``, dividing by ``normalizer``.

    ``normalizer`` defaults to this batch's own count (valid tokens for ``token-mean``, sequences with at
    least one valid token for ``seq-mean-token-mean``); pass the whole step's count when the batch is one
    chunk of a larger step so that chunk gradients add up to the step's gradient.
    """
    m = mask.to(values.dtype)
    if loss_agg == "token-mean":
        total = (values * m).sum()
        count = m.sum()
    elif loss_agg == "seq-mean-token-mean":
        per_seq_tokens = m.sum(dim=-1)
        seq_mean = (values * m).sum(dim=-1) / per_seq_tokens.clamp(min=1.0)
        total = seq_mean.sum()
        count = (per_seq_tokens > 0).to(values.dtype).sum()
    else:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    denom = count if normalizer is None else torch.as_tensor(float(normalizer), dtype=values.dtype)
    if float(denom) <= 0:
        if normalizer is not None:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        return total * 0.0  # an empty batch contributes nothing (and keeps the graph)
    return total / denom


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_eps: float = 0.2, clip_eps_high: Optional[float] = None,
                ref_logprobs: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                loss_agg: str = "token-mean", normalizer: Optional[float] = None):
    """The GRPO actor loss (PPO clip + β·k3 KL) and its :class:`LossStats`.

    ``logprobs`` (with grad), ``old_logprobs`` (the behaviour policy's, no grad) and ``ref_logprobs`` are
    ``[B, T]``; ``advantages`` is ``[B]`` (one per response, broadcast over tokens) or ``[B, T]``; ``mask``
    marks valid response tokens. ``clip_eps_high`` defaults to ``clip_eps`` (symmetric clipping).
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"policy_loss: logprobs must be [batch, tokens], got shape {tuple(shape)}")
    _check("old_logprobs", old_logprobs, shape)
    _check("mask", mask, shape)
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"policy_loss: {advantages.shape[0]} advantages for {shape[0]} responses")
        advantages = advantages[:, None].expand(shape)
    else:
        _check("advantages", advantages, shape)
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError("policy_loss: clip_eps and clip_eps_high must be ≥ 0")
    if kl_coef < 0:
        raise ValueError(f"policy_loss: kl_coef must be ≥ 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logprobs (the reference model's log-probs)")
    high = clip_eps if clip_eps_high is None else clip_eps_high

    adv = advantages.to(logprobs.dtype)
    old = old_logprobs.to(logprobs.dtype).detach()
    ratio = torch.exp(logprobs - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    pg = torch.maximum(pg1, pg2)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        _check("ref_logprobs", ref_logprobs, shape)
        kl = kl_k3(logprobs, ref_logprobs.to(logprobs.dtype).detach())
        if kl_coef > 0:
            per_token = pg + kl_coef * kl
    loss = aggregate(per_token, mask, loss_agg, normalizer)

    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        n = float(m.sum())
        denom = max(n, 1.0)
        stats = LossStats(
            loss=float(loss),
            pg_loss=float(aggregate(pg, mask, loss_agg, normalizer)),
            kl=float((kl * m).sum() / denom) if kl is not None else 0.0,
            clip_frac=float(((pg2 > pg1).to(m.dtype) * m).sum() / denom),
            ratio_mean=float((ratio * m).sum() / denom),
            tokens=int(n),
            sequences=int((m.sum(dim=-1) > 0).sum()),
        )
    return loss, stats


def loss_normalizer(response_lengths, loss_agg: str = "token-mean") -> float:
    """The step-level normaliser of :func:`aggregate` for responses of the given lengths."""
    lengths = [int(n) for n in response_lengths]
    if loss_agg == "token-mean":
        return float(sum(lengths))
    if loss_agg == "seq-mean-token-mean":
        return float(sum(1 for n in lengths if n > 0))
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
