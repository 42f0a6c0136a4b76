"""A trainer rank's state copied to host memory beside the work that follows (the recovery snapshot's copy, paper
§3.2's fault tolerance; the driver's side is :mod:`bidirl.cluster.engines.trainer_recovery`).

A recovery snapshot needs a consistent host copy of the rank's weights and AdamW state. Only an optimizer step (or
an offload, or a weight load) changes them; the chunks that follow a step only add to ``p.grad``. So the copy runs
on a thread of its own while the next chunks run, and only a call that would change or free the state waits for it
(:meth:`StateCopy.wait`). The copy goes into one flat host buffer, allocated once and reused by every snapshot
(pinned where the engine runs on CUDA: a copy from the device into pageable memory runs at a fraction of the bus's
speed, 53 s for a 4B rank's state on an H200, ``benchmarks/trainer_scale.md``; pageable on CPU, where pinning buys
nothing). On CUDA the copy runs on a stream of its own, ordered after the work already queued on the engine's
stream; on CPU the same code runs with a plain buffer and no stream.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional

import torch

from bidirl.cluster.engines.workers.host_buffer import HostStash, aligned


def _leaves(tree, out: list) -> list:
    if torch.is_tensor(tree):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _leaves(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _leaves(v, out)
    return out


def _replace(tree, it):
    if torch.is_tensor(tree):
        return next(it)
    if isinstance(tree, dict):
        return {k: _replace(v, it) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replace(v, it) for v in tree)
    return tree


class StateCopy:
    """One copy at a time of a tree of (local, plain) tensors into a reused host buffer, on a thread of its own."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.allocations = 0              # how many times the buffer was allocated (once per state size)
        self.waited_s = 0.0               # how long the last wait() blocked its caller
        self._thread: Optional[threading.Thread] = None
        self._result = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()     # wait() may be called from the snapshot writer's thread too

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, tree, device) -> None:
        """Start copying every tensor of ``tree`` (dicts, lists, tuples of tensors on ``device``) to the host; the
        tree's tensors must not change until :meth:`wait` returns. The previous copy is waited for first."""
        self.wait()
        device = torch.device(device)
        tensors = [t.detach() for t in _leaves(tree, [])]
        total = sum(aligned(t.numel() * t.element_size()) for t in tensors)
        pin = HostStash.pinned_for(device)
        cuda = device.type == "cuda"
        # the copy follows what the engine's stream has queued (the optimizer step that made this state)
        ready = torch.cuda.current_stream(device).record_event() if cuda else None

        def run():
            try:
                if self.buffer is None or self.buffer.numel() < total or self.buffer.is_pinned() != pin:
                    self.buffer = None
                    self.buffer = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
                    self.allocations += 1
                stream = torch.cuda.Stream(device) if cuda else None
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    if cuda:
                        stream.wait_event(ready)
                    views, offset = [], 0
                    for t in tensors:
                        n = t.numel() * t.element_size()
                        view = self.buffer.narrow(0, offset, n).view(t.dtype).view(t.shape)
                        view.copy_(t, non_blocking=pin)
                        views.append(view)
                        offset += aligned(n)
                    if cuda:
                        stream.synchronize()
                self._result = _replace(tree, iter(views))
            except BaseException as exc:        # raised by wait(), on the caller's thread
                self._error = exc
        self._result, self._error = None, None
        self._thread = threading.Thread(target=run, name="bidirl-state-copy", daemon=True)
        self._thread.start()

    def wait(self):
        """Wait for the copy in flight; returns its tree of host tensors (views of the buffer: valid until the next
        :meth:`start`), or ``None`` if no copy was started."""
        with self._lock:
            t0 = time.perf_counter()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self.waited_s = time.perf_counter() - t0
            if self._error is not None:
                exc, self._error = self._error, None
                raise RuntimeError(f"the recovery snapshot's copy to host memory failed ({exc})") from exc
            return self._result
