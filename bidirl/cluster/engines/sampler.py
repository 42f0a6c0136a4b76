"""Position-keyed sampling: the token at position ``t`` of a response depends only on (request seed, ``t``).

vLLM's seeded sampling draws from one random stream per request, started when the request is added. A
response that is interrupted at a sync point and resumed from its prefix (partial rollout, §2.2 / §3.2)
is a new request, so its continuation would draw from a fresh stream and differ from the tokens an
uninterrupted run samples. That would make *where and when* a group ran change *what* it generated, and
the paper's premise (§7.5: scheduling changes placement, never the RL computation) untestable.

:class:`PositionKeyedSampler` is a vLLM logits processor that samples by the Gumbel-max trick with noise
seeded by ``(request seed, absolute position)``: ``token = argmax(logits / T + G)``, ``G`` i.i.d. Gumbel.
This draws exactly from ``softmax(logits / T)``, and the draw at a position is the same whether the
prefix was generated in this request or an earlier one, on this replica or another. The processor
leaves only the chosen token finite, so vLLM's own sampler returns it; the log-probs vLLM reports are the
raw ones (``logprobs_mode="raw_logprobs"``, computed before logits processors), i.e. the policy's.

A request opts in with ``SamplingParams(extra_args={"bidirl_seed": seed, "bidirl_temperature": T})``.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

SEED_KEY = "bidirl_seed"
TEMPERATURE_KEY = "bidirl_temperature"
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """SplitMix64 of ``(seed, position)``: the noise seed of one token position (63 bits)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def gumbel_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    """The Gumbel noise vector of one position, drawn on ``device`` (fp32).

    The draw is a pure function of (seed, position) for one device type; replicas of one run share it (all
    on CPU, or all on GPU), which is what resume-invariance needs. No host round-trip on the hot path.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(position_seed(seed, position))
    u = torch.rand(vocab, generator=gen, dtype=torch.float32, device=device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


class PositionKeyedSampler(LogitsProcessor):
    """Gumbel-max sampling keyed by position (see the module docstring)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.device = device
        # batch row -> (seed, temperature, prompt length, live output token list)
        self.rows: dict = {}

    @classmethod
    def validate_params(cls, sampling_params):
        extra = sampling_params.extra_args or {}
        if SEED_KEY in extra:
            seed = extra[SEED_KEY]
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"extra_args[{SEED_KEY!r}] must be a non-negative integer, got {seed!r}")
            if not float(extra.get(TEMPERATURE_KEY, 1.0)) > 0:
                raise ValueError(f"extra_args[{TEMPERATURE_KEY!r}] must be > 0")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            extra = params.extra_args or {}
            if SEED_KEY in extra:
                self.rows[index] = (int(extra[SEED_KEY]), float(extra.get(TEMPERATURE_KEY, 1.0)),
                                    len(prompt_ids or ()), output_ids)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction.name == "SWAP":
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        vocab = logits.shape[-1]
        for row, (seed, temperature, prompt_len, output_ids) in self.rows.items():
            if row >= logits.shape[0]:
                continue
            position = prompt_len + len(output_ids)
            scores = logits[row] / temperature + gumbel_noise(seed, position, vocab, logits.device)
            token = int(torch.argmax(scores))
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
        return logits
