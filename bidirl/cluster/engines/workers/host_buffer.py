"""One flat host buffer per engine for hot-switch offload / onload (the trainer half of C_in / C_out, paper §3.2).

A hot switch must move a trainer rank's state — weights, AdamW moments, any gradient kept for the next step — out
of device memory and back within seconds (Table 3: 3.4–7.7 s per switch). Copies between device and *pinned*
host memory run at bus speed (≈ 50 GB/s on an H100/H200 PCIe 5 link), but *allocating* pinned memory is slow
(≈ 1 GB/s: page-locking every page; 43 s for a 4B model's 45 GB) — so the buffer is allocated once per engine,
sized to the state, and reused by every later switch; it grows (a new allocation) only when the state grows
(the first optimizer step creates the AdamW moments). Pageable memory is used where no CUDA device is present
(a CPU engine), where pinning buys nothing.

:class:`HostStash` copies each storage into its slice of the buffer, then resizes the device storage to zero
bytes (the memory is really freed; tensors keep their identity, so the optimizer, FSDP2 and autograd hold the
same objects), and :meth:`HostStash.restore` re-allocates and copies back.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

#: byte alignment of each storage's slice in the buffer (keeps every slice aligned for any dtype and for DMA)
ALIGN = 64


class HostStash:
    """A reusable flat host buffer holding tensors' storages while they are offloaded."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None     # uint8, pinned when CUDA is present
        self.allocations = 0                           # how many times a buffer was allocated (grows only)
        self._held: list = []                          # (tensor, offset, nbytes) while offloaded
        self.nbytes = 0

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def _ensure(self, total: int, pin: bool) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < total or self.buffer.is_pinned() != pin:
            self.buffer = None                         # free the old one before allocating the larger one
            self.buffer = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
            self.allocations += 1
        return self.buffer

    def offload(self, tensors: Sequence[torch.Tensor]) -> int:
        """Copy every tensor's storage into the buffer and free the storage; returns the bytes moved."""
        if self._held:
            raise RuntimeError("HostStash.offload: already holding an offloaded state; restore() it first")
        layout, total = [], 0
        for t in tensors:
            if not t.untyped_storage().resizable():
                raise RuntimeError(f"HostStash.offload: a {tuple(t.shape)} {t.dtype} tensor's storage cannot be "
                                   "resized (it was read from a file or wraps memory it does not own), so it cannot "
                                   "be freed in place; copy it into storage of its own (t.clone()) when it becomes "
                                   "engine state")
            n = t.untyped_storage().nbytes()
            layout.append((t, total, n))
            total += -(-n // ALIGN) * ALIGN
        cuda = any(t.device.type == "cuda" for t, _, _ in layout)
        buf = self._ensure(total, pin=cuda and torch.cuda.is_available())
        for t, offset, n in layout:
            dst = buf.narrow(0, offset, n)
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0, (n,))
            dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        for t, _, _ in layout:
            t.untyped_storage().resize_(0)
        self._held = layout
        self.nbytes = sum(n for _, _, n in layout)
        return self.nbytes

    def restore(self) -> int:
        """Re-allocate every offloaded storage and copy its bytes back; returns the bytes moved."""
        cuda = False
        for t, offset, n in self._held:
            storage = t.untyped_storage()
            storage.resize_(n)
            dst = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (n,))
            dst.copy_(self.buffer.narrow(0, offset, n), non_blocking=self.buffer.is_pinned())
            cuda = cuda or t.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        moved = sum(n for _, _, n in self._held)
        self._held = []
        return moved
