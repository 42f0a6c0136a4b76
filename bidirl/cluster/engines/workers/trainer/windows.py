"""Auxiliary gradient windows, shard to shard (C_grad, paper §5.2; :mod:`bidirl.cluster.engines.workers.bridge`).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: an auxiliary rank sends the window
it accumulated in ``p.grad``; a primary rank keeps what it receives in ``windows`` until ``apply``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from bidirl.cluster.engines.workers import bridge


class Windows:
    """Send an auxiliary rank's window shard; receive one beside the primary rank's gradient."""

    def shard_signature(self) -> tuple:
        """Which elements of every parameter this rank holds (:func:`bridge.shard_signature`)."""
        return bridge.shard_signature(self.params)

    def send_window(self, transfer, chunk_ids: Optional[Sequence[int]] = None) -> dict:
        """Send this rank's shard of the window's accumulated gradient (the chunks :attr:`accumulated`, which must be
        ``chunk_ids`` when given) to the primary ranks that receive ``transfer`` (:func:`bridge.send_shard`: one
        transfer per rank pair, nothing through Ray) and forget it. The shard is flattened once on the device."""
        self._check_onloaded("send_window")
        ids = bridge.check_window(self.accumulated, chunk_ids, "send_window")
        pieces = self.order.pieces()
        if pieces:          # chunks kept apart (summed in unit order): each chunk's shard, in unit order, one vector
            flat = torch.cat([piece for *_, piece in pieces])
        else:
            flat = self._local_grad_vector()
        report = bridge.send_shard(transfer, flat, self._comm_device())
        self._clear_grads()
        return dict(report, chunks=ids, pieces=[(first, units, cid) for first, units, cid, _ in pieces])

    def receive_window(self, transfer, rank: int, pieces: Optional[Sequence[tuple]] = None) -> dict:
        """Receive an auxiliary rank's shard of its window's gradient as member ``rank`` of ``transfer`` and keep it
        under ``transfer.tid`` beside this rank's ``p.grad`` (:meth:`apply` adds the windows it is given). It runs
        beside a chunk in flight: nothing the chunk touches is changed, and a transfer that breaks off (raising
        ``WeightTransferError``) leaves the step's gradient as it was. ``pieces`` (``(first unit, units, chunk id)``
        of each chunk, in unit order) says the window holds its chunks apart, one shard each (:meth:`apply` adds
        each where it belongs in unit order)."""
        numel = self.local_numel * (len(pieces) if pieces else 1)
        flat, report = bridge.receive_shard(transfer, rank, numel, self._comm_device())
        if pieces:
            n = self.local_numel
            self.windows[transfer.tid] = [(int(first), int(units), cid, flat.narrow(0, k * n, n))
                                          for k, (first, units, cid) in enumerate(pieces)]
        else:
            self.windows[transfer.tid] = flat
        return dict(report, tid=transfer.tid)
