"""The p-norm overlap of compute and communication (paper appendix, "Stage-Time Models").

Compute time ``x`` and communication time ``c`` that run concurrently are combined as

    overlap(x, c, r) = (x^r + c^r)^(1/r),        r ≥ 1,

the fitted overlap model of Pollux (Qiao et al., OSDI'21) that the appendix adopts: ``r = 1`` is no overlap
(the two add up), ``r → ∞`` is perfect overlap (the longer one hides the shorter, ``max(x, c)``).
"""

from __future__ import annotations

import numpy as np


def overlap(x, c, r):
    """``(x^r + c^r)^(1/r)`` elementwise (numpy broadcasting), computed stably for large ``r``.

    ``x`` and ``c`` must be ≥ 0 and ``r`` ≥ 1; returns a float for scalar input, else an array.
    """
    x = np.asarray(x, dtype=float)
    c = np.asarray(c, dtype=float)
    r = np.asarray(r, dtype=float)
    if np.any(r < 1) or np.any(~np.isfinite(r)):
        raise ValueError(f"overlap exponent r must be a finite number ≥ 1, got {r}; use r = 1 for no overlap")
    if np.any(x < 0) or np.any(c < 0):
        raise ValueError("overlap: compute and communication times must be ≥ 0")
    out = combine(x, c, r)
    return float(out) if out.ndim == 0 else out


def combine(x: np.ndarray, c: np.ndarray, r: np.ndarray) -> np.ndarray:
    """:func:`overlap` on float arrays already known valid (no checks: for callers that validated once).

    Without communication the result is ``x`` itself — IEEE ``pow`` gives exactly 1 and 0 for the terms — so
    the powers are skipped there (the same numbers)."""
    if not np.any(c):
        return np.where(x > 0, x, 0.0) if np.ndim(x) or np.ndim(r) else np.asarray(x if x > 0 else 0.0)
    m = np.maximum(x, c)
    safe = np.where(m > 0, m, 1.0)
    out = m * ((x / safe) ** r + (c / safe) ** r) ** (1.0 / r)
    return np.where(m > 0, out, 0.0)
