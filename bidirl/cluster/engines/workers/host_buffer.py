"""One flat host buffer per engine for hot-switch offload / onload (the trainer half of C_in / C_out, paper §3.2).

A hot switch must move a trainer rank's state — weights, AdamW moments, any gradient kept for the next step — out
of device memory and back within seconds (Table 3: 3.4–7.7 s per switch). Copies between device and *pinned*
host memory run at bus speed (≈ 50 GB/s on an H100/H200 PCIe 5 link), but *allocating* pinned memory is slow
(≈ 1 GB/s: page-locking every page; 43 s for a 4B model's 45 GB) — so the buffer is allocated once per engine,
sized to the state, and reused by every later switch; it grows (a new allocation) only when the state grows
(the first optimizer step creates the AdamW moments). Pageable memory is used where no CUDA device is present
(a CPU engine), where pinning buys nothing. An engine knows its largest state once it is loaded (weights, their
gradients, AdamW moments, the reference model and the published versions): :meth:`HostStash.reserve` allocates
that much on a thread of its own as soon as the engine is loaded, so no switch waits for the allocation unless
it comes before the allocation ends (and then only for the rest of it).

:class:`HostStash` copies each storage into its slice of the buffer, then resizes the device storage to zero
bytes (the memory is really freed; tensors keep their identity, so the optimizer, FSDP2 and autograd hold the
same objects), and :meth:`HostStash.restore` re-allocates and copies back. Tensors that must stay readable while
offloaded (a trainer's published weight versions, which a send may read during the switch) are copied into the
same buffer by the same code, and :meth:`HostStash.offload` returns their host copies (views of the buffer)
instead of freeing them in place: the caller swaps them in, and its old device tensors are freed once no reader
holds them.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

#: byte alignment of each storage's slice in the buffer (keeps every slice aligned for any dtype and for DMA)
ALIGN = 64


def aligned(nbytes: int) -> int:
    """The bytes a slice of ``nbytes`` takes in the buffer (rounded up to :data:`ALIGN`)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


class HostStash:
    """A reusable flat host buffer holding tensors' storages while they are offloaded."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None     # uint8, pinned when CUDA is present
        self.allocations = 0                           # how many times a buffer was allocated (grows only)
        self._held: list = []                          # (tensor, offset, nbytes) while offloaded
        self.nbytes = 0
        self._reserving: Optional[threading.Thread] = None     # reserve()'s allocation in flight
        self._reserve_error: Optional[BaseException] = None

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @staticmethod
    def pinned_for(device) -> bool:
        """Whether a buffer that serves ``device`` is pinned: where it is a CUDA device (PyTorch pins host memory
        for CUDA copies only; on CPU pinning buys nothing)."""
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Allocate a buffer of ``nbytes`` on a thread of its own (at once if none is needed): the next
        :meth:`offload` waits only for what is left of it. A buffer at least that large is kept."""
        self._wait_reserved()
        if self.buffer is not None and self.buffer.numel() >= nbytes and self.buffer.is_pinned() == pin:
            return

        def allocate():
            try:
                self._allocate(int(nbytes), pin)
            except BaseException as exc:                # raised by the offload that waits for it
                self._reserve_error = exc
        self._reserving = threading.Thread(target=allocate, name="bidirl-host-buffer", daemon=True)
        self._reserving.start()

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._reserve_error is not None:
            exc, self._reserve_error = self._reserve_error, None
            raise RuntimeError(f"HostStash.reserve: the host buffer could not be allocated ({exc}); free host "
                               "memory or give the trainer workers more") from exc

    def _allocate(self, total: int, pin: bool) -> None:
        self.buffer = None                             # free the old one before allocating the larger one
        self.buffer = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.allocations += 1

    def _ensure(self, total: int, pin: bool) -> torch.Tensor:
        self._wait_reserved()
        if self.buffer is None or self.buffer.numel() < total or self.buffer.is_pinned() != pin:
            self._allocate(total, pin)
        return self.buffer

    def offload(self, tensors: Sequence[torch.Tensor], readable: Sequence[torch.Tensor] = ()) -> list:
        """Copy every tensor's storage into the buffer and free the storage; the ``readable`` tensors are copied
        into the buffer too and left as they are: returns their host copies (views of the buffer, in order)."""
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
            total += aligned(n)
        copies = []
        for t in readable:
            t = t.contiguous()
            n = t.numel() * t.element_size()
            copies.append((t, total, n))
            total += aligned(n)
        cuda = any(t.device.type == "cuda" for t, _, _ in layout + copies)
        buf = self._ensure(total, pin=cuda and torch.cuda.is_available())
        for t, offset, n in layout:
            dst = buf.narrow(0, offset, n)
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0, (n,))
            dst.copy_(src, non_blocking=cuda)
        views = []
        for t, offset, n in copies:
            view = buf.narrow(0, offset, n).view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=cuda)
            views.append(view)
        if cuda:
            torch.cuda.synchronize()
        for t, _, _ in layout:
            t.untyped_storage().resize_(0)
        self._held = layout
        self.nbytes = sum(n for _, _, n in layout + copies)
        return views

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
