"""A trainer rank's state copied to host memory beside the work that follows (the recovery snapshot's copy, paper
§3.2's fault tolerance; the driver's side is :mod:`bidirl.cluster.engines.trainer_recovery`).

A recovery snapshot needs a consistent host copy of the rank's weights and AdamW state. Only an optimizer step (or
a weight load) changes them; the chunks that follow a step only add to ``p.grad``. So the copy runs on a thread of
its own while the next chunks run, and only a call that would change or free the state waits for it
(:meth:`StateCopy.wait`). The copy goes into the engine's hot-switch host buffer
(:class:`~bidirl.cluster.engines.workers.host_buffer.HostStash`), at the offsets an offload lays that state out at
(:meth:`HostStash.stage`): no second buffer — at 4B a rank's state is 48 GB, the switch's buffer 80 GB, an H200
host 128 GiB — and an offload that follows finds the weights and moments already there and copies only the
gradients and the published versions, while the snapshot's write goes on reading them. The buffer is page-locked
where the engine runs on CUDA (a copy from the device into pageable memory runs at a fraction of the bus's speed,
53 s for a 4B rank's state on an H200, ``benchmarks/trainer_scale.md``), pageable on CPU. On CUDA the copy runs on
a stream of its own, ordered after the work already queued on the engine's stream; on CPU the same code runs with
no stream. Leaves of the state that are not in the staged storages (AdamW's ``step`` counters) are cloned.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional

import torch

from bidirl.cluster.engines.workers.host_buffer import HostStash


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
    """One copy at a time of a tree of (local, plain) tensors into an engine's host buffer, on a thread of its own."""

    def __init__(self, stash: HostStash):
        self.stash = stash
        self.cloned_bytes = 0             # bytes of leaves outside the staged storages, cloned (the last copy)
        self.waited_s = 0.0               # how long the last wait() blocked its caller
        self._thread: Optional[threading.Thread] = None
        self._result = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()     # wait() may be called from the snapshot writer's thread too

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, tree, device, storages, capacity: int) -> None:
        """Start copying ``storages`` (the tensors an offload lays out first: weights, then moments) into the host
        buffer's prefix (:meth:`HostStash.stage`, a buffer of ``capacity`` bytes) and building ``tree`` (dicts,
        lists, tuples of tensors on ``device``, each on one of ``storages`` or cloned) from it; the tensors must
        not change until :meth:`wait` returns. The previous copy is waited for first."""
        self.wait()
        device = torch.device(device)
        cuda = device.type == "cuda"
        storages = [t.detach() for t in storages]
        leaves = [t.detach() for t in _leaves(tree, [])]
        # the copy follows what the engine's stream has queued (the optimizer step that made this state)
        ready = torch.cuda.current_stream(device).record_event() if cuda else None

        def run():
            try:
                stream = torch.cuda.Stream(device) if cuda else None
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    if cuda:
                        stream.wait_event(ready)
                    self.stash.stage(storages, capacity)
                    region = self.stash.staged_region()
                    views, cloned = [], 0
                    for t in leaves:
                        view = self.stash.staged_view(t, region)
                        if view is None:
                            view = t.to("cpu", copy=True)
                            cloned += t.numel() * t.element_size()
                        views.append(view)
                    if cuda:
                        stream.synchronize()
                self.cloned_bytes = cloned
                self._result = _replace(tree, iter(views))
            except BaseException as exc:        # raised by wait(), on the caller's thread
                self._error = exc
        self._result, self._error = None, None
        self._thread = threading.Thread(target=run, name="bidirl-state-copy", daemon=True)
        self._thread.start()

    def wait(self):
        """Wait for the copy in flight; returns its tree of host tensors (views of the host buffer's staged prefix:
        valid until the state is copied there again), or ``None`` if no copy was started."""
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
