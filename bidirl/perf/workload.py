"""Seeded prompt / response length draws from a dataset's statistics (``bidirl.job.presets.WorkloadStats``).

The static planner's representative batch (paper §4.2: B_p prompt groups and the trainer workload U_B they
induce) and the simulator's workload both come from here, so the planner predicts the work the simulator
runs. The distribution is the one documented on :class:`bidirl.job.presets.WorkloadStats`:

* response length ``min(max_response_len, max(1, round(X)))`` with ``X ~ LogNormal`` of mean
  ``m_k = response_mean_fraction · max_response_len · (1 + response_drift_per_step)^k · j_k`` and coefficient
  of variation ``response_cv`` (so ``σ² = ln(1 + cv²)``, ``μ = ln m_k − σ²/2``); ``k`` is the training step;
* ``j_k = exp(step_noise · z_k)`` is the per-step jitter of the mean: ``z_k`` is a standard normal that depends
  only on (dataset name, k) — the same for every request of step ``k`` and every run — and ``z_0 = 0``, so
  step 0 has exactly the preset's mean;
* prompt length ``round(N(prompt_mean, prompt_std))`` clipped to ``[prompt_min, prompt_max]``;
* a job's ``workload.response_length_trend`` τ scales step ``k``'s mean to ``m_k · (1 + τ·k)``, clipped to
  ``[1, max_response_len]`` (responses that grow or shrink over training; τ = 0 leaves ``m_k`` untouched).
"""

from __future__ import annotations

import math
import zlib

import numpy as np


def _rng(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, (int, np.integer, list, tuple)):
        return np.random.default_rng(rng)
    raise ValueError(f"rng must be a numpy Generator or a seed, got {type(rng).__name__}")


def step_jitter(stats, step: int) -> float:
    """j_k, the per-step factor on the mean response length (1 at step 0)."""
    if step == 0 or stats.step_noise == 0:
        return 1.0
    z = np.random.default_rng([zlib.crc32(stats.name.encode()), int(step)]).standard_normal()
    return float(math.exp(stats.step_noise * z))


def mean_response(stats, max_response_len: int, step: int = 0, trend: float = 0.0) -> float:
    """m_k, the (unclipped) mean response length at training step ``step``; with a length ``trend`` τ
    (``workload.response_length_trend``) ``m_k · (1 + τ·k)`` clipped to ``[1, max_response_len]``."""
    m = (stats.response_mean_fraction * max_response_len
         * (1.0 + stats.response_drift_per_step) ** step * step_jitter(stats, step))
    if trend:
        m = min(float(max_response_len), max(1.0, m * (1.0 + trend * step)))
    return m


def _check(max_response_len, n, step):
    if int(max_response_len) != max_response_len or max_response_len < 1:
        raise ValueError(f"max_response_len must be a whole number ≥ 1, got {max_response_len}")
    if int(n) != n or n < 0:
        raise ValueError(f"n must be a whole number ≥ 0, got {n}")
    if int(step) != step or step < 0:
        raise ValueError(f"step must be a whole number ≥ 0, got {step}")


def _responses(stats, max_response_len, n, rng, step) -> np.ndarray:
    m = mean_response(stats, max_response_len, step)
    sigma2 = math.log1p(stats.response_cv ** 2)
    x = rng.lognormal(math.log(m) - sigma2 / 2, math.sqrt(sigma2), size=n)
    return np.clip(np.rint(x), 1, max_response_len).astype(np.int64)


def _prompts(stats, n, rng) -> np.ndarray:
    x = rng.normal(stats.prompt_mean, stats.prompt_std, size=n)
    return np.clip(np.rint(x), stats.prompt_min, stats.prompt_max).astype(np.int64)


def sample_lengths(stats, max_response_len: int, n: int, rng, step: int = 0) -> tuple:
    """``(prompt_lens, response_lens)``: ``n`` independent requests (int64 arrays) at training step ``step``.

    ``rng`` is a numpy Generator (or a seed). Prompts are drawn first, then responses, so a caller that
    keeps only the first prompt of a call (one GRPO group per call) gets a well-defined group prompt.
    """
    _check(max_response_len, n, step)
    rng = _rng(rng)
    p = _prompts(stats, int(n), rng)
    r = _responses(stats, int(max_response_len), int(n), rng, int(step))
    return p, r


def sample_groups(stats, max_response_len: int, n_groups: int, group_size: int, rng, step: int = 0) -> tuple:
    """``(prompt_lens, response_lens)`` of ``n_groups`` GRPO groups, ``group_size`` requests each, laid out
    group after group; the requests of a group share one prompt (length)."""
    _check(max_response_len, n_groups, step)
    if int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a whole number ≥ 1, got {group_size}")
    rng = _rng(rng)
    p = np.repeat(_prompts(stats, int(n_groups), rng), int(group_size))
    r = _responses(stats, int(max_response_len), int(n_groups) * int(group_size), rng, int(step))
    return p, r


# --------------------------------------------------------------------------------------------------
# per-group streams, seeded in blocks
# --------------------------------------------------------------------------------------------------
# ``np.random.default_rng([seed, 7, g])`` per group costs ~25 µs, mostly in SeedSequence's hashing. These
# constants and the two functions below are that published algorithm (NumPy's SeedSequence, O'Neill's PCG64
# seeding) run for a whole block of group ids at once in numpy; ``tests/test_workload.py`` checks the resulting
# states against NumPy's for many seeds and ids.
_MASK32 = 0xFFFFFFFF
_HASH_INIT_A, _HASH_MULT_A = 0x43B0D7E5, 0x931E8875
_HASH_INIT_B, _HASH_MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_POOL = 4
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
_MASK128 = (1 << 128) - 1


def _uint32_words(n: int) -> list:
    """The little-endian 32-bit words SeedSequence makes of one entropy integer (``[0]`` for 0)."""
    if n < 0:
        raise ValueError(f"seeds must be ≥ 0, got {n}")
    words = []
    while True:
        words.append(n & _MASK32)
        n >>= 32
        if not n:
            return words


def _seed_pools(entropy: np.ndarray) -> np.ndarray:
    """SeedSequence's pool (4 words per row) for each row of ``entropy`` (uint32, at most 4 words a row)."""
    rows, width = entropy.shape
    hash_const = _HASH_INIT_A

    def hashmix(value):
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _HASH_MULT_A) & _MASK32
        value = value * np.uint32(hash_const)
        return value ^ (value >> np.uint32(16))

    def mix(x, y):
        out = x * np.uint32(_MIX_MULT_L) - y * np.uint32(_MIX_MULT_R)
        return out ^ (out >> np.uint32(16))

    pool = [hashmix(entropy[:, i] if i < width else np.zeros(rows, np.uint32)) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    return np.stack(pool, axis=1)


def _pcg64_states(pools: np.ndarray) -> list:
    """PCG64's ``(state, inc)`` seeded from each SeedSequence pool (``generate_state(4, uint64)``)."""
    hash_const = _HASH_INIT_B
    words = []
    for i in range(8):
        value = pools[:, i % _POOL] ^ np.uint32(hash_const)
        hash_const = (hash_const * _HASH_MULT_B) & _MASK32
        value = value * np.uint32(hash_const)
        words.append(value ^ (value >> np.uint32(16)))
    w = [x.astype(np.uint64) for x in words]
    v = [(w[2 * j] | (w[2 * j + 1] << np.uint64(32))).tolist() for j in range(4)]
    out = []
    for s_hi, s_lo, i_hi, i_lo in zip(*v):
        inc = ((((i_hi << 64) | i_lo) << 1) | 1) & _MASK128
        state = inc                                          # state 0, one step: 0 · mult + inc
        state = (((state + ((s_hi << 64) | s_lo)) & _MASK128) * _PCG_MULT + inc) & _MASK128
        out.append((state, inc))
    return out


def group_streams(seed_words: list, group_ids) -> list:
    """PCG64 states equal to ``np.random.default_rng(seed_words + [g]).bit_generator``'s for each id ``g``
    (ids below 2**32, at most three seed words; others fall back to NumPy)."""
    ids = [int(g) for g in group_ids]
    if len(seed_words) > _POOL - 1 or any(not 0 <= g <= _MASK32 for g in ids):
        return [np.random.PCG64(list(seed_words) + [g]).state["state"] for g in ids]
    entropy = np.empty((len(ids), len(seed_words) + 1), np.uint32)
    entropy[:, :-1] = seed_words
    entropy[:, -1] = ids
    return [{"state": s, "inc": i} for s, i in _pcg64_states(_seed_pools(entropy))]


class GroupLengths:
    """``(prompt_len, response target lengths)`` of prompt group ``group_id``: a pure function of
    ``(seed, group_id)``, memoised. Group ``g`` belongs to training step ``g // prompts_per_step`` (the step
    whose mean response length it follows), so every policy and every driver sees the same workload.

    Each group has its own stream, ``np.random.default_rng([seed, 7, g])``, drawn as :func:`sample_lengths`
    draws: ``group_size`` prompt normals (the first is the group's prompt), then ``group_size`` log-normal
    responses. A step's groups are drawn together (:meth:`_draw_step`): the streams are seeded in one vectorised
    pass and the draws transformed with the same arithmetic as NumPy's normal and log-normal, so the lengths are
    the ones the per-group draw gives.
    """

    def __init__(self, stats, max_response_len: int, group_size: int, prompts_per_step: int, seed: int,
                 trend: float = 0.0):
        self.stats, self.max_response_len, self.group_size = stats, int(max_response_len), int(group_size)
        self.prompts_per_step, self.seed = int(prompts_per_step), int(seed)
        self.trend = float(trend)     # workload.response_length_trend: relative change of the mean per step
        _check(self.max_response_len, self.group_size, 0)
        self._cache: dict = {}

    @classmethod
    def of(cls, config, seed: int) -> "GroupLengths":
        w = config.workload
        return cls(config.workload_stats, w.max_response_len, w.group_size, w.prompts_per_step, seed,
                   w.response_length_trend)

    def __call__(self, group_id: int) -> tuple:
        out = self._cache.get(group_id)
        if out is None:
            if int(group_id) != group_id or group_id < 0:
                raise ValueError(f"group_id must be a whole number ≥ 0, got {group_id!r}")
            self._draw_step(int(group_id) // self.prompts_per_step)
            out = self._cache[group_id]
        return out

    def sample_lengths(self, samples) -> tuple:
        """``(prompt_lens, response_lens)`` lists of a sequence of ``(group_id, response index)`` pairs (a chunk's
        samples): :meth:`__call__` per pair, without its per-call checks once a group is drawn (the groups not
        drawn yet are drawn first, then the lengths are read straight from the memo)."""
        cache = self._cache
        for g in {g for g, _ in samples}.difference(cache):
            self(g)
        return [cache[g][0] for g, _ in samples], [cache[g][1][i] for g, i in samples]

    def _draw_step(self, step: int) -> None:
        n, stats = self.group_size, self.stats
        ids = range(step * self.prompts_per_step, (step + 1) * self.prompts_per_step)
        gen = np.random.Generator(np.random.PCG64(0))
        z = np.empty((len(ids), 2 * n))
        for row, state in zip(z, group_streams(_uint32_words(self.seed) + [7], ids)):
            gen.bit_generator.state = {"bit_generator": "PCG64", "state": state, "has_uint32": 0, "uinteger": 0}
            gen.standard_normal(out=row)
        # NumPy's normal is loc + scale·z and its log-normal exp(μ + σ·z) with the C library's exp (math.exp)
        prompts = np.clip(np.rint(stats.prompt_mean + stats.prompt_std * z[:, 0]), stats.prompt_min,
                          stats.prompt_max).astype(np.int64).tolist()
        m = mean_response(stats, self.max_response_len, step, self.trend)
        sigma2 = math.log1p(stats.response_cv ** 2)
        x = (math.log(m) - sigma2 / 2) + math.sqrt(sigma2) * z[:, n:]
        r = np.array([math.exp(v) for v in x.ravel().tolist()]).reshape(x.shape)
        responses = np.clip(np.rint(r), 1, self.max_response_len).astype(np.int64).tolist()
        for g, p, rs in zip(ids, prompts, responses):
            self._cache[g] = (p, tuple(rs))
