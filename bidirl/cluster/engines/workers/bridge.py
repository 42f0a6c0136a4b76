"""Auxiliary gradients once per window, shard to shard (C_grad, paper §5.2, §6.2 "Cross-pool Synchronization").

Trainer-on-RolloutPool (§5.2, Algorithm 2) pays C_grad once per borrowed window: the auxiliary gang's chunk
gradients must reach the primary gang before its optimizer step. An auxiliary gang accumulates its window's
update chunks into its own sharded ``p.grad`` on its devices (as a primary does) and, when the window ends — before
it switches out — each auxiliary rank sends each primary rank holding the same shard exactly that shard; nothing
goes through the host (on GPU) or Ray, which carries the ids and the rendezvous only. Shard layouts match by
construction: the planner gives both gangs replicas of the same ρ_t ranks (compatible layouts), so FSDP2 cuts
every parameter the same way on the rank with the same index within a replica. :func:`pair_ranks` checks that
from each rank's :func:`shard_signature`; a mismatch is a clear error, never a wrong sum.

Each window is one transfer per auxiliary rank over the weight transport's machinery
(:mod:`bidirl.cluster.engines.workers.weight_transport`): a fresh rendezvous with the live primary ranks it serves, a
two-rank group per pair (gloo on CPU, NCCL between GPUs), the shard in buckets (:func:`window_layout`), and waits
that poll the rendezvous where the driver marks members it saw die. A long-lived group of both gangs would have
been formed once, but one dead member stalls every collective on it until a timeout; a transfer per window
confines a death to its own pairs and costs one rendezvous per window (milliseconds on gloo; NCCL's pair set-up on
GPU is part of the measured C_grad). A primary rank keeps the received shard beside its own gradient until the
optimizer step (:meth:`~bidirl.cluster.engines.workers.trainer.TrainerEngine.apply`), so a transfer that breaks off
leaves
its gradient untouched.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from bidirl.cluster.engines.workers import weight_transport as wt
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


#: a window's gradient travels in fp32 (the primary sums it into fp32 master gradients)
WIRE_DTYPE = "float32"


def window_layout(numel: int, bucket_bytes: int) -> wt.BucketLayout:
    """A shard vector of ``numel`` fp32 values as a transport layout: pieces ``grad/<offset>`` of at most
    ``bucket_bytes`` each, one per bucket, so neither end holds more than a bucket in flight beyond the shard."""
    per = max(1, int(bucket_bytes) // torch.float32.itemsize)
    pieces = [(f"grad/{o}", (min(per, numel - o),)) for o in range(0, numel, per)] or [("grad/0", (0,))]
    return wt.BucketLayout.plan(pieces, WIRE_DTYPE, max(int(bucket_bytes), torch.float32.itemsize))


def send_shard(transfer: wt.Transfer, flat: torch.Tensor, device) -> dict:
    """Send this auxiliary rank's shard vector ``flat`` to every receiver of ``transfer`` (the primary ranks that
    hold the same shard), bucket by bucket; a receiver that fails is dropped, the others are served."""
    sender = wt.Sender(transfer, device)
    t0 = time.monotonic()
    sender.connect()
    posted = None
    for i, bucket in enumerate(transfer.layout.buckets):
        slot = bucket[0]
        start = int(slot.name.split("/", 1)[1])
        piece = flat.narrow(0, start, slot.numel)
        if posted is not None:
            sender.complete(posted)
        posted = sender.post(i, piece) if sender.live else None
    if posted is not None:
        sender.complete(posted)
    return dict(sender.close(), seconds=time.monotonic() - t0)


def receive_shard(transfer: wt.Transfer, rank: int, numel: int, device) -> tuple:
    """Receive an auxiliary rank's shard vector (``numel`` fp32 values) as member ``rank`` of ``transfer``; returns
    (the vector on ``device``, the receiver's report). Raises ``WeightTransferError`` if the sender fails: nothing
    was added anywhere."""
    layout = transfer.layout
    receiver = wt.Receiver(transfer, rank, device)
    sent = sum(layout.bucket_numel(i) for i in range(len(layout.buckets)))
    if sent != numel:
        receiver.abandon("its shard differs in size")
        raise BridgeError(f"receive_window: the auxiliary rank sends a shard of {sent} values, this primary rank "
                          f"holds {numel}: the gangs' layouts differ; give both gangs the same ranks per replica "
                          "(the planner's compatible layouts, Topology.trainer_layout)")
    receiver.connect()
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for name, piece in receiver.items():
        start = int(name.split("/", 1)[1])
        out.narrow(0, start, piece.numel()).copy_(piece)
    return out, receiver.close()


def check_window(accumulated: Sequence, chunk_ids: Optional[Sequence], who: str) -> list:
    """The window's chunk ids: what was accumulated must be exactly ``chunk_ids`` (when given), each once."""
    have = [int(c) for c in accumulated]
    if len(set(have)) != len(have):
        raise BridgeError(f"{who}: a chunk was accumulated twice ({have}); a chunk counts once")
    if chunk_ids is not None and sorted(have) != sorted(int(c) for c in chunk_ids):
        raise BridgeError(f"{who}: the window accumulated chunks {sorted(have)}, the merge names "
                          f"{sorted(int(c) for c in chunk_ids)}; send every chunk of the window once")
    return have
