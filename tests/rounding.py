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


#: parameters whose exact gradient is zero: a shift shared by all keys leaves softmax unchanged, so the key bias
#: gets rounding noise only, and AdamW turns noise into steps of up to κ·lr either way
NOISE_ONLY = (".self_attn.k_proj.bias",)
#: of lr: a weight whose two runs differ by more than this counts as moved (:func:`same_weights`)
MOVED_GAP = 1 / 3
#: at most this fraction of the weights with a gradient may move by more than ``MOVED_GAP``·lr between two runs
#: that differ in rounding only (derivation in :func:`same_weights`)
MOVED_FRACTION_BOUND = 1e-2


@dataclass(frozen=True)
class WeightGap:
    """How far the final weights of two runs of one job are apart (:func:`same_weights`)."""

    moved: float            # fraction of the weights with a gradient that differ by more than MOVED_GAP·lr
    moved_bound: float
    largest: float          # largest difference of any weight
    largest_bound: float
    compared: int           # weights with a gradient compared

    @property
    def ok(self) -> bool:
        return self.moved <= self.moved_bound and self.largest <= self.largest_bound

    def __str__(self) -> str:
        return (f"{self.moved:.2e} of {self.compared} weights moved by > lr/3 (bound {self.moved_bound:.0e}); "
                f"largest difference {self.largest:.3e} (bound {self.largest_bound:.3e})")


def same_weights(a: dict, b: dict, lr: float, steps: int, weight_decay: float = 0.0) -> WeightGap:
    """Compare the final weights of two runs of one job that may differ in rounding only: chunk gradients summed
    in another grouping (borrowing), on other workers (kept or fresh, restarted), sharded or not, on another CPU.

    Rounding. Such runs compute a gradient element g with a difference δg. A fraction of weights is an average
    over many of them, so what counts is δg's typical size (RMS, λ = 1), not its λ = 6 tail: ≈ ρ₁·σ, with
    ρ₁ = u·Σ√n over the reductions on the gradient's path (forward and its transpose: 2·``logit_path``; ≈ 3e-5
    for the tiny models) and σ the spread of g over the weights. AdamW's first update is lr·m̂/(√v̂ + ε) =
    lr·sign(g) for |g| ≫ ε: a weight whose |g| < |δg| may flip and differ by up to 2·lr from then on, every other
    one by ≈ lr·|δg|/|g|. For g spread like a normal law that is a fraction ≈ 2·φ(0)·ρ₁ ≈ 0.8·ρ₁ of the weights.
    From step 2 on √v̂ holds the earlier gradients, and δg moves the update by ≤ lr·(1 − β1)/(1 − β1ᵗ)·δg/√v̂:
    more than lr/3 only for weights whose gradients stayed within rounding of zero since step 1 (a few times the
    first step's share at most). So rounding moves ≲ 1e-4 of the weights by more than ``MOVED_GAP``·lr;
    ``MOVED_FRACTION_BOUND`` = 1e-2 leaves a factor ≥ 100 for more mass near zero than a normal law has (sparse
    gradients, few tokens) and for the λ-tail of a few elements. No single weight is bounded below Adam's own
    step: |Δw| ≤ lr·(κ + wd·|w|) per step in each run, so the largest difference is ≤ 2·lr·steps·(κ + wd·max|w|)
    (it fails for other starting weights or a step too many).

    What it tells apart. A chunk lost, doubled or trained on other samples changes the gradient of every weight
    its samples reach by O(|g|): in step 1 the sign of a sizeable share of them flips (the unit test
    ``tests/test_rounding.py`` measures it on the tiny model: tens of percent), far above 1e-2.
    ``NOISE_ONLY`` weights (exact gradient zero: pure rounding noise) are held to the largest-difference bound
    only."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    moved = compared = 0
    largest = max_w = 0.0
    for k in a:
        x, y = a[k].float(), b[k].float()
        gap = (x - y).abs()
        largest = max(largest, float(gap.max()) if gap.numel() else 0.0)
        max_w = max(max_w, float(x.abs().max()) if x.numel() else 0.0)
        if not k.endswith(NOISE_ONLY):
            moved += int((gap > MOVED_GAP * lr).sum())
            compared += gap.numel()
    return WeightGap(moved / max(compared, 1), MOVED_FRACTION_BOUND, largest,
                     2 * lr * steps * (ADAM_STEP_BOUND + weight_decay * max_w), compared)
