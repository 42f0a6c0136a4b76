"""Seeded prompt / response length draws from a dataset's statistics (``bidirl.presets.WorkloadStats``).

The static planner's representative batch (paper §4.2: B_p prompt groups and the trainer workload U_B they
induce) and the simulator's workload both come from here, so the planner predicts the work the simulator
runs. The distribution is the one documented on :class:`bidirl.presets.WorkloadStats`:

* response length ``min(max_response_len, max(1, round(X)))`` with ``X ~ LogNormal`` of mean
  ``m_k = response_mean_fraction · max_response_len · (1 + response_drift_per_step)^k · j_k`` and coefficient
  of variation ``response_cv`` (so ``σ² = ln(1 + cv²)``, ``μ = ln m_k − σ²/2``); ``k`` is the training step;
* ``j_k = exp(step_noise · z_k)`` is the per-step jitter of the mean: ``z_k`` is a standard normal that depends
  only on (dataset name, k) — the same for every request of step ``k`` and every run — and ``z_0 = 0``, so
  step 0 has exactly the preset's mean;
* prompt length ``round(N(prompt_mean, prompt_std))`` clipped to ``[prompt_min, prompt_max]``.
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


def mean_response(stats, max_response_len: int, step: int = 0) -> float:
    """m_k, the (unclipped) mean response length at training step ``step``."""
    return (stats.response_mean_fraction * max_response_len
            * (1.0 + stats.response_drift_per_step) ** step * step_jitter(stats, step))


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


class GroupLengths:
    """``(prompt_len, response target lengths)`` of prompt group ``group_id``: a pure function of
    ``(seed, group_id)``, memoised. Group ``g`` belongs to training step ``g // prompts_per_step`` (the step
    whose mean response length it follows), so every policy and every driver sees the same workload."""

    def __init__(self, stats, max_response_len: int, group_size: int, prompts_per_step: int, seed: int):
        self.stats, self.max_response_len, self.group_size = stats, int(max_response_len), int(group_size)
        self.prompts_per_step, self.seed = int(prompts_per_step), int(seed)
        self._cache: dict = {}

    @classmethod
    def of(cls, config, seed: int) -> "GroupLengths":
        w = config.workload
        return cls(config.workload_stats, w.max_response_len, w.group_size, w.prompts_per_step, seed)

    def __call__(self, group_id: int) -> tuple:
        out = self._cache.get(group_id)
        if out is None:
            p, r = sample_lengths(self.stats, self.max_response_len, self.group_size,
                                  np.random.default_rng([self.seed, 7, group_id]),
                                  step=group_id // self.prompts_per_step)
            out = self._cache[group_id] = (int(p[0]), tuple(int(x) for x in r))
        return out
