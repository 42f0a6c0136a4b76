"""Rounding bounds the tests' fp32 tolerances are derived from — written once, used by every engine test.

Rounding model: an inner product (or sum) of length n computed in fp32 has a relative error ≤ λ·√n·u of
Σ|x_i·y_i| (u = 2**-24) with probability ≥ 1 − 2·exp(−λ²/2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019);
λ = 6, so a reduction exceeds it with probability ≤ 3e-8. Two computations that differ only in how they round
(another kernel, blocking, thread split or summation order: vLLM's CPU kernels against torch's, a gang's shards
against one process, another CPU's SIMD width) differ by at most twice that. The relative errors of the
reductions on one logit's path add to first order (RMS-normed residual blocks have gain ≈ 1): ρ = λ·u·Σ√n_i over
the path (:func:`logit_path`); two computations of a logit of magnitude Z differ by ≤ 2ρ·Z, and of a log-prob
z_y − logsumexp(z) by ≤ 2·2ρ·Z_max (:func:`logprob_tolerance`).

Z_max comes from the weights, not from a run's output (:func:`max_logit_bound`): a logit is z_v = W_v·n(h) with
n the final RMSNorm, n(h) = γ ⊙ h / rms(h), whose norm is at most max|γ|·√H (h / rms(h) has norm √H), so
|z_v| ≤ ‖W_v‖₂·max|γ|·√H. Weights seen earlier in a run differ from the final ones by at most the AdamW steps
between them: |Δw| ≤ lr·(κ + wd·|w|) per step, κ = max(1, (1 − β1)/√(1 − β2)) (Kingma & Ba 2015, §2.1;
3.16 for β = (0.9, 0.999)).
"""

from __future__ import annotations

import math

FP32_UNIT_ROUNDOFF = 2.0 ** -24
ROUNDING_LAMBDA = 6.0                    # a reduction exceeds λ·√n·u w.p. ≤ 2·exp(−18) ≈ 3e-8
ADAM_STEP_BOUND = max(1.0, (1 - 0.9) / math.sqrt(1 - 0.999))     # κ: |Δw| / lr per AdamW step, at most


def logit_path(cfg, seq_len: int) -> float:
    """Σ√n over the reductions on one logit's path through the decoder ``cfg`` (a transformers config) for
    sequences of at most ``seq_len`` tokens. One decoder layer: RMSNorm (h), q/k/v (h), attention scores (head
    dim), softmax sum and P·V (≤ seq_len each), o_proj (h), RMSNorm (h), gate/up (h), down (intermediate f); then
    the final RMSNorm (h), the LM head (h) and logsumexp (vocab)."""
    h, f, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    head = h // cfg.num_attention_heads
    per_layer = 4 * math.sqrt(h) + math.sqrt(head) + 2 * math.sqrt(seq_len) + 2 * math.sqrt(h) + math.sqrt(f)
    return layers * per_layer + 2 * math.sqrt(h) + math.sqrt(vocab)


def logit_rho(cfg, seq_len: int) -> float:
    """ρ = λ·u·Σ√n: the relative rounding error of one logit's computation (module docstring)."""
    return ROUNDING_LAMBDA * FP32_UNIT_ROUNDOFF * logit_path(cfg, seq_len)


def logprob_tolerance(cfg, seq_len: int, max_logit: float) -> float:
    """Two fp32 computations of one log-prob that differ in rounding only differ by ≤ 2·(2ρ·Z_max)."""
    return 2 * (2 * logit_rho(cfg, seq_len) * max_logit)


def max_logit_bound(weights: dict, cfg, lr: float = 0.0, steps: int = 0, weight_decay: float = 0.0) -> float:
    """An upper bound on |logit| for the model whose (HF-named, fp32) state dict is ``weights`` and for every
    weights within ``steps`` AdamW steps of learning rate ``lr`` of it (module docstring)."""
    import torch

    head = weights.get("lm_head.weight")
    if head is None:                         # tied: the head is the embedding
        head = weights["model.embed_tokens.weight"]
    gamma = weights["model.norm.weight"]
    drift = lr * steps * (ADAM_STEP_BOUND + weight_decay * float(max(head.abs().max(), gamma.abs().max())))
    h = cfg.hidden_size
    row_norm = float(torch.linalg.vector_norm(head.float(), dim=1).max()) + math.sqrt(h) * drift
    return row_norm * (float(gamma.abs().max()) + drift) * math.sqrt(h)


def run_logprob_tolerance(model_dir, weights: dict, lr: float, steps: int) -> float:
    """The log-prob tolerance of a run of ``steps`` AdamW steps at ``lr`` that ended at ``weights``: vLLM's
    log-probs of the sampled tokens against the trainer's recomputation on the same weights, any sequence the
    model's positions allow."""
    from bidirl.rl.model_folder import causal_lm_config
    cfg = causal_lm_config(model_dir, "model_dir")
    return logprob_tolerance(cfg, cfg.max_position_embeddings, max_logit_bound(weights, cfg, lr, steps))


#: parameters whose exact gradient is zero: a shift shared by all keys leaves softmax unchanged, so the key bias
#: gets rounding noise only, and AdamW turns noise into steps of up to κ·lr either way
NOISE_ONLY = (".self_attn.k_proj.bias",)
#: of lr: how far rounding may move any other weight between two runs of one job (see :func:`same_weights`)
SIGNAL_WEIGHT_FRACTION = 1 / 3


def same_weights(a: dict, b: dict, lr: float, steps: int) -> tuple:
    """``(worst gap of a weight with a gradient, bound; worst gap of a noise-only weight, bound)`` for the final
    weights of two runs of one job that may differ in rounding only: chunk gradients summed in another grouping
    (borrowing), on other workers (kept or fresh, restarted), or another machine.

    AdamW normalises each weight's update to ≈ lr·m̂/√v̂. Summing k chunk gradients in another order changes a
    gradient g by ≤ (k − 1)·u·Σ|g_j|, so the update of a weight whose gradient stands above its rounding noise
    moves by ≈ lr·δg/|g| ≪ lr; a chunk lost, doubled or trained on other samples changes the gradient of the
    weights it dominates by O(|g|), their updates by ≈ lr. ``SIGNAL_WEIGHT_FRACTION``·lr separates the two. A
    noise-only weight (``NOISE_ONLY``) may move by up to κ·lr per step in either run: 2·κ·lr·steps."""
    signal = noise = 0.0
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        gap = float((a[k].float() - b[k].float()).abs().max())
        if k.endswith(NOISE_ONLY):
            noise = max(noise, gap)
        else:
            signal = max(signal, gap)
    return signal, SIGNAL_WEIGHT_FRACTION * lr, noise, 2 * ADAM_STEP_BOUND * lr * steps
