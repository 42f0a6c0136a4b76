"""Auxiliary gradients shard to shard: a ``torch.distributed`` group between two trainer gangs (C_grad, §5.2).

Trainer-on-RolloutPool (paper §5.2, Algorithm 2) pays C_grad once per borrowed window: the auxiliary gang's
chunk gradients must reach the primary gang before its optimizer step. Here an auxiliary gang accumulates its
window's chunks into its own sharded ``p.grad`` (as a primary does) and, when the window ends, each auxiliary
rank sends each primary rank holding the same shard exactly that shard, over a process group of both gangs'
ranks (gloo on CPU, NCCL on GPU); Ray carries nothing but the ids. Shard layouts match by construction: the
planner gives both gangs replicas of the same ρ_t ranks (compatible layouts), so FSDP2 cuts every parameter the
same way on the rank with the same index within a replica. :func:`pair_ranks` checks that from each rank's
:func:`shard_signature` and pairs the ranks; a mismatch is a clear error, never a wrong sum.

The group is standalone (its own ``TCPStore`` and ``ProcessGroupGloo`` / ``ProcessGroupNCCL``), beside each
gang's default group, so neither gang's FSDP2 collectives are disturbed. Bridge ranks: the primary gang's ranks
first (``0 … P−1``), then the auxiliary gang's (``P … P+A−1``).
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch

from bidirl.errors import BidirlError


class BridgeError(BidirlError, ValueError):
    """Two gangs whose gradient shards do not line up (or a bridge used wrongly)."""


def shard_signature(params) -> tuple:
    """Which elements of every parameter this rank holds: ``((global offset, local shape), …)`` in parameter
    order (an unsharded parameter: offset zeros, its whole shape)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for p in params:
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out.append((tuple(int(o) for o in offset), tuple(int(n) for n in shape)))
        else:
            out.append(((0,) * p.dim(), tuple(p.shape)))
    return tuple(out)


def pair_ranks(primary: Sequence[tuple], auxiliary: Sequence[tuple]) -> dict:
    """``{auxiliary rank: [primary ranks]}`` — each primary rank gets its shard from the first auxiliary rank
    that holds exactly the same elements (signatures from :func:`shard_signature`, in rank order)."""
    pairs: dict = {}
    for p, sig in enumerate(primary):
        src = next((a for a, s in enumerate(auxiliary) if s == sig), None)
        if src is None:
            raise BridgeError(f"primary trainer rank {p} holds a gradient shard no auxiliary rank holds: the gangs' "
                              f"layouts differ ({len(primary)} vs {len(auxiliary)} ranks); give both gangs the same "
                              "ranks per replica (the planner's compatible layouts, Topology.trainer_layout)")
        pairs.setdefault(src, []).append(p)
    return pairs


class GradientBridge:
    """This process's end of the group between the gangs: ``rank`` of ``world`` rendezvousing at ``addr``."""

    def __init__(self, rank: int, world: int, addr: str, device: torch.device, timeout_s: float = 1800.0):
        import torch.distributed as dist

        if ":" not in addr:
            raise BridgeError(f"GradientBridge: addr must be 'host:port', got {addr!r}")
        if not 0 <= rank < world:
            raise BridgeError(f"GradientBridge: rank must be in [0, world), got rank={rank}, world={world}")
        host, port = addr.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), world, rank == 0, timeout=timeout)
        self.device = torch.device(device)
        if self.device.type == "cuda":     # GPU-only branch: NCCL point-to-point between the gangs' GPUs
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("bidirl-bridge", store), rank, world)
        else:
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("bidirl-bridge", store), rank, world, timeout)
        self.rank, self.world = rank, world
        self.sent = self.received = 0          # transfers (one per rank pair and window)
        self.bytes = 0

    def send(self, flat: torch.Tensor, dst: int) -> None:
        self.group.send([flat], dst, 0).wait()
        self.sent += 1
        self.bytes += flat.numel() * flat.element_size()

    def recv(self, numel: int, src: int, dtype=torch.float32) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=self.device)
        self.group.recv([out], src, 0).wait()
        self.received += 1
        self.bytes += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self.group = None


def check_window(accumulated: Sequence, chunk_ids: Optional[Sequence], who: str) -> list:
    """The window's chunk ids: what was accumulated must be exactly ``chunk_ids`` (when given), each once."""
    have = [int(c) for c in accumulated]
    if len(set(have)) != len(have):
        raise BridgeError(f"{who}: a chunk was accumulated twice ({have}); a chunk counts once")
    if chunk_ids is not None and sorted(have) != sorted(int(c) for c in chunk_ids):
        raise BridgeError(f"{who}: the window accumulated chunks {sorted(have)}, the merge names "
                          f"{sorted(int(c) for c in chunk_ids)}; send every chunk of the window once")
    return have
