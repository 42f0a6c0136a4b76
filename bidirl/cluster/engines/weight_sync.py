"""The engine driver's side of the weight sync (paper §3.2, §6.2): the path weights take, and transfers in flight.

Every weight load the engine driver needs — the ``SyncWeights`` after an optimizer step, a rollouter behind the
version its ``Generate`` carries (one restarted, say), the workers a ``Switch`` brings in, an auxiliary gang before
its chunk — becomes one transfer of :mod:`bidirl.cluster.engines.workers.weight_transport` (``transport.weights:
collective``, the default): the primary gang *publishes* each version after its optimizer step (every rank keeps
its shards in the wire dtype: the current version and the one before it, the oldest a worker can still be sent —
the next optimizer step waits for the sync, so rollouters are never two versions behind), and a transfer is
one rendezvous with the live targets only, torn down when the sender is done. Ray carries the layout, the
rendezvous address and the version; the weights go worker to worker.

Failures (``bidirl.cluster.recovery``): a target that dies is marked gone at the rendezvous, so the sender stops
waiting for it (it loads the version when it is back, through a transfer of its own). A receiver whose transfer
broke off raises ``WeightTransferError``; its weights may be half the new version's, so the driver restarts it like
a lost process (:meth:`WeightSync.is_transfer_error`). When the primary gang dies, a transfer whose sender had not
begun is sent again by the restarted gang (which publishes the version it was restored to: its recovery point and
the steps since, replayed, :mod:`.trainer_recovery`); one it had begun is marked broken, and its receivers restart.
Every target, rollouter or auxiliary gang, waits for the restarted sender.

``transport.weights: object_store`` keeps the path from before the transport: rank 0 gathers the full state dict
into Ray's object store after each step and every target deserialises its own copy. It is the fallback for a
cluster whose workers cannot open TCP connections to each other (the transport's process groups need them), and
what the transport is measured against (``benchmarks/weight_sync.md``). A run whose rollouters use tensor
parallelism (ρ_r > 1: vLLM's workers are other processes, each of which would have to join the transfer with its
own part of every tensor) takes that path too, and its summary says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from bidirl.cluster.engines.workers import weight_transport as wt
from bidirl.core import protocol as P

PRIMARY_TRAINER = P.PRIMARY_TRAINER


@dataclass
class _Flight:
    transfer: wt.Transfer
    sent: bool = False           # the send is on the primary gang (its current incarnation)
    broken: bool = False         # its sender was lost after it began: the receivers give up


class WeightSync:
    """The weight path of one engine run (module docstring). ``driver``: the :class:`EngineDriver`; ``gpu()``: whether
    the engines run on GPUs (the wire dtype: bf16 there, fp32 on CPU)."""

    def __init__(self, driver, mode: str, bucket_mb: float, timeout_s: float, rollout: Callable):
        wt.check_settings(mode, bucket_mb, timeout_s)
        self.driver, self.configured = driver, mode
        self._mode = None
        self.fallback = None             # why a configured collective transport is not used
        self.bucket_bytes = max(1, int(round(bucket_mb * 2**20)))
        self.timeout_s = float(timeout_s)
        self._rollout = rollout
        self._layout = None
        self.rendezvous = None
        self.flights: dict = {}          # tid -> _Flight
        self.published: set = set()      # versions the primary gang holds for sending
        self.publishing = None           # the version a (re)started primary gang is publishing now
        self.reports: list = []          # rank 0's report of each completed transfer
        self.receivers: list = []        # each receiver's report (bytes, seconds)

    @property
    def mode(self) -> str:
        """The path this run takes (decided once the rollouters' settings are known, before any weight moves)."""
        if self._mode is None:
            self._mode = self.configured
            tp = int(getattr(self._rollout(), "tensor_parallel_size", 1))
            if self.configured == "collective" and tp > 1:
                self._mode = "object_store"
                self.fallback = (f"the rollouters run tensor-parallel over {tp} GPUs (their vLLM workers are other "
                                 "processes); the weight transport feeds an in-process worker only")
        return self._mode

    @property
    def collective(self) -> bool:
        return self.mode == "collective"

    @property
    def dtype(self) -> str:
        """The wire dtype: the rollouters' own (bf16 on GPU, fp32 on CPU)."""
        return str(self._rollout().dtype)

    def layout(self) -> wt.BucketLayout:
        if self._layout is None:
            self._layout = wt.model_layout(self.driver.model_dir, self.dtype, self.bucket_bytes)
        return self._layout

    # ------------------------------------------------------------------------------------------
    # published versions on the primary gang
    # ------------------------------------------------------------------------------------------
    def snapshot_spec(self):
        """What the primary ranks' ``snapshot`` publishes (``None`` on the object-store path): the new version in
        the wire dtype, keeping the one the trainer held before (rollouters may still be sent it)."""
        if not self.collective:
            return None
        before = self.driver.versions.get(PRIMARY_TRAINER)
        return {"dtype": self.dtype, "keep": [before] if before in self.published else []}

    def kept(self, version: int, before) -> None:
        """The primary gang's snapshot of ``version`` is safe: it published it and kept ``before``, the version it
        held until then, if that was published."""
        if self.collective:
            self.published = {int(version)} | ({before} & self.published)

    def publish(self, handles: list, version: int) -> None:
        """A (re)started primary gang publishes the version it holds (``handles``: its ranks); once it has, what
        waited for it is sent (sends run beside the gang's other calls, so they must wait for the publish)."""
        if not self.collective:
            return
        version = int(version)
        self.published, self.publishing = set(), version

        def done(_replies):
            self.published, self.publishing = {version}, None
            for tid, flight in list(self.flights.items()):
                if flight.sent or flight.broken:
                    continue
                if flight.transfer.version in self.published and PRIMARY_TRAINER not in self.driver.failed:
                    self._send(tid)
                else:                   # the version died with the gang: the receivers give up (and restart)
                    self._break(tid)
        self.driver._when_all([(PRIMARY_TRAINER, r.publish.remote(version, self.dtype, [])) for r in handles], done)

    # ------------------------------------------------------------------------------------------
    # transfers
    # ------------------------------------------------------------------------------------------
    def loads(self, targets: list, version: int) -> list:
        """``(worker, ref)`` receive calls that bring ``targets`` (rollouters, or a gang: each of its ranks) to
        ``version``, and the send on the primary gang (submitted now, or when a restarted gang is back)."""
        from bidirl.cluster.pool import ClusterError

        d = self.driver
        if PRIMARY_TRAINER in targets:
            raise ClusterError(f"the primary trainer would need actor version {version} sent to it, but it holds "
                               f"{d.versions.get(PRIMARY_TRAINER)}: it is the sender, and a restarted primary gang "
                               "gets its state from its recovery point and replays the steps since")
        if version not in self.published and version != self.publishing:
            raise ClusterError(f"actor version {version} must be sent to {sorted(targets)} but the primary trainer "
                               f"holds only {sorted(self.published)} for sending (it keeps the current version and "
                               "the one before; a primary trainer restarted between its optimizer step and the sync "
                               "holds only the version it was restored to) — set transport.weights: object_store to keep every "
                               "version in Ray's object store instead")
        calls = []
        members = []
        for w in targets:
            if w in d.gangs:
                members += [(w, f"{w}/{j}", r) for j, r in enumerate(d.gangs[w])]
            else:
                members.append((w, w, d.actors[w]))
        if self.rendezvous is None:
            self.rendezvous = wt.Rendezvous()
        self._prune()
        transfer = self.rendezvous.open([name for _, name, _ in members], version, self.layout(), self.timeout_s)
        calls += [(w, actor.receive_weights.remote(transfer, rank))
                  for rank, (w, _, actor) in enumerate(members, start=1)]
        self.flights[transfer.tid] = _Flight(transfer)
        if PRIMARY_TRAINER not in d.failed and version in self.published:
            self._send(transfer.tid)     # else when the restarted gang has published (publish)
        return calls

    def _send(self, tid: str) -> None:
        d = self.driver
        flight = self.flights[tid]
        flight.sent = True
        ranks = d.gangs[PRIMARY_TRAINER]
        d._when_all([(PRIMARY_TRAINER, r.send_weights.remote(flight.transfer)) for r in ranks],
                    lambda replies: self._sent(tid, replies), tolerate=True)

    def _sent(self, tid: str, replies: list) -> None:
        if not replies or replies[0] is None:
            return                      # the gang was lost: member_lost() resent or broke the transfer
        flight = self.flights.pop(tid, None)
        if flight is not None:
            self.rendezvous.close(tid)
        self.reports.append(replies[0].value)

    def received(self, replies) -> None:
        """Keep the receivers' reports (bytes and seconds per target) of completed receive calls."""
        for r in replies:
            if r is not None and isinstance(r.value, dict) and "bytes" in r.value:
                self.receivers.append(r.value)

    def _break(self, tid: str) -> None:
        flight = self.flights.get(tid)
        if flight is not None and not flight.broken:
            flight.broken = True
            self.rendezvous.gone(tid, 0)

    def member_lost(self, worker: str) -> None:
        """``worker``'s process is gone: its peers in transfers stop waiting for it (module docstring)."""
        if self.rendezvous is None:
            return
        for tid, flight in list(self.flights.items()):
            if flight.broken:
                continue
            if worker == PRIMARY_TRAINER and flight.sent:
                if self.rendezvous.started(tid):
                    self._break(tid)
                else:
                    flight.sent = False          # the restarted gang sends it (publish)
            for rank, name in enumerate(flight.transfer.receivers, start=1):
                if name == worker or name.rsplit("/", 1)[0] == worker:
                    self.rendezvous.gone(tid, rank)

    def _prune(self) -> None:
        """Forget broken transfers whose members have all given up (their rendezvous is closed past the timeout)."""
        self.rendezvous.close_stale()
        open_now = set(self.rendezvous.open_transfers)
        for tid in [t for t in self.flights if t not in open_now]:
            del self.flights[tid]

    @staticmethod
    def is_transfer_error(exc: Exception) -> bool:
        """Whether a failed call is a receiver whose transfer broke off (restart it: its weights are half-loaded)."""
        cause = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
        return isinstance(exc, wt.WeightTransferError) or isinstance(cause, wt.WeightTransferError)

    def shutdown(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close_all()
        self.flights.clear()

    def summary(self, seconds) -> dict:
        """``summary()["weight_transport"]``: the path, its settings and what moved."""
        import numpy as np
        out = {"transport": self.mode, "sync_seconds": seconds}
        if self.fallback is not None:
            out["fallback"] = self.fallback
        if not self.collective:
            return out
        layout = self._layout
        sent = [r for r in self.reports]
        out.update(dtype=self.dtype, bucket_mb=self.bucket_bytes / 2**20,
                   buckets=len(layout.buckets) if layout is not None else None,
                   bytes_per_receiver=layout.nbytes if layout is not None else None,
                   transfers=len(sent), receivers=sum(r["receivers"] for r in sent),
                   dropped=sum(len(r.get("failed", {})) for r in sent),
                   send_seconds=float(np.median([r["seconds"] for r in sent])) if sent else None,
                   receive_seconds=(float(np.median([r["seconds"] for r in self.receivers]))
                                    if self.receivers else None))
        return out
