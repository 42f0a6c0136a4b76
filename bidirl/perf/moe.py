"""Mixture-of-experts terms of the stage-time models: which weights a batch of tokens touches (docs/architecture.md,
"MoE").

The appendix's stage models charge compute by ``2·N_nonemb`` FLOPs per token and decode by the bytes of weights
each iteration streams. For an MoE model the two part ways: a token's FLOPs are those of its *active* parameters
(:attr:`~bidirl.job.presets.ModelSpec.params_active_nonembedding`, used by :mod:`bidirl.perf.flops`), but a decode
iteration of ``n`` sequences reads every expert that *any* of its ``n`` tokens was routed to.

**Experts touched by a batch (uniform routing).** Let a layer have ``E`` routed experts and a router that sends each
token to ``k`` distinct experts. Under uniform routing every ``k``-subset is equally likely, so a given expert is in
one token's subset with probability ``C(E−1, k−1) / C(E, k) = k/E`` and missed with probability ``1 − k/E``. With
the ``T`` tokens routed independently, the expert is missed by all of them with probability ``(1 − k/E)^T``. By
linearity of expectation over the ``E`` experts,

    E[distinct experts touched] = E · (1 − (1 − k/E)^T),

and the expected fraction of the layer's expert weights read is ``1 − (1 − k/E)^T``: ``k/E`` at ``T = 1``, → 1 as
``T`` grows (Qwen3-30B-A3B, k/E = 8/128: 0.0625 at one token, 0.65 at 16, 0.984 at 64). Real routers are not uniform
(load-balancing losses push them towards it; skew touches fewer experts), so this is the balanced-router estimate.

The rollout model's ``tau_dec`` (:func:`bidirl.perf.params.knob_rollout_params`) streams ``params_total`` bytes per
iteration for every model: for an MoE model that is the large-batch limit of :func:`decode_weight_bytes`, which an
RL rollout with tens of running sequences per replica reaches (it overstates a single sequence's decode).
"""

from __future__ import annotations

import numpy as np


def _count(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be a whole number ≥ {low}, got {value!r}")
    return int(value)


def expected_experts_touched(experts: int, experts_per_token: int, tokens) -> np.ndarray:
    """E · (1 − (1 − k/E)^T): the expected number of distinct experts of one MoE layer that ``tokens`` tokens reach
    under uniform top-k routing (module doc). ``tokens`` may be an array (≥ 0 each)."""
    e = _count(experts, "experts", 1)
    k = _count(experts_per_token, "experts_per_token", 1)
    if k > e:
        raise ValueError(f"experts_per_token={k} exceeds experts={e}")
    t = np.asarray(tokens, dtype=float)
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"tokens must be finite and ≥ 0, got {tokens!r}")
    return e * -np.expm1(t * np.log1p(-k / e)) if k < e else np.where(t > 0, float(e), 0.0)


def touched_fraction(model, tokens) -> np.ndarray:
    """The expected fraction of ``model``'s routed-expert weights that a batch of ``tokens`` tokens reads per MoE
    layer (1 for a dense model: every weight is read)."""
    if not model.is_moe:
        return np.ones_like(np.asarray(tokens, dtype=float))
    return expected_experts_touched(model.experts, model.experts_per_token, tokens) / model.experts


def decode_weight_bytes(model, tokens) -> np.ndarray:
    """Bytes of weights one decode iteration of ``tokens`` running sequences reads: everything but the routed
    experts, plus the expected touched share of those (module doc); ``params_total · dtype_bytes`` for a dense
    model."""
    fraction = touched_fraction(model, tokens)
    dense_part = float(model.params_total) - float(model.routed_expert_params)
    return (dense_part + fraction * float(model.routed_expert_params)) * model.dtype_bytes
