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
import time
from typing import Optional, Sequence

import torch

#: byte alignment of each storage's slice in the buffer (keeps every slice aligned for any dtype and for DMA)
ALIGN = 64


def aligned(nbytes: int) -> int:
    """The bytes a slice of ``nbytes`` takes in the buffer (rounded up to :data:`ALIGN`)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


class PinnedMemory:
    """``nbytes`` of host memory page-locked for CUDA copies, at exactly that size.

    ``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
    allocation up to the next power of two before asking CUDA (``CachingHostAllocator.h``: ``PowerOf2Ceil``): an
    80 GB buffer (a 4B rank's state and two published versions) would page-lock 128 GiB — all of an H200 host's
    memory. So the buffer is allocated as ordinary host memory, its pages are touched by torch's threads (``zero_``:
    the kernel maps them in parallel) and the whole range is registered with one ``cudaHostRegister`` (one
    registration: a copy may not span two), and unregistered when it is freed (:meth:`close`, or when the object is
    collected). Measured on an H200 host (``benchmarks/trainer_scale.md``): 8 GiB in 1.0 s this way (0.55 s touching,
    0.48 s registering), against 4.4 s registering untouched pages and 4.9 s for ``pin_memory=True`` of 6 GiB
    (which page-locked 8 GiB); copies through it run at 55 GB/s each way."""

    def __init__(self, nbytes: int):
        self.tensor = torch.empty(int(nbytes), dtype=torch.uint8, device="cpu")
        self._registered = None
        if int(nbytes) == 0:
            return
        self.tensor.zero_()
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), int(nbytes), 0)
        try:
            torch.cuda.check_error(err)
        except Exception as exc:                # torch.cuda.CudaError
            raise RuntimeError(f"could not page-lock {int(nbytes) / 2**30:.1f} GiB of host memory for the hot "
                               f"switch ({exc}); free host memory or give the trainer workers more") from exc
        self._registered = self.tensor.data_ptr()

    def close(self) -> None:
        """Unregister the buffer (the memory itself is freed with :attr:`tensor`)."""
        registered, self._registered = self._registered, None
        if registered is not None:
            torch.cuda.cudart().cudaHostUnregister(registered)

    def __del__(self):
        try:
            self.close()
        except Exception:                       # at interpreter exit CUDA may be gone: nothing left to unregister
            pass


def host_empty(nbytes: int, pin: bool):
    """A flat uint8 host buffer of ``nbytes`` and what keeps it page-locked (a :class:`PinnedMemory`, or ``None``
    for pageable memory): pinned where it serves a CUDA device, pageable on CPU."""
    if pin:
        memory = PinnedMemory(nbytes)
        return memory.tensor, memory
    return torch.empty(int(nbytes), dtype=torch.uint8, device="cpu"), None


class HostStash:
    """A reusable flat host buffer holding tensors' storages while they are offloaded.

    The buffer also keeps what it last received of the state that only an optimizer step or a load changes
    (weights, AdamW moments, the reference): its *staged* prefix — written by an offload, or by a recovery
    snapshot's copy (:meth:`stage`), at the offsets an offload lays those storages out at. While the caller has not
    changed that state (:meth:`invalidate` says it has), an offload copies only what follows the prefix (the
    gradients, the published versions): the snapshot's copy is the offload's, and a write of the snapshot may go
    on reading the prefix through the switch."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None     # uint8, page-locked when CUDA is present
        self.pinned = False
        self._pinning = None                           # the PinnedMemory keeping ``buffer`` page-locked
        self.allocations = 0                           # how many times a buffer was allocated (grows only)
        self._held: list = []                          # (tensor, offset, nbytes) while offloaded
        self._staged: list = []                        # (storage key, offset, nbytes) the buffer holds unchanged
        self.nbytes = 0
        self.copied_bytes = 0                          # bytes the last offload copied (the staged prefix skipped)
        self._reserving: Optional[threading.Thread] = None     # reserve()'s allocation in flight
        self.reserve_seconds = 0.0                     # how long the last reserve()'s allocation took
        self._reserving_for = (0, False)               # (bytes, pinned) of the allocation in flight
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
        :meth:`offload` waits only for what is left of it. A buffer at least that large is kept, and one at least
        that large still being allocated is not waited for (a lone bf16 engine shards itself at its first call and
        asks again for the same size)."""
        if self._reserving is not None and self._reserving_for[0] >= nbytes and self._reserving_for[1] == pin:
            return
        self._wait_reserved()
        if self.buffer is not None and self.buffer.numel() >= nbytes and self.pinned == pin:
            return
        self._reserving_for = (int(nbytes), pin)

        def allocate():
            t0 = time.perf_counter()
            try:
                self._allocate(int(nbytes), pin)
            except BaseException as exc:                # raised by the offload that waits for it
                self._reserve_error = exc
            self.reserve_seconds = time.perf_counter() - t0
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
        self.buffer, self._staged = None, []           # free the old one before allocating the larger one
        if self._pinning is not None:
            self._pinning.close()
            self._pinning = None
        self.buffer, self._pinning = host_empty(total, pin)
        self.pinned = pin
        self.allocations += 1

    def _ensure(self, total: int, pin: bool) -> torch.Tensor:
        self._wait_reserved()
        if self.buffer is None or self.buffer.numel() < total or self.pinned != pin:
            self._allocate(total, pin)
        return self.buffer

    @staticmethod
    def _layout(tensors: Sequence[torch.Tensor], start: int = 0) -> list:
        """``(tensor, offset, nbytes)`` of each storage laid out from ``start``, each slice :func:`aligned`."""
        layout, total = [], start
        for t in tensors:
            n = t.untyped_storage().nbytes()
            layout.append((t, total, n))
            total += aligned(n)
        return layout

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        """A storage's identity across :meth:`offload` / :meth:`restore` (its data pointer changes; it does not)."""
        return t.untyped_storage()._cdata

    def staged_prefix(self, tensors: Sequence[torch.Tensor]) -> int:
        """How many leading ``tensors`` the buffer holds unchanged at the offsets an offload would use."""
        k = 0
        for (t, offset, n), (key, s_offset, s_n) in zip(self._layout(tensors), self._staged):
            if (self._key(t), offset, n) != (key, s_offset, s_n):
                break
            k += 1
        return k

    def invalidate(self) -> None:
        """The caller changed the state the staged prefix holds (an optimizer step, a load): copy it again."""
        self._staged = []

    def _copy_in(self, layout: list, cuda: bool) -> None:
        buf = self.buffer
        for t, offset, n in layout:
            dst = buf.narrow(0, offset, n)
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0, (n,))
            dst.copy_(src, non_blocking=cuda and self.pinned)

    def stage(self, tensors: Sequence[torch.Tensor], capacity: int) -> None:
        """Copy ``tensors``' storages (the state an offload lays out first) into the buffer's prefix (a buffer of
        ``capacity`` bytes, allocated if none is) and remember them as staged. On CUDA the caller orders this
        after its work and waits for it (``torch.cuda.stream``; :mod:`.state_copy`)."""
        if self._held:
            raise RuntimeError("HostStash.stage: the buffer holds an offloaded state; restore() it first")
        cuda = any(t.device.type == "cuda" for t in tensors)
        self._ensure(capacity, pin=cuda and torch.cuda.is_available())
        layout = self._layout(tensors)
        self._staged = []
        self._copy_in(layout, cuda)
        self._staged = [(self._key(t), offset, n) for t, offset, n in layout]

    def staged_region(self) -> torch.Tensor:
        """The staged prefix as a uint8 tensor whose storage is exactly that region of the buffer (so that
        ``torch.save`` of views into it writes the region, not the whole buffer)."""
        end = max((offset + n for _, offset, n in self._staged), default=0)
        return torch.from_numpy(self.buffer.numpy()[:end])

    def staged_view(self, t: torch.Tensor, region: torch.Tensor) -> Optional[torch.Tensor]:
        """The host copy of ``t`` (a tensor on a staged storage, any view of it) inside ``region``
        (:meth:`staged_region`), or ``None`` if its storage is not staged."""
        key = self._key(t)
        for k, offset, n in self._staged:
            if k == key:
                flat = region.narrow(0, offset, n).view(t.dtype)
                return flat.as_strided(t.shape, t.stride(), flat.storage_offset() + t.storage_offset())
        return None

    def offload(self, tensors: Sequence[torch.Tensor], readable: Sequence[torch.Tensor] = (),
                stable: int = 0) -> list:
        """Copy every tensor's storage into the buffer and free the storage; the ``readable`` tensors are copied
        into the buffer too and left as they are: returns their host copies (views of the buffer, in order).
        The first ``stable`` tensors are state that only an optimizer step or a load changes: what the buffer
        holds of them unchanged (:meth:`staged_prefix`) is not copied again, and they stay staged afterwards."""
        if self._held:
            raise RuntimeError("HostStash.offload: already holding an offloaded state; restore() it first")
        for t in tensors:
            if not t.untyped_storage().resizable():
                raise RuntimeError(f"HostStash.offload: a {tuple(t.shape)} {t.dtype} tensor's storage cannot be "
                                   "resized (it was read from a file or wraps memory it does not own), so it cannot "
                                   "be freed in place; copy it into storage of its own (t.clone()) when it becomes "
                                   "engine state")
        layout = self._layout(tensors)
        total = layout[-1][1] + aligned(layout[-1][2]) if layout else 0
        copies = []
        for t in readable:
            t = t.contiguous()
            n = t.numel() * t.element_size()
            copies.append((t, total, n))
            total += aligned(n)
        cuda = any(t.device.type == "cuda" for t, _, _ in layout + copies)
        buf = self._ensure(total, pin=cuda and torch.cuda.is_available())
        skip = self.staged_prefix(tensors)
        self._copy_in(layout[skip:], cuda)
        views = []
        for t, offset, n in copies:
            view = buf.narrow(0, offset, n).view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=cuda and self.pinned)
            views.append(view)
        if cuda:
            torch.cuda.synchronize()
        for t, _, _ in layout:
            t.untyped_storage().resize_(0)
        self._held = layout
        self._staged = [(self._key(t), offset, n) for t, offset, n in layout[:max(int(stable), skip)]]
        self.nbytes = sum(n for _, _, n in layout + copies)
        self.copied_bytes = sum(n for _, _, n in layout[skip:] + copies)
        return views

    def restore(self) -> int:
        """Re-allocate every offloaded storage and copy its bytes back; returns the bytes moved. The staged
        prefix stays: the buffer still holds that state as the device now does."""
        cuda = False
        for t, offset, n in self._held:
            storage = t.untyped_storage()
            storage.resize_(n)
            dst = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (n,))
            dst.copy_(self.buffer.narrow(0, offset, n), non_blocking=self.pinned)
            cuda = cuda or t.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        moved = sum(n for _, _, n in self._held)
        self._held = []
        return moved
