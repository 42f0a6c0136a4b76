"""Which actor version each engine worker holds, and the calls that bring it to another one (paper §3.2, §6.2).

Every worker holds a version (``EngineDriver.versions``): a fresh process the model folder's (0), the primary gang
the one its last optimizer step made. A command that needs a worker at a newer version — a ``SyncWeights``, a
``Generate`` or ``RunChunk`` for a worker behind, a ``Switch`` bringing workers in — loads it first, through the
weight transport (:mod:`.weight_sync`) or from Ray's object store; calls on one actor run in order, so the work sent
after a load sees the new weights. A rollouter switched out on GPU discards its weights (vLLM's level-2 sleep): its
version is forgotten, so the next command loads the current one.

An auxiliary trainer gang that keeps working after an optimizer step that kept the version (an optimizer
mini-batch's, or a streamed step's earlier local update's) is refreshed (``RefreshWeights``, :meth:`WeightLoads.refresh`):
the primary gang puts its current weights out the way it puts a version out (``put_version``, rank 0's full weights
into the object store) and the gang's ranks load them with ``load_state_dict``, the call a switch in loads a version
with. It still counts as holding the version (its chunks carry it), so a refreshed gang forgets its version when it
switches out: the next switch in loads the version's own weights.
"""

from __future__ import annotations

from typing import Optional

from bidirl.core import protocol as P

PRIMARY_TRAINER = P.PRIMARY_TRAINER


class WeightLoads:
    """The engine backend's weight loads and versions (module doc). ``backend``: the
    :class:`~bidirl.cluster.engines.backend.EngineBackend` (its ``pool``: the :class:`EngineDriver`)."""

    def __init__(self, backend):
        self.backend, self.pool = backend, backend.pool
        self.refreshed = set()          # trainer gangs holding weights past their version (module doc)

    def forget_discarded(self, workers) -> None:
        """Rollouters switched out on GPU sleep at level 2 and discard their weights: forget the version they held,
        so the next switch-in (or command) loads the current one (§3.2)."""
        d = self.pool
        if d.rollout.device == "cuda":
            for w in workers:
                if w not in d.gangs:
                    d.versions[w] = None
        for w in set(workers) & self.refreshed:      # weights past the version: the next switch in loads it
            d.versions[w] = None
            self.refreshed.discard(w)

    def refresh(self, cmd: P.RefreshWeights) -> None:
        """Load the primary gang's current weights (``cmd.updates`` optimizer steps past ``cmd.version``) into the
        auxiliary gang ``cmd.worker`` (module doc), then ``WeightsRefreshed``. Calls on one actor run in order: the
        primaries' gather follows the optimizer step it reflects, and the gang's next chunks follow the load."""
        d = self.pool
        start = d.now()
        gathers = [r.put_version.remote(weights=True, publish=None) for r in d.gangs[PRIMARY_TRAINER]]
        full = gathers[0][1]

        def gathered(_acks):
            loads = [(cmd.worker, r.load_state_dict.remote(full, cmd.version)) for r in d.gangs.get(cmd.worker, ())]

            def done(_replies):
                end = d.now()
                self.refreshed.add(cmd.worker)
                d.record_refresh(cmd, start, end)
                d.feed(P.WeightsRefreshed(end, cmd.worker, cmd.step, cmd.version, cmd.updates, end - start))
            d._when_all(loads, done)
        d._when_all([(PRIMARY_TRAINER, ack) for ack, _ in gathers], gathered)

    def calls(self, workers, version: int) -> list:
        """``(worker, ref)`` calls that load actor ``version`` into those of ``workers`` (rollouters, or a
        trainer gang's ranks) that do not hold it yet: one transfer from the primary gang (``WeightSync``), or loads
        from the object store. Calls on one actor run in order, so the work sent after these sees the new weights."""
        d = self.pool
        calls = []
        need = [w for w in d._alive(workers) if d.versions.get(w) != version]
        for w in need:
            d.versions[w] = version
        if need and d.sync.collective:
            return d.sync.loads(need, version)
        for w in need:
            if w in d.gangs:
                calls += [(w, r.load_state_dict.remote(d.weights[version], version)) for r in d.gangs[w]]
            else:
                calls.append((w, d.actors[w].load_weights.remote(d.weights[version], version)))
        return calls

    def record(self, replies, version: int, lane: Optional[str] = None):
        """Lazy weight loads as ``sync`` spans on each worker's lane (``lane``: a gang's, once for its ranks)."""
        self.pool.sync.received(replies)
        for reply in replies[:1] if lane is not None else replies:
            if reply is not None:
                self.backend.record_spans(reply, "sync", lane=lane, version=version)

    def sync_weights(self, cmd: P.SyncWeights):
        d = self.pool
        start = d.now()
        calls = self.calls(cmd.targets, cmd.version)

        def done(replies):
            end = d.now()
            per_target = {w: (self.backend.wall(r.spans[0]["start"]), self.backend.wall(r.spans[0]["end"]))
                          for (w, _), r in zip(calls, replies) if r is not None}
            d.sync.received(replies)
            d.record_sync(cmd, start, end, per_target)
            if replies:
                d._measure(("weight_sync", "rollout"), end - start)
            d.feed(P.SyncFinished(end, cmd.version, tuple(cmd.targets), end - start))
        # a target that dies meanwhile drops out: it loads this version when it is back and next generates
        d._when_all(calls, done, tolerate=True)
        self.prune()

    def prune(self):
        """Drop weight objects no worker holds any more (the newest always stays)."""
        d = self.pool
        keep = set(d.versions.values()) | {d.version, max(d.weights)}
        for v in [v for v in d.weights if v not in keep]:
            del d.weights[v]

    def version_calls(self) -> tuple:
        """Put the primary gang's new version out: (acknowledgement refs, rank 0's full weights ref). With the weight
        transport the ranks publish it (the weights ref is then None); on the object-store path they gather the
        full weights into the object store, owned by the driver. Only the acknowledgements are fetched."""
        d = self.pool
        publish = d.sync.snapshot_spec()
        calls = [r.put_version.remote(weights=publish is None, publish=publish)        # a collective gather
                 for r in d.gangs[PRIMARY_TRAINER]]
        return [c[0] for c in calls], calls[0][1]

    def keep_version(self, version: int, weights) -> None:
        d = self.pool
        d.sync.kept(version, d.versions.get(PRIMARY_TRAINER))
        d.weights[version] = weights if not d.sync.collective else None
        d.versions[PRIMARY_TRAINER] = version
