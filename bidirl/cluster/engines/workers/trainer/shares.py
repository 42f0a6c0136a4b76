"""How a chunk's samples are dealt to a trainer gang's ranks (paper §5: one micro-batch per device)."""

from __future__ import annotations

from typing import Sequence


def rank_shares(indices: Sequence, per_device: int, ranks: int) -> list:
    """A chunk's samples dealt to a gang's ranks (one list per rank, in rank order): rank ``r`` takes the
    ``r``-th contiguous run of ``per_device`` samples (the chunk's ``per_device``: one micro-batch per device),
    so the last ranks of a short chunk get fewer or none."""
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
        raise ValueError(f"rank_shares: per_device must be a positive integer, got {per_device!r}")
    if len(indices) > per_device * ranks:
        raise ValueError(f"rank_shares: {len(indices)} samples do not fit {ranks} ranks of {per_device}")
    return [list(indices[r * per_device:(r + 1) * per_device]) for r in range(ranks)]


def forward_ranks(shares: Sequence, ranks_per_replica: int = 1) -> list:
    """The ranks that run a forward-only stage: every rank of each replica that has a sample (the ranks of a
    replica gather its sharded weights together, so an empty rank joins with an empty share)."""
    busy = {r // ranks_per_replica for r, s in enumerate(shares) if len(s)}
    return [r for r in range(len(shares)) if r // ranks_per_replica in busy]
