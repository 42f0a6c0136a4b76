"""Balanced, deterministic assignment of work items to ``d`` replicas (the appendix's X = X_1 ∪ … ∪ X_d).

Items are sorted by a weight (descending, ties in input order) and dealt in serpentine order
(0, 1, …, d−1, d−1, …, 1, 0, 0, 1, …): every replica gets ⌊n/d⌋ or ⌈n/d⌉ items and the heavy items are spread
evenly, the same balancing veRL applies to sequence lengths across data-parallel ranks (``balance_batch``),
done here without a Python loop.
"""

from __future__ import annotations

import numpy as np


def check_replicas(d, name: str = "d (number of replicas)") -> int:
    """``d`` as an int if it is a whole number ≥ 1, else a ValueError naming ``name``."""
    try:
        ok = not isinstance(d, bool) and int(d) == d and d >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a whole number ≥ 1, got {d!r}")
    return int(d)


def serpentine(weights, d: int) -> tuple:
    """``(replica, rank)`` int arrays: the replica each item goes to and its position on that replica.

    Items are visited heaviest first; ``rank`` orders the items of one replica the same way.
    """
    d = check_replicas(d)
    w = np.asarray(weights, dtype=float).reshape(-1)
    n = w.size
    order = np.argsort(-w, kind="stable")
    k = np.arange(n)
    rounds, pos = np.divmod(k, d)
    rep = np.where(rounds % 2 == 0, pos, d - 1 - pos)
    replica = np.empty(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    replica[order] = rep
    rank[order] = rounds
    return replica, rank


def small_keys(keys: np.ndarray) -> np.ndarray:
    """Non-negative integer ``keys`` in the smallest unsigned type that holds them, so that NumPy's stable sort
    of them is a radix sort (the stage models' sorts by length, chunk or replica)."""
    top = int(keys.max()) if keys.size else 0
    return keys.astype(np.uint8) if top < 2 ** 8 else keys.astype(np.uint16) if top < 2 ** 16 else keys


def stable_order(keys: np.ndarray) -> np.ndarray:
    """The indices that sort non-negative integer ``keys`` ascending, ties in input order."""
    return np.argsort(small_keys(keys), kind="stable")


def grouped_order(groups: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The indices sorted by ``groups``, then by ``keys`` within a group, ties in input order (both non-negative
    integers): two stable passes."""
    order = stable_order(keys)
    return order[stable_order(groups[order])]


def runs_of(sizes: np.ndarray, total: int):
    """``(lo, hi)``: consecutive runs of ``sizes`` adding up to about ``total`` each (at least one item), so that
    the stage models vectorise a few replica counts at a time and stay in cache."""
    ends = np.cumsum(sizes)
    lo = 0
    while lo < sizes.size:
        hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - sizes[lo] + total, side="right")))
        yield lo, hi
        lo = hi
