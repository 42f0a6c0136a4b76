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
from dataclasses import dataclass

FP32_UNIT_ROUNDOFF = 2.0 ** -24
ROUNDING_LAMBDA = 6.0                    # a reduction exceeds λ·√n·u w.p. ≤ 2·exp(−18) ≈ 3e-8
ADAM_STEP_BOUND = max(1.0, (1 - 0.9) / math.sqrt(1 - 0.999))     # κ: |Δw| / lr per AdamW step, at most


def logit_path(cfg, seq_len: int) -> float:
    """Σ√n over the reductions on one logit's path through the decoder ``cfg`` (a transformers config) for
    sequences of at most ``seq_len`` tokens. One decoder layer: RMSNorm (h), q/k/v (h), attention scores (head
    dim), softmax sum and P·V (≤ seq_len each), o_proj (h), RMSNorm (h), gate/up (h), down (intermediate f); then
    the final RMSNorm (h), the LM head (h) and logsumexp (vocab). An MoE layer adds its router's reductions and the
    sum over the k experts a token is sent to."""
    h, f, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    head = h // cfg.num_attention_heads
    per_layer = 4 * math.sqrt(h) + math.sqrt(head) + 2 * math.sqrt(seq_len) + 2 * math.sqrt(h) + math.sqrt(f)
    experts_per_token = getattr(cfg, "num_experts_per_tok", 0) or 0
    if experts_per_token:
        # an MoE layer (the same experts on both sides, R3): the router's logits (h) and softmax (experts) set the
        # mixing weights, the top-k weights' sum renormalises them, and k expert outputs are summed; an expert's
        # down projection is over moe_intermediate_size ≤ intermediate_size (= k·I_e in the tiny config), so f
        # above bounds it
        per_layer += math.sqrt(h) + math.sqrt(cfg.num_experts) + 2 * math.sqrt(experts_per_token)
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


def exact_weights(a: dict, b: dict) -> list:
    """The names of the tensors on which two runs' final weights differ in any bit (none: the runs are the same).

    The bound for two runs of one job in the reproducible mode (``rl.reproducible``; on by default at s = 0),
    weight by weight and with no weight exempt, is zero: the mode fixes every reduction whose order could follow
    timing — the step's chunks cut on one grid whichever gang computes them, their gradients summed in unit order
    (``trainer/ordered_sum.py``), the batch and each group's version by rule — so both runs execute the same fp32
    operations on the same operands in the same order, and IEEE-754 rounding is a function of the operands: the
    same bits on any machine that runs the same kernels. A chunk lost, doubled or computed on other samples
    changes the operands of every weight it reaches, so it fails this everywhere. Runs whose arithmetic differs
    (another grouping of the sums) are compared one step from one state instead (:func:`same_step`): after their
    first step such runs hold weights a rounding apart, whose gradients differ by up to 4e4× the summation bound
    (measured on the tiny model), so no per-weight bound follows from the arithmetic for their later steps."""
    import torch
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


# --------------------------------------------------------------------------------------------------------------
# One AdamW step from one state, weight by weight
# --------------------------------------------------------------------------------------------------------------

def gamma(n: int) -> float:
    """γ_n = n·u / (1 − n·u): recursive summation of n + 1 fp32 terms errs by ≤ γ_n·Σ|x_i| (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., eq. 4.4) — a worst case, no probability."""
    nu = n * FP32_UNIT_ROUNDOFF
    return nu / (1 - nu)


def summation_gap(abs_terms) -> "torch.Tensor":
    """Per element, how far two fp32 sums of the same k terms added in different orders (chunk gradients in another
    grouping, ``TrainerEngine.apply``'s left-to-right adds) can be apart: each is within γ_{k−1}·Σ|g_j| of the
    exact sum, so ≤ 2·γ_{k−1}·Σ|g_j|. ``abs_terms``: the k terms' |values| (a list of tensors)."""
    total = None
    for t in abs_terms:
        total = t.abs().double() if total is None else total + t.abs().double()
    return 2 * gamma(len(abs_terms) - 1) * total


#: torch's AdamW step on one element (``torch.optim.adamw``, single-tensor and foreach alike): m and v updated,
#: √v̂ over √(1 − β2ᵗ), + ε, the division, × lr/(1 − β1ᵗ): at most this many roundings of relative u on the update
ADAM_OPS = 8


def adamw_step_gap(grad, delta, exp_avg, exp_avg_sq, step: int, weights, lr: float, betas=(0.9, 0.999),
                   eps: float = 1e-8, max_grad_norm=None) -> "torch.Tensor":
    """Per weight, how far apart two runs' weights can be after one AdamW step taken from one state (the same
    weights ``weights``, moments ``exp_avg`` / ``exp_avg_sq`` after ``step − 1`` steps) with gradients that differ
    by at most ``delta`` per element (``grad``: one run's, unclipped; all tensors flat, the same length).

    Derivation. Clipping scales the gradient by c = min(1, max_norm / (‖g‖ + 10⁻⁶)) in each run (torch's
    ``clip_grad_norm_``); the two norms differ by ≤ ‖δ‖₂ (triangle inequality) plus their own rounding, a sum of n
    squares (relative λ·√n·u each, ``ROUNDING_LAMBDA``, as in this module's docstring) and a square root, and
    min(1, ·) is 1-Lipschitz, so the two c differ relatively by ≤ r_c = ‖δ‖₂/‖g‖₂ + 2·λ·√n·u + 2·u, and an
    element's clipped gradients x = c·g by ≤ δ' = c·(δ + (|g| + δ)·r_c). The update of that element is
    f(x) = lr·c₁·(β1·m + (1 − β1)·x) / (√(c₂·(β2·v + (1 − β2)·x²)) + ε), c₁ = 1/(1 − β1ᵗ), c₂ = 1/(1 − β2ᵗ)
    (bias corrections; weight decay scales both runs' equal weights alike). On the interval |x' − x| ≤ δ' the
    denominator is ≥ D = √(c₂·(β2·v + (1 − β2)·max(0, |x| − δ')²)) + ε and the numerator's size ≤
    N = c₁·(β1·|m| + (1 − β1)·(|x| + δ')), and
        |f'| ≤ lr·(c₁·(1 − β1)/D + N·√(c₂·(1 − β2))/D²)
    (the square root's derivative c₂·(1 − β2)·x / √(c₂·V) with |x|/√(c₂·V) ≤ 1/√(c₂·(1 − β2))). So the updates
    differ by ≤ min(δ'·sup|f'|, 2·lr·N/D) — the second: each is at most lr·N/D, what a weight whose gradient is
    within rounding of zero may do (its sign may flip: that is the arithmetic, not an exemption). Each run rounds
    its update ``ADAM_OPS`` times (relative u) and the new weight once (u·|w − update|, w − update within
    lr·N/D of the one run's new weight ``weights``): + 2·(ADAM_OPS·u·lr·N/D + u·(|w| + 2·lr·N/D)). The last
    rounding alone may put two new weights one ulp apart, 2u·2ᵉ for |w| in [2ᵉ, 2ᵉ⁺¹): a weight just above a
    power of two may come close to its bound in an honest run, never beyond it.
    """
    import torch

    f64 = lambda t: torch.as_tensor(t).double()
    g, d, m, v, w = (f64(t) for t in (grad, delta, exp_avg, exp_avg_sq, weights))
    u, (b1, b2) = FP32_UNIT_ROUNDOFF, betas
    c = 1.0
    d_clip = d
    if max_grad_norm is not None:
        norm = float(torch.linalg.vector_norm(g))
        c = min(1.0, max_grad_norm / (norm + 1e-6))
        r_c = float(torch.linalg.vector_norm(d)) / max(norm, 1e-30) + 2 * ROUNDING_LAMBDA * math.sqrt(g.numel()) * u \
            + 2 * u
        d_clip = d + (g.abs() + d) * r_c
    x, dx = c * g.abs(), c * d_clip
    c1, c2 = 1 / (1 - b1 ** step), 1 / (1 - b2 ** step)
    den = torch.sqrt(c2 * (b2 * v + (1 - b2) * (x - dx).clamp_min(0) ** 2)) + eps
    num = c1 * (b1 * m.abs() + (1 - b1) * (x + dx))
    slope = lr * (c1 * (1 - b1) / den + num * math.sqrt(c2 * (1 - b2)) / den ** 2)
    largest = lr * num / den
    return torch.minimum(dx * slope, 2 * largest) + 2 * (ADAM_OPS * u * largest + u * (w.abs() + 2 * largest))


@dataclass(frozen=True)
class StepGap:
    """Two runs' weights after one step from one state, against their per-weight bound (:func:`same_step`)."""

    worst: float            # the largest |a − b| / bound over the weights
    name: str               # where
    index: int
    over: int               # weights over their bound
    compared: int

    @property
    def ok(self) -> bool:
        return self.over == 0

    def __str__(self) -> str:
        return (f"{self.over} of {self.compared} weights beyond their bound; the worst, {self.name}[{self.index}], "
                f"at {self.worst:.3g}× its bound")


def same_step(a: dict, b: dict, bound: dict) -> StepGap:
    """Every weight of ``a`` and ``b`` (``{name: tensor}``) within its own bound (``bound``, the same names and
    shapes: :func:`adamw_step_gap`), none exempt. Names without a bound must hold the same tensors as a bounded
    name does in both runs (a tied head)."""
    import torch

    assert set(a) == set(b), sorted(set(a) ^ set(b))
    worst, where, over, compared = 0.0, ("", 0), 0, 0
    for k in a:
        x, y = a[k].double().reshape(-1), b[k].double().reshape(-1)
        if k not in bound:
            assert any(torch.equal(a[k], a[j]) and torch.equal(b[k], b[j]) for j in bound if a[j].shape == a[k].shape), k
            continue
        lim = bound[k].double().reshape(-1)
        ratio = (x - y).abs() / lim.clamp_min(1e-300)
        over += int((ratio > 1).sum())
        compared += ratio.numel()
        i = int(ratio.argmax()) if ratio.numel() else 0
        if ratio.numel() and float(ratio[i]) > worst:
            worst, where = float(ratio[i]), (k, i)
    return StepGap(worst, where[0], where[1], over, compared)
