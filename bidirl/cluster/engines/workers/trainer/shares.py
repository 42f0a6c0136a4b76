"""How a chunk's samples are dealt to a trainer gang's ranks (paper §5: one micro-batch per device).

Every rank of a gang runs every call of a chunk, a rank dealt no samples too (it joins with an empty share): the
gang's ranks take the same turns of its launch order (:mod:`bidirl.cluster.engines.workers.launch_order`), which
holds only if each rank makes the same gang calls and yields at the same points. A forward-only stage is no
exception, even where a replica without samples has no collective of its own to join (replicas of one rank): its
launch order would otherwise lack the turns the leader logs for the call, and its weight sends would wait on them
for ever.
"""

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

