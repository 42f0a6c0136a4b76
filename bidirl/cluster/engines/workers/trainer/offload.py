"""Hot switching a trainer rank: offload its state to the engine's host buffer and back (the trainer half of a
switch's C_in / C_out, paper §3.2; :mod:`bidirl.cluster.engines.workers.host_buffer`).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: it owns the engine's ``_host``
stash.
"""

from __future__ import annotations

import time

import torch

from bidirl.cluster.engines.workers.trainer.tensors import local_part


class Offload:
    """``offload`` / ``onload`` and the bytes they move."""

    def _state_tensors(self, freed: bool = False) -> list:
        """This rank's weight, optimizer-state and accumulated-gradient tensors, one per storage (``freed``:
        offloaded ones too)."""
        tensors = [local_part(p) for p in self.params]
        tensors += [local_part(p.grad) for p in self.params if p.grad is not None]
        if self._reference is not None:
            tensors += [local_part(p) for p in self._reference.parameters()]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                tensors += [local_part(v) for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
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
        loaded) — its shards when sharded — into the engine's host buffer (:mod:`bidirl.cluster.engines.workers.host_buffer`:
        allocated once, pinned where CUDA is present, reused by every switch) and free the device copy;
        returns seconds."""
        if self._host.holding:
            return 0.0
        self._load_if_pending()
        t0 = time.perf_counter()
        self._reshard(self.model)
        if self._reference is not None:
            self._reshard(self._reference)
        self._host.offload(self._state_tensors())
        self._move_published("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def onload(self) -> float:
        """Re-allocate and restore what :meth:`offload` moved out (the host buffer is kept); returns seconds."""
        if not self._host.holding:
            return 0.0
        t0 = time.perf_counter()
        self._host.restore()
        self._move_published(self.device)
        return time.perf_counter() - t0

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
