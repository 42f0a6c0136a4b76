"""Bytes the engine driver moves through Ray, by kind: what its actor calls put into the object store.

Measures the weight sync's promise (:mod:`bidirl.cluster.engines.workers.weight_transport`: Ray carries metadata
only) and
the rest of the driver's Ray traffic in a real run. While an :class:`ObjectStoreMeter` is active in the driver's
process it wraps every actor call the process makes (``ActorMethod._remote``) and counts, per kind:

* **arguments** passed by value: Ray stores an argument in the object store when its serialised size exceeds
  ``max_direct_call_object_size`` (100 KiB unless ``RAY_max_direct_call_object_size`` says otherwise) and inlines
  it in the call otherwise; the meter serialises each argument with Ray's own serialiser and files it under one or
  the other. Object refs passed along are not new objects and count nothing.
* **return values**: each returned object's size as Ray reports it (``ray.experimental.get_object_locations``)
  once it exists; objects with a location are in the object store, the others were returned inline. A streaming
  call's items (a rollouter's ``stream``: a Ray ``ObjectRefGenerator``) count as they are taken from it.

The kind of a call's data comes from the method and, for several returns, the return's position
(:data:`KINDS`): ``weights`` (weight loads, transfers and the full state dict), ``gradients`` (an auxiliary gang's
chunk gradients, or its windows' transfer metadata), ``groups`` (generated groups, the samples and log-probs trainers take), ``snapshot`` (the
primary gang's recovery snapshots: they go to the ranks' disks, so only the calls' folder and version count), ``metrics`` (replies,
acknowledgements, spans and statistics) and ``result`` (the full weights a finished run's result holds, gathered
once at its end). ``raylet_bytes`` cross-checks the total: the object store's own count
of bytes created on every node (``cumulative_created_bytes``) over the meter's life, which includes Ray's internal
objects.
"""

from __future__ import annotations

import os
from typing import Optional

#: method -> kind of its by-value arguments and of each of its returns (by position; the last entry repeats)
KINDS = {
    "load_weights": ("weights", ("metrics",)),
    "load_state_dict": ("weights", ("metrics",)),
    "receive_weights": ("weights", ("metrics",)),
    "send_weights": ("weights", ("metrics",)),
    "publish": ("weights", ("metrics",)),
    "weights": ("weights", ("result",)),
    "put_version": ("metrics", ("metrics", "weights")),
    "save_snapshot": ("snapshot", ("metrics",)),     # the recovery snapshot: to the rank's disk, only its name here
    "load_snapshot": ("snapshot", ("metrics",)),
    "chunk_gradient": ("groups", ("metrics", "gradients")),
    "receive_gradient": ("gradients", ("metrics",)),
    "send_window": ("gradients", ("metrics",)),      # the transfer's metadata: the shard goes rank to rank
    "receive_window": ("gradients", ("metrics",)),
    "start": ("groups", ("metrics",)),
    "step_until": ("metrics", ("groups",)),
    "stream": ("metrics", ("groups",)),          # items counted as the driver takes them from the generator
    "interrupt": ("metrics", ("groups",)),
    "logprobs": ("groups", ("groups",)),
}
CATEGORIES = ("weights", "gradients", "groups", "snapshot", "metrics", "result")


def inline_limit() -> int:
    """Ray's ``max_direct_call_object_size``: larger arguments and returns go into the object store."""
    return int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))


def raylet_created_bytes() -> int:
    """Bytes the object store of every live node has created so far (its ``cumulative_created_bytes``)."""
    import ray
    from ray._private.internal_api import node_stats

    total = 0
    for node in ray.nodes():
        if node.get("Alive"):
            stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
            total += int(stats.store_stats.cumulative_created_bytes)
    return total


class ObjectStoreMeter:
    """Counts what the driver's actor calls put into Ray's object store, by kind (module docstring).

    Use as a context manager around a run (or any calls); call :meth:`poll` now and then while calls complete
    (a run's ``kill=`` hook does) and :meth:`report` at the end."""

    def __init__(self):
        self.store: dict = dict.fromkeys(CATEGORIES, 0)      # bytes in the object store
        self.inline: dict = dict.fromkeys(CATEGORIES, 0)     # bytes passed inline (through Ray's RPCs)
        self.objects: dict = dict.fromkeys(CATEGORIES, 0)    # objects in the object store
        self.calls: dict = {}                                # method -> calls
        self._pending: list = []                             # (ref, kind) returns not measured yet
        self._streams: dict = {}                             # id of a streaming call's generator -> its items' kind
        self._orig = None
        self._raylet0: Optional[int] = None
        self.raylet_bytes: Optional[int] = None

    # ------------------------------------------------------------------------------------------
    def __enter__(self) -> "ObjectStoreMeter":
        import ray
        from ray.actor import ActorMethod

        if ray.is_initialized():               # else at the first call (a driver starts Ray inside its run)
            self._raylet0 = raylet_created_bytes()
        self._orig = orig = ActorMethod._remote
        self._orig_next = orig_next = ray.ObjectRefGenerator.__next__
        meter = self

        def _remote(method, args=None, kwargs=None, *rest, **kw):
            refs = orig(method, args, kwargs, *rest, **kw)
            try:
                meter._called(method._method_name, args or (), kwargs or {}, refs)
            except Exception:        # measuring must never break the run
                pass
            return refs

        def _next(stream):
            ref = orig_next(stream)
            kind = meter._streams.get(id(stream))
            if kind is not None:     # an item of a streaming call this meter saw: measured like a return
                meter._pending.append((ref, kind))
            return ref
        ActorMethod._remote = _remote
        ray.ObjectRefGenerator.__next__ = _next
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray.actor import ActorMethod
        if self._orig is not None:
            ActorMethod._remote = self._orig
            ray.ObjectRefGenerator.__next__ = self._orig_next
            self._orig = None
        try:
            self.poll(wait=True)
            if self._raylet0 is not None:
                self.raylet_bytes = raylet_created_bytes() - self._raylet0
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------
    def _called(self, method: str, args, kwargs, refs) -> None:
        import ray
        from ray._private.worker import global_worker

        if self._raylet0 is None:
            self._raylet0 = raylet_created_bytes()
        arg_kind, return_kinds = KINDS.get(method, ("metrics", ("metrics",)))
        self.calls[method] = self.calls.get(method, 0) + 1
        ctx = global_worker.get_serialization_context()
        limit = inline_limit()
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, ray.ObjectRef):
                continue
            size = int(ctx.serialize(value).total_bytes)
            if size > limit:
                self.store[arg_kind] += size
                self.objects[arg_kind] += 1
            else:
                self.inline[arg_kind] += size
        if isinstance(refs, ray.ObjectRefGenerator):     # a stream: its items are counted as the driver takes them
            self._streams[id(refs)] = return_kinds[0]
            return
        returned = refs if isinstance(refs, (list, tuple)) else [refs]
        for i, ref in enumerate(returned):
            if isinstance(ref, ray.ObjectRef):
                self._pending.append((ref, return_kinds[min(i, len(return_kinds) - 1)]))

    def poll(self, wait: bool = False, timeout: float = 60.0) -> None:
        """Measure the returned objects that exist by now (``wait``: wait up to ``timeout`` s for the rest)."""
        import ray
        if not self._pending:
            return
        refs = [r for r, _ in self._pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout if wait else 0, fetch_local=False)
        ready = set(ready)
        done = [(r, k) for r, k in self._pending if r in ready]
        self._pending = [(r, k) for r, k in self._pending if r not in ready]
        if not done:
            return
        where = ray.experimental.get_object_locations([r for r, _ in done])
        for ref, kind in done:
            info = where.get(ref) or {}
            size = int(info.get("object_size") or 0)
            if info.get("node_ids"):
                self.store[kind] += size
                self.objects[kind] += 1
            else:
                self.inline[kind] += size

    def report(self, steps: int = 1) -> dict:
        """``{"object_store": {kind: bytes per step}, "inline": {...}, "objects": {...}, "raylet_bytes": ...}``."""
        per = max(1, int(steps))
        return {"object_store": {k: v / per for k, v in self.store.items()},
                "inline": {k: v / per for k, v in self.inline.items()},
                "objects": {k: v / per for k, v in self.objects.items()},
                "object_store_total": sum(self.store.values()) / per,
                "raylet_bytes": None if self.raylet_bytes is None else self.raylet_bytes / per,
                "unmeasured_returns": len(self._pending), "steps": per}
