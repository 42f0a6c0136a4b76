"""Position-keyed sampling: the token at position ``t`` of a response depends only on (request seed, ``t``).

vLLM's seeded sampling draws from one random stream per request, started when the request is added. A
response that is interrupted at a sync point and resumed from its prefix (partial rollout, §2.2 / §3.2)
is a new request, so its continuation would draw from a fresh stream and differ from the tokens an
uninterrupted run samples. That would make *where and when* a group ran change *what* it generated, and
the paper's premise (§7.5: scheduling changes placement, never the RL computation) untestable.

:class:`PositionKeyedSampler` is a vLLM logits processor that samples by the Gumbel-max trick with noise
keyed by ``(request seed, absolute position)``: ``token = argmax(logits / T + G)``, ``G`` i.i.d. Gumbel.
This draws exactly from ``softmax(logits / T)``, and the draw at a position is the same whether the
prefix was generated in this request or an earlier one, on this replica or another. The processor
leaves only the chosen token finite, so vLLM's own sampler returns it; the log-probs vLLM reports are the
raw ones (``logprobs_mode="raw_logprobs"``, computed before logits processors), i.e. the policy's.

The noise is counter-based: a pure function of (seed, position, token index), computed for the whole batch
at once. With ``φ = 0x9E3779B97F4A7C15`` and SplitMix64's finaliser constants ``C1``, ``C2`` (all arithmetic
mod 2^64, ``>>`` a logical shift):

* ``key = position_seed(seed, position)`` (SplitMix64 of ``seed·φ + position + 1``, 63 bits);
* ``z = key + (v + 1)·φ`` for token index ``v`` (the state after ``v + 1`` steps of a SplitMix64 stream
  from ``key``), ``z = (z ^ z >> 30)·C1``, ``z = (z ^ z >> 27)·C2``, ``k = z >> 41`` — the top 23 bits of
  SplitMix64's output (its last xor-shift, by 31, does not reach them);
* ``u = (k + ½) / 2^23`` ∈ [2^-24, 1 − 2^-24], exact in fp32, so ``G = −log(−log u)`` is finite (fp32);
* ``token = argmax_v (logits_v / T + G_v)`` (the first index on a tie).

One decode step is one batch of tensor ops over a [rows, vocab] grid — torch int64 arithmetic wraps mod 2^64
on CPU and CUDA; right shifts are arithmetic there, so each is masked to a logical one — with no Python loop
over sequences and no host round-trip: the per-row keys are computed on the host from each row's seed and
``len(prompt) + len(output so far)`` (a vector op over the batch) and copied to the device asynchronously
from pinned memory. The grid is processed in blocks of rows of at most :data:`BLOCK_ELEMENTS` entries (two
int64 and one or two fp32 scratch tensors of that size: at 151,936 tokens × 256 rows a whole-batch grid would
be 311 MB per int64 tensor). The uniforms ``u`` are bit-identical on every device; ``G`` is fp32 ``log`` of
them, which agrees across devices to the libraries' log accuracy (an ulp or two), so a device can change a
token only on a near-exact tie of two scores.

The previous implementation drew each row's noise from a ``torch.Generator`` seeded per (seed, position) —
mt19937 on CPU, Philox on CUDA, so CPU and GPU replicas differed — and paid a generator, a Python iteration
and a device sync per row per step. Its token streams cannot be reproduced by a vectorised draw at a
comparable cost, so the streams of this implementation differ from that release's for the same seeds; every
property above (softmax sampling, resume invariance, the same tokens for the same seeds) is unchanged.

A request opts in with ``SamplingParams(extra_args={"bidirl_seed": seed, "bidirl_temperature": T})``; requests
without ``bidirl_seed`` are left to vLLM.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Optional

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

SEED_KEY = "bidirl_seed"
TEMPERATURE_KEY = "bidirl_temperature"
_MASK64 = (1 << 64) - 1
_PHI = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
#: bits of each uniform: (k + ½)/2^23 with k < 2^23 needs 24 significant bits, exactly fp32's
UNIFORM_BITS = 23
#: the most grid entries one block of rows holds, per device type (CPU: a block's int64 scratch, 4 MiB, stays
#: in cache; CUDA: 32 MiB per int64 scratch, few enough kernel launches per step)
BLOCK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 22}
_DEFAULT_BLOCK_ELEMENTS = 1 << 22


def _signed64(x: int) -> int:
    """``x`` mod 2^64 as a two's-complement int64 (what a torch int64 tensor holds for those bits)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_PHI_S, _C1_S, _C2_S = _signed64(_PHI), _signed64(_C1), _signed64(_C2)
_U64 = np.uint64


def position_seed(seed: int, position: int) -> int:
    """SplitMix64 of ``(seed, position)``: the noise key of one token position (63 bits)."""
    z = (int(seed) * _PHI + int(position) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * _C1) & _MASK64
    z = ((z ^ (z >> 27)) * _C2) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def position_seeds(seeds, positions) -> np.ndarray:
    """:func:`position_seed` of each ``(seeds[i], positions[i])`` as one numpy op per step (int64, 63 bits).

    ``seeds``: uint64-compatible values (a seed is taken mod 2^64, as :func:`position_seed` does);
    ``positions``: non-negative integers. numpy's uint64 array arithmetic wraps mod 2^64 and its shifts are
    logical, so this is SplitMix64 as written.
    """
    s = np.asarray(seeds, dtype=_U64)
    p = np.asarray(positions, dtype=np.int64)
    if s.shape != p.shape or s.ndim != 1:
        raise ValueError(f"position_seeds: seeds and positions must be 1-D of one length, got shapes "
                         f"{s.shape} and {p.shape}")
    with np.errstate(over="ignore"):
        z = s * _U64(_PHI) + p.astype(_U64) + _U64(1)
        z = (z ^ (z >> _U64(30))) * _U64(_C1)
        z = (z ^ (z >> _U64(27))) * _U64(_C2)
        z = (z ^ (z >> _U64(31))) & _U64(0x7FFFFFFFFFFFFFFF)
    return z.astype(np.int64)


@lru_cache(maxsize=8)
def _lanes(vocab: int, device: torch.device) -> torch.Tensor:
    """``(v + 1)·φ`` mod 2^64 for ``v < vocab`` (int64 on ``device``): the per-token half of the stream state."""
    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device).mul_(_PHI_S)


def _log_exponentials(keys: torch.Tensor, lanes: torch.Tensor, z: torch.Tensor, t: torch.Tensor,
                      x: torch.Tensor) -> torch.Tensor:
    """``x = log(−log u) = −G`` over the grid of ``keys`` (rows) × ``lanes`` (tokens), in place.

    ``z``, ``t`` (int64) and ``x`` (fp32) are [rows, vocab] scratch tensors on the keys' device.
    """
    torch.add(lanes, keys[:, None], out=z)
    torch.bitwise_right_shift(z, 30, out=t).bitwise_and_((1 << 34) - 1)     # logical z >> 30
    z.bitwise_xor_(t).mul_(_C1_S)
    torch.bitwise_right_shift(z, 27, out=t).bitwise_and_((1 << 37) - 1)     # logical z >> 27
    z.bitwise_xor_(t).mul_(_C2_S)
    torch.bitwise_right_shift(z, 64 - UNIFORM_BITS, out=t).bitwise_and_((1 << UNIFORM_BITS) - 1)
    torch.mul(t, 2.0 ** -UNIFORM_BITS, out=x)             # k·2^-23: k < 2^23 and the scale exact in fp32
    x.add_(2.0 ** -(UNIFORM_BITS + 1))                    # u = (k + ½)/2^23: 24 significant bits, exact
    return x.log_().neg_().log_()                         # log E, E = −log u ~ Exp(1) (E ≥ 5.96e-8 > 0)


def _block_rows(vocab: int, device: torch.device, block_elements: Optional[int]) -> int:
    limit = block_elements or BLOCK_ELEMENTS.get(device.type, _DEFAULT_BLOCK_ELEMENTS)
    return max(1, int(limit) // max(1, vocab))


def gumbel_grid(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Gumbel noise ``G`` [len(keys), vocab] (fp32) of the position keys ``keys`` (int64, on their device)."""
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"gumbel_grid: keys must be a 1-D int64 tensor, got {keys.dtype} of shape {tuple(keys.shape)}")
    z = torch.empty(len(keys), vocab, dtype=torch.int64, device=keys.device)
    x = torch.empty(len(keys), vocab, dtype=torch.float32, device=keys.device)
    return _log_exponentials(keys, _lanes(vocab, keys.device), z, torch.empty_like(z), x).neg_()


def gumbel_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    """The Gumbel noise vector of one position (fp32 on ``device``): one row of what the sampler draws."""
    keys = torch.tensor([position_seed(seed, position)], dtype=torch.int64, device=torch.device(device))
    return gumbel_grid(keys, int(vocab))[0]


def keyed_argmax(logits: torch.Tensor, keys: torch.Tensor, temperatures: Optional[torch.Tensor] = None, *,
                 rows: Optional[torch.Tensor] = None, block_elements: Optional[int] = None) -> torch.Tensor:
    """``argmax_v(logits[r, v] / T_r + G(keys_r)_v)`` for each sampled row (int64 tokens on the logits' device).

    ``keys``: one position key per sampled row (int64, the logits' device). The sampled rows are ``logits``'
    first ``len(keys)`` rows, or ``logits[rows]`` when ``rows`` (int64 row indices) is given. ``temperatures``:
    one per sampled row (fp32), ``None`` for all 1. The [rows, vocab] grid is processed in blocks of rows of at
    most ``block_elements`` entries (default :data:`BLOCK_ELEMENTS` for the device). No host synchronisation.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"keyed_argmax: logits must be a 2-D float tensor, got {logits.dtype} of shape "
                         f"{tuple(logits.shape)}")
    n, vocab = len(keys), logits.shape[1]
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"keyed_argmax: keys must be a 1-D int64 tensor, got {keys.dtype} of shape "
                         f"{tuple(keys.shape)}")
    if rows is not None and rows.shape != keys.shape:
        raise ValueError(f"keyed_argmax: rows must give one row per key ({n}), got shape {tuple(rows.shape)}")
    if rows is None and n > logits.shape[0]:
        raise ValueError(f"keyed_argmax: {n} keys for {logits.shape[0]} logits rows")
    if temperatures is not None and temperatures.shape != keys.shape:
        raise ValueError(f"keyed_argmax: temperatures must give one temperature per key ({n}), got shape "
                         f"{tuple(temperatures.shape)}")
    device = logits.device
    tokens = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return tokens
    block = min(n, _block_rows(vocab, device, block_elements))
    lanes = _lanes(vocab, device)
    z = torch.empty(block, vocab, dtype=torch.int64, device=device)
    t, x = torch.empty_like(z), torch.empty(block, vocab, dtype=torch.float32, device=device)
    scaled = torch.empty_like(x) if temperatures is not None else None
    for a in range(0, n, block):
        m = min(block, n - a)
        neg_g = _log_exponentials(keys[a:a + m], lanes, z[:m], t[:m], x[:m])
        src = logits[a:a + m] if rows is None else logits.index_select(0, rows[a:a + m])
        if temperatures is not None:
            src = torch.div(src, temperatures[a:a + m, None], out=scaled[:m])
        neg_g.sub_(src)                                    # −(logits/T + G): argmin = argmax of the score
        torch.argmin(neg_g, dim=1, out=tokens[a:a + m])
    return tokens


class _Row(NamedTuple):
    seed: int
    temperature: float
    prompt_len: int
    output_ids: list             # vLLM's live output token list of the request


class _Batch:
    """The seeded rows of the persistent batch as vectors, rebuilt when the batch changes."""

    def __init__(self, rows: dict, device: torch.device, pin: bool):
        order = sorted(rows)
        self.n = len(order)
        self.max_row = order[-1] if order else -1
        self.outputs = [rows[r].output_ids for r in order]
        self.prompt_lens = np.array([rows[r].prompt_len for r in order], dtype=np.int64)
        self.seeds = np.array([rows[r].seed & _MASK64 for r in order], dtype=_U64)
        self.first = order[0] if order else 0
        contiguous = order == list(range(self.first, self.first + self.n))
        self.rows = None if contiguous else _to_device(np.array(order, dtype=np.int64), device, pin)
        temps = np.array([rows[r].temperature for r in order], dtype=np.float32)
        self.temperatures = None if bool(np.all(temps == 1.0)) else _to_device(temps, device, pin)


def _to_device(array: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    """A host array on ``device`` without a host sync (staged in pinned memory for an accelerator)."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return (t.pin_memory() if pin else t).to(device, non_blocking=True)


def apply_batch_update(rows: dict, batch_update, make_row) -> None:
    """Apply vLLM's ``BatchUpdate`` to ``rows`` (batch index -> a seeded request's row, ``make_row(seed,
    temperature, prompt length, output ids)``) in vLLM's order: removed, then added (an added row may replace a row;
    one without a seed drops it), then moved (a move or a swap)."""
    for index in batch_update.removed:
        rows.pop(index, None)
    for index, params, prompt_ids, output_ids in batch_update.added:
        extra = params.extra_args or {}
        if SEED_KEY in extra:
            rows[index] = make_row(int(extra[SEED_KEY]), float(extra.get(TEMPERATURE_KEY, 1.0)),
                                   len(prompt_ids or ()), output_ids)
        else:
            rows.pop(index, None)
    for a, b, direction in batch_update.moved:
        ra, rb = rows.pop(a, None), rows.pop(b, None)
        if ra is not None:
            rows[b] = ra
        if rb is not None and direction.name == "SWAP":
            rows[a] = rb


class PositionKeyedSampler(LogitsProcessor):
    """Gumbel-max sampling keyed by position (see the module docstring)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        self.pin = bool(is_pin_memory)
        # batch row -> (seed, temperature, prompt length, live output token list)
        self.rows: dict = {}
        self._batch = _Batch({}, self.device, self.pin)

    @classmethod
    def validate_params(cls, sampling_params):
        extra = sampling_params.extra_args or {}
        if SEED_KEY in extra:
            seed = extra[SEED_KEY]
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK64:
                raise ValueError(f"extra_args[{SEED_KEY!r}] must be an integer in [0, 2**64), got {seed!r}")
            temperature = extra.get(TEMPERATURE_KEY, 1.0)
            if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                    or not math.isfinite(temperature) or not temperature > 0):
                raise ValueError(f"extra_args[{TEMPERATURE_KEY!r}] must be a finite number > 0, got {temperature!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        apply_batch_update(self.rows, batch_update, _Row)
        self._batch = _Batch(self.rows, self.device, self.pin)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        if batch.n == 0:
            return logits
        if batch.max_row >= logits.shape[0]:      # rows past this call's logits are not sampled here
            batch = _Batch({r: v for r, v in self.rows.items() if r < logits.shape[0]}, self.device, self.pin)
            if batch.n == 0:
                return logits
        positions = batch.prompt_lens + np.fromiter(map(len, batch.outputs), dtype=np.int64, count=batch.n)
        keys = _to_device(position_seeds(batch.seeds, positions), logits.device, self.pin)
        if batch.rows is None:
            view = logits[batch.first:batch.first + batch.n]
            tokens = keyed_argmax(view, keys, batch.temperatures)
            view.fill_(float("-inf")).scatter_(1, tokens[:, None], 0.0)
        else:
            tokens = keyed_argmax(logits, keys, batch.temperatures, rows=batch.rows)
            logits.index_fill_(0, batch.rows, float("-inf"))
            logits.index_put_((batch.rows, tokens), logits.new_zeros(()))
        return logits
