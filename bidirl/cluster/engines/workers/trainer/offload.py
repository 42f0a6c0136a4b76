"""Hot switching a trainer rank: offload its state to the engine's host buffer and back (the trainer half of a
switch's C_in / C_out, paper §3.2; :mod:`bidirl.cluster.engines.workers.host_buffer`).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: it owns the engine's ``_host``
stash and moves the published weight versions (``published``) with the rest of the state.

One path on every device: the state's storages and the published shards go into the same host buffer by the same
code (pinned where the engine runs on CUDA, pageable on CPU), allocated once, in the background, as soon as the
engine is loaded (:meth:`Offload._reserve_host`, sized by :meth:`Offload.host_capacity`). The state is freed in
place; the published shards are replaced by their host copies, which a send reads while the engine is offloaded
(a send already in flight keeps the device tensors it started with until it ends), and brought back as fresh
device copies by :meth:`Offload.onload`. An offload waits for the recovery snapshot's copy in flight (it reads
the state it would free) and for any send still reading the host copies it would overwrite.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from bidirl.cluster.engines.workers.host_buffer import HostStash, aligned
from bidirl.cluster.engines.workers.trainer.tensors import checkpoint_tensors, local_part

#: published weight versions a rank holds at most: the newest and the one before it, which a rollouter may still
#: be sent (``bidirl.cluster.engines.weight_sync.WeightSync.snapshot_spec`` keeps one older version)
PUBLISHED_VERSIONS = 2


class Offload:
    """``offload`` / ``onload`` and the bytes they move."""

    def _stable_tensors(self, freed: bool = False) -> list:
        """The state only an optimizer step or a load changes, one tensor per storage, in the order an offload lays
        it out first: weights, then AdamW's moments (primary), then the reference model (``freed``: offloaded
        ones too)."""
        tensors = [local_part(p) for p in self.params]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                tensors += [local_part(v) for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
        if self._reference is not None:
            tensors += [local_part(p) for p in self._reference.parameters()]
        return self._unique(tensors, freed)

    def _snapshot_storages(self) -> list:
        """The storages a recovery snapshot holds (weights and moments: the stable state but the reference)."""
        reference = {t.untyped_storage()._cdata for t in (
            [local_part(p) for p in self._reference.parameters()] if self._reference is not None else [])}
        return [t for t in self._stable_tensors() if t.untyped_storage()._cdata not in reference]

    def _state_tensors(self, freed: bool = False) -> list:
        """This rank's weight, optimizer-state, reference and accumulated-gradient tensors, one per storage, the
        stable state first (:meth:`_stable_tensors`; ``freed``: offloaded ones too)."""
        stable = self._stable_tensors(freed)
        grads = [local_part(p.grad) for p in self.params if p.grad is not None]
        return self._unique(stable + grads, freed)

    @staticmethod
    def _unique(tensors: list, freed: bool) -> list:
        seen, unique = set(), []
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and (freed or t.untyped_storage().nbytes() > 0):
                seen.add(key)
                unique.append(t)
        return unique

    @property
    def offloaded(self) -> bool:
        return self._host.holding

    @property
    def host_buffer_allocations(self) -> int:
        """How many times the offload host buffer was allocated (once per state size, not once per switch)."""
        return self._host.allocations

    def offload(self) -> float:
        """Copy this rank's weights, optimizer state, accumulated gradients (and the reference model, if
        loaded) — its shards when sharded — into the engine's host buffer
        (:mod:`bidirl.cluster.engines.workers.host_buffer`:
        allocated once, pinned where CUDA is present, reused by every switch) and free the device copy;
        returns seconds."""
        if self._host.holding:
            return 0.0
        self._load_if_pending()
        t0 = time.perf_counter()
        self._wait_state_copy("offload", changes=False)
        stable, state = self._stable_tensors(), self._state_tensors()
        if self._host.staged_prefix(state) < len(stable):
            # the stable state changed since the buffer last held it: its copy overwrites the snapshot's, which a
            # write in flight may still be reading
            t1 = time.perf_counter()
            self._snapshots.flush()
            self.snapshot_waits["offload_write"] = time.perf_counter() - t1
        self._reshard(self.model)
        if self._reference is not None:
            self._reshard(self._reference)
        with self._published_readers:
            self._published_readers.wait_for(lambda: self._host_readers == 0)
            order = [(v, k, rows) for v, shards in self.published.items() for k, (_, rows) in shards.items()]
            views = self._host.offload(state, readable=[self.published[v][k][0] for v, k, _ in order],
                                       stable=len(stable))
            self.published = self._regroup(order, views)       # a new dict: a send in flight keeps its own
            self._published_on_host = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def onload(self) -> float:
        """Re-allocate and restore what :meth:`offload` moved out (the host buffer is kept; the published shards
        come back as device copies of their host copies); returns seconds."""
        if not self._host.holding:
            return 0.0
        t0 = time.perf_counter()
        self._host.restore()
        with self._published_readers:
            order = [(v, k, rows) for v, shards in self.published.items() for k, (_, rows) in shards.items()]
            copies = [self.published[v][k][0].to(self.device, copy=True, non_blocking=True) for v, k, _ in order]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.published = self._regroup(order, copies)
            self._published_on_host = False
        return time.perf_counter() - t0

    @staticmethod
    def _regroup(order: list, tensors: list) -> dict:
        out: dict = {}
        for (v, k, rows), t in zip(order, tensors):
            out.setdefault(v, {})[k] = (t, rows)
        return out

    @contextlib.contextmanager
    def _reading_published(self, shards: dict):
        """While a send reads ``shards``: if they are host copies, an offload (which would overwrite them) waits."""
        with self._published_readers:
            on_host = self._published_on_host and any(shards is s for s in self.published.values())
            self._host_readers += on_host
        try:
            yield
        finally:
            if on_host:
                with self._published_readers:
                    self._host_readers -= 1
                    self._published_readers.notify_all()

    def host_capacity(self) -> int:
        """The host buffer's bytes for this rank's largest state: weights, their gradients, AdamW's two moments
        (primary), the reference model and :data:`PUBLISHED_VERSIONS` published versions in the wire dtype
        (``publish_dtype``), each slice aligned as :class:`HostStash` lays them out."""
        total = 0
        per_param = 1 + 1 + (2 if self.optimizer is not None else 0)      # weights, gradient, exp_avg, exp_avg_sq
        for p in self.params:
            local = local_part(p)
            total += per_param * aligned(local.numel() * local.element_size())
        if self._reference is not None:
            for p in self._reference.parameters():
                local = local_part(p)
                total += aligned(local.numel() * local.element_size())
        if self.publish_dtype is not None:
            from bidirl.cluster.engines.workers.weight_transport import DTYPES
            size = torch.empty(0, dtype=DTYPES[self.publish_dtype]).element_size()
            shards = sum(aligned(math.prod(local_part(t).shape) * size)
                         for t in checkpoint_tensors(self.model).values())
            total += PUBLISHED_VERSIONS * shards
        return total

    def _reserve_host(self) -> None:
        """Allocate the host buffer in the background now that the engine is loaded (module docstring)."""
        self._host.reserve(self.host_capacity(), pin=HostStash.pinned_for(self.device))

    def state_bytes(self) -> int:
        """Bytes of weights + optimizer state (+ accumulated gradients) this rank holds (what offload moves)."""
        if self._host.holding:
            return self._host.nbytes
        self._load_if_pending()
        return sum(t.untyped_storage().nbytes() for t in self._state_tensors())

    def resident_bytes(self) -> int:
        """Bytes of weights + optimizer state allocated on the engine's device now (0 while offloaded)."""
        self._load_if_pending()
        return sum(t.untyped_storage().nbytes() for t in self._state_tensors(freed=True))
