"""FLOP counts of the appendix's stage-time models ("Stage-Time Models", trainer and rollout models).

Trainer forward FLOPs of a micro-batch ``b`` whose samples have prompt lengths ``p_u`` and response lengths
``r_u`` (appendix, trainer model):

    F(b) = 2·N_nonemb·Σ(p_u + r_u) + c·4·L·H·Σ(p_u + r_u)² + 2·H·V·Σ r_u

(dense matmuls, attention scores and values, and the vocabulary head on the response tokens whose
log-probabilities are needed). ``c`` = :data:`CAUSAL_ATTENTION_FRACTION` = 1/2 is the causal mask's share of the
score and value matmuls: a decoder's token ``i`` attends to the ``i`` tokens before it, so a sequence of ``s``
tokens computes ``Σ_i i ≈ s²/2`` query-key pairs, not ``s²``, and the causal attention kernels the engines use
(FlashAttention-2, Dao 2023, arXiv:2307.08691 §3.1.1 "causal masking": blocks entirely above the diagonal are
skipped, "about 1.7-1.8× speedup" with half the blocks; vLLM's prefill and veRL's FSDP actor both run it) skip the
masked half. The appendix's ``4·L·H·Σ(p+r)²`` counts the full square. Stage ``s`` multiplies it by ``m_s``: 1 for
the forward-only stages ``old_logprob`` and ``ref_logprob``, 3 for ``actor_update`` (forward + backward ≈ 3
forwards).

Prefill FLOPs of a rollout request set ``R_j`` with ``B_j`` requests (appendix, rollout model):

    F_pre = 2·N·Σ p_i + c·4·L·H·Σ p_i² + 2·H·V·B_j

(the head runs once per request, on the last prompt position; ``c`` the causal half, as above). ``N`` is ``N_nonemb``
as for the trainer (a vision-language model's decoder's, with the encoder's term per request: below). ``H`` is the
hidden size, ``L`` the number of layers, ``V`` the vocabulary size.

Vision-language models: ``N_nonemb`` above is the *decoder's* (:func:`decoder_params_nonembedding`, the vision
encoder's parameters taken out), since text and response tokens never enter the ViT. The ViT runs in every trainer
forward over each sample's image patches only, adding ``2·N_vision·T_vit`` per sample (:func:`vit_forward_flops`;
``T_vit`` = 4 × the prompt's LLM image tokens, the workload's ``image_tokens_per_prompt``), times ``m_s`` like the
rest (the ViT is taken as trained: the paper does not say it is frozen). The rollout's prefill charges the same two
parts: ``N_dec`` on every prompt token and the ViT once per request over its image patches (vLLM runs the encoder in
the prefill that schedules a request's image tokens; decode never runs it), so ``F_pre`` gains ``2·N_vision·T_vit·B_j``
(:func:`prefill_flops`). Both sides take a sample's encoder FLOPs from one function, :func:`vit_forward_flops`.

For a mixture-of-experts model ``N_nonemb`` is the *active* non-embedding count
(:attr:`~bidirl.job.presets.ModelSpec.params_active_nonembedding`: a token passes through its router's top-k experts
and the shared ones, not all E), so FLOPs follow the active parameters while memory, optimizer state, switch and
weight-sync costs follow ``params_total`` (docs/architecture.md, "MoE"). For a dense model the two are the same.
"""

from __future__ import annotations

import numpy as np

from bidirl.core.protocol import STAGES  # noqa: F401  (trainer stages in execution order, defined once there)

#: c, the share of the ``s²`` query-key pairs a causal decoder computes (``Σ_{i≤s} i / s² → 1/2``); the causal
#: FlashAttention kernels skip the masked blocks (Dao 2023, arXiv:2307.08691 §3.1.1; module doc)
CAUSAL_ATTENTION_FRACTION = 0.5
#: m_s, the FLOP multiplier of each stage relative to one forward pass
STAGE_MULTIPLIER: dict = {"old_logprob": 1, "ref_logprob": 1, "actor_update": 3}
#: patches per LLM image token of Qwen-VL models: ``spatial_merge_size`` = 2 merges 2×2 patches of
#: ``patch_size`` = 16 pixels into one visual token (Qwen3-VL-2B/4B-Instruct config.json ``vision_config``;
#: ``Qwen3VLVisionPatchMerger`` in transformers' models/qwen3_vl/modeling_qwen3_vl.py); the ViT's blocks run on
#: the unmerged patches
VIT_SPATIAL_MERGE = 4


def check_stage(stage: str) -> str:
    """``stage`` if it names a trainer stage, else a ValueError listing the valid ones."""
    if stage not in STAGE_MULTIPLIER:
        raise ValueError(f"unknown trainer stage {stage!r}; use one of {', '.join(STAGES)}")
    return stage


def stage_multiplier(stage: str) -> int:
    """m_s: 1 for ``old_logprob`` / ``ref_logprob``, 3 for ``actor_update`` (appendix, trainer model)."""
    return STAGE_MULTIPLIER[check_stage(stage)]


def _token_counts(values, name: str) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        a = a.reshape(-1)
    if a.dtype.kind in "iu":
        if a.size and a.min() < 0:
            raise ValueError(f"{name} must be non-negative token counts, got {a[:8]!r}")
        return a.astype(np.int64, copy=False)
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "f" or not np.all(np.isfinite(a)) or a.min() < 0 or np.any(a != np.floor(a)):
        raise ValueError(f"{name} must be non-negative whole token counts, got {a[:8]!r}")
    return a.astype(np.int64)


def lengths(prompt_lens, response_lens=None, *, name: str = "prompt_lens"):
    """Validated int64 arrays of token lengths (1-D, whole numbers ≥ 0, equal sizes); ValueError naming the
    argument."""
    p = _token_counts(prompt_lens, name)
    if response_lens is None:
        return p
    r = _token_counts(response_lens, "response_lens")
    if p.shape != r.shape:
        raise ValueError(f"prompt_lens ({p.size}) and response_lens ({r.size}) must have one entry per sample")
    return p, r


def decoder_params_nonembedding(model) -> float:
    """N_nonemb of the decoder alone: the active non-embedding count less the vision encoder's parameters.

    A vision-language model's ``params_active_nonembedding`` includes its ViT
    (:attr:`~bidirl.job.presets.ModelSpec.vision_params`), but a text or response token never passes through the
    ViT: only the prompt's image patches do (:func:`vit_forward_flops`). 0 vision parameters: the count itself."""
    return max(float(model.params_active_nonembedding) - float(model.vision_params), 0.0)


def vit_tokens_per_sample(image_tokens_per_prompt: int) -> int:
    """ViT tokens a sample's prompt puts through the vision encoder: each LLM image token is one merged group of
    :data:`VIT_SPATIAL_MERGE` patches, and the ViT's blocks run on the patches before the merge."""
    n = check_image_tokens(image_tokens_per_prompt)
    return VIT_SPATIAL_MERGE * n


def check_image_tokens(image_tokens_per_prompt, name: str = "image_tokens_per_prompt") -> int:
    """``image_tokens_per_prompt`` as a whole number ≥ 0, else a ValueError naming ``name``."""
    if isinstance(image_tokens_per_prompt, bool) or not isinstance(image_tokens_per_prompt, (int, np.integer)) \
            or image_tokens_per_prompt < 0:
        raise ValueError(f"{name} must be a whole number of LLM image tokens per prompt >= 0 "
                         f"(0 for a text workload), got {image_tokens_per_prompt!r}")
    return int(image_tokens_per_prompt)


def vit_forward_flops(model, image_tokens_per_prompt: int, samples: int = 1) -> float:
    """Forward FLOPs of the vision encoder over ``samples`` samples: ``2·N_vision·T_vit`` each, with ``T_vit`` =
    :func:`vit_tokens_per_sample` (the dense matmuls of the ViT's blocks and merger over the prompt's patches).

    veRL's FSDP actor runs the ViT in every trainer forward (``DataParallelPPOActor._forward_micro_batch`` in
    verl/workers/actor/dp_actor.py passes each micro-batch's ``multi_modal_inputs``, the pixel values and
    ``image_grid_thw``, into the model for ``compute_log_prob`` and ``update_policy`` alike), once per sample: each
    of a group's responses carries its own copy of the prompt's image. The rollout's prefill charges the same count
    once per request (:func:`prefill_flops_of_sums`): this is the one function both sides take it from.

    Two simplifications, which partly cancel (Qwen3-VL-2B/4B's ViT, ``vision_config``: depth 24, hidden 1,024,
    MLP 4,096 — 24 blocks of 12.6 M = 302 M parameters; the patch merger and the three DeepStack mergers, 4,096 →
    4,096 → the decoder's width, ≈ 105-109 M; patch and position embeddings ≈ 4 M: the presets' 407 / 415 M):
    the mergers run on the merged tokens, ``T_vit``/4, not on every patch, so ``2·N_vision·T_vit`` over-counts
    them by ``2·(3/4)·~107 M·T_vit`` (≈ 19 % of the term); the ViT's attention — full and bidirectional within
    each image (``Qwen3VLVisionAttention``, ``is_causal=False``, one ``cu_seqlens`` span per image) —
    ``4·24·1,024·T_vit²`` is left out (≈ 12 % of the term at ``T_vit`` = 1,024). Net, the term is ≈ 7 % high at
    geo3k's 256 image tokens: ≈ 0.3 % of a 4B sample of 700 prompt and 2,000 response tokens."""
    if int(samples) < 0:
        raise ValueError(f"samples must be >= 0, got {samples!r}")
    return 2.0 * float(model.vision_params) * vit_tokens_per_sample(image_tokens_per_prompt) * int(samples)


def sample_forward_flops(model, prompt_lens, response_lens, image_tokens_per_prompt: int = 0) -> np.ndarray:
    """Per-sample terms of F(b): ``2·N_dec·(p+r) + c·4·L·H·(p+r)² + 2·H·V·r + 2·N_vision·T_vit`` (float array; c the
    causal half; ``N_dec`` = :func:`decoder_params_nonembedding`; ``T_vit`` the ViT tokens of
    ``image_tokens_per_prompt``, :func:`vit_forward_flops`, 0 for a text workload)."""
    p, r = lengths(prompt_lens, response_lens)
    s = (p + r).astype(float)
    return (2.0 * decoder_params_nonembedding(model) * s
            + CAUSAL_ATTENTION_FRACTION * 4.0 * model.layers * model.hidden * s * s
            + 2.0 * model.hidden * model.vocab * r.astype(float)
            + vit_forward_flops(model, image_tokens_per_prompt))


def forward_flops(model, prompt_lens, response_lens, image_tokens_per_prompt: int = 0) -> float:
    """F(b) of one micro-batch (appendix, trainer model)."""
    return float(sample_forward_flops(model, prompt_lens, response_lens, image_tokens_per_prompt).sum())


def stage_flops(model, stage: str, prompt_lens, response_lens, image_tokens_per_prompt: int = 0) -> float:
    """m_s · F(b)."""
    return stage_multiplier(stage) * forward_flops(model, prompt_lens, response_lens, image_tokens_per_prompt)


def prefill_flops(model, prompt_lens, image_tokens_per_prompt: int = 0) -> float:
    """F_pre = 2·N_dec·Σp + c·4·L·H·Σp² + 2·H·V·B_j + 2·N_vision·T_vit·B_j for the requests whose prompts are
    ``prompt_lens`` (:func:`prefill_flops_of_sums`)."""
    p = lengths(prompt_lens).astype(float)
    return float(prefill_flops_of_sums(model, float(p.size), p.sum(), (p * p).sum(), image_tokens_per_prompt))


def prefill_flops_of_sums(model, requests, prompt_tokens, prompt_squares, image_tokens_per_prompt: int = 0):
    """F_pre of request sets given by their sums — ``requests`` (B_j), ``prompt_tokens`` (Σ p_i) and
    ``prompt_squares`` (Σ p_i²), numbers or arrays of one entry per set:
    ``2·N_dec·Σp + c·4·L·H·Σp² + 2·H·V·B_j + B_j·vit_forward_flops(model, image_tokens_per_prompt)``.

    Every prompt token, its image tokens among them, passes through the decoder (``N_dec``,
    :func:`decoder_params_nonembedding`); the vision encoder runs once per request, over that request's image
    patches only: vLLM schedules a request's encoder inputs in the prefill step that computes its image
    placeholder tokens (vllm/v1/core/sched/scheduler.py ``_try_schedule_encoder_inputs``) and a decode step has
    none to run. A request re-prefilled after losing its KV cache (a resumed or moved partial rollout) is a new
    prefill and runs the encoder again. Sharing between a group's requests (vLLM's prefix cache, or its encoder
    cache keyed by the image's hash) is not modelled, as for the decoder's prompt tokens: each request pays its
    own prompt."""
    return (2.0 * decoder_params_nonembedding(model) * prompt_tokens
            + CAUSAL_ATTENTION_FRACTION * 4.0 * model.layers * model.hidden * prompt_squares
            + 2.0 * model.hidden * model.vocab * requests
            + vit_forward_flops(model, image_tokens_per_prompt) * requests)
