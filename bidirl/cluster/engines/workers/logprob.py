"""Per-token log-probs of response tokens without a ``[B, T, V]`` logits tensor (the trainer's hot path).

The ``old_logprob`` / ``ref_logprob`` / ``actor_update`` stages (paper §2.1) need ``log π(y_t | x, y_<t)`` only at
response positions. Building the full-vocabulary fp32 logits for every position (prompt and padding included)
costs ``B · T · V · 4`` bytes — 25–30 GB for a Qwen3-4B micro-batch of 2.5 K-token sequences at V = 151,936 —
so here:

* the model runs up to its last hidden state (the decoder's output, after the final norm; the causal-LM head is
  asked for one position only, ``logits_to_keep=1``, which costs ``B · V`` and is discarded);
* the response positions are gathered out of ``[B, T, H]`` into ``[N, H]`` (N = the micro-batch's response
  tokens: prompt and padding positions never reach the head);
* the output head runs on ``chunk`` rows at a time: ``[chunk, V]`` logits in fp32, ``log_softmax``, the target's
  entry; with gradients each chunk is recomputed in the backward pass (``torch.utils.checkpoint``), so the
  head's activation memory is ``chunk · V · 4`` bytes plus ``N · H`` inputs, whatever N is.

The arithmetic per token is that of the plain path (the same matmul, fp32 ``log_softmax`` over V, the gather),
so the values equal it up to the matmul's blocking. Logit soft-capping (``final_logit_softcapping``) and logit
scaling (``logit_scale``) of the model's config are applied as the model's own head applies them.

With FSDP2 the model is the root module: its forward unshards the root's parameters (embeddings, final norm,
head) and keeps them unsharded after the forward (FSDP2 does not reshard the root after forward), so the head's
weight used here is the gathered one and its gradient is reduce-scattered with the root's at the end of the
backward pass.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

#: response tokens per head chunk (fp32 logits of one chunk: chunk × V × 4 bytes; 512 × 151,936 × 4 = 311 MB)
DEFAULT_CHUNK = 512


def _head(h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, scale, softcap) -> torch.Tensor:
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def last_hidden(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden state ``[B, T, H]`` from a forward of the causal LM ``model`` itself (so FSDP2's
    root hooks run), with the LM head computed for one position only."""
    decoder = model.get_decoder()
    seen = []

    def grab(_module, _args, out):
        seen.append(out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state)
    handle = decoder.register_forward_hook(grab)
    try:
        model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"logprob: expected one forward of {type(decoder).__name__}, saw {len(seen)}")
    return seen[0]


def response_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                      targets: torch.Tensor, grad: bool, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """``log π(targets[k] | ids[rows[k], :cols[k] + 1])`` for each response token ``k`` (fp32, ``[N]``).

    ``rows`` / ``cols``: the sample and the position whose logits predict the token (its position − 1).
    """
    hidden = last_hidden(model, ids, attn)
    h = hidden[rows, cols]                                           # [N, H]: response positions only
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    cfg = model.config
    scale = getattr(cfg, "logit_scale", None)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    parts = []
    for a in range(0, h.shape[0], chunk):
        args = (h[a:a + chunk], weight, bias, targets[a:a + chunk], scale, softcap)
        parts.append(checkpoint(_head, *args, use_reentrant=False) if grad else _head(*args))
    if not parts:
        return h.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)
