"""What a Ray run's driver does when a worker fails (docs/architecture.md "Failures"): a lost process, or a trainer
collective broken by a lost peer, is recovered — the worker's calls become void, the coordinator is told
(``WorkerFailed``), a fresh process is started and restored (``WorkerRestarted``) — up to the restart bound
(:class:`~bidirl.cluster.recovery.Restarts`); an error of the worker's own stops the run, naming it.

:class:`WorkerFailures` is a part of :class:`bidirl.cluster.pool.PoolDriver`, split out by concern: its methods
read and write the driver's state (declared there) and call its backend.
"""

from __future__ import annotations

from bidirl.cluster.errors import ClusterError, WorkerError
from bidirl.cluster.recovery import DEATH, ERROR, call_name, failure_kind, root_cause
from bidirl.core import protocol as P


class WorkerFailures:
    """Recover a failed worker, or stop the run on a worker's own error (methods of the driver; no state of their own)."""

    def _call_failed(self, worker: str, exc: Exception) -> None:
        """A call on ``worker``'s current process raised: a lost process, or a trainer collective broken by a lost
        peer, is recovered; an error of the worker's own (its process alive) stops the run with a
        :class:`WorkerError` naming the worker, the call and its traceback
        (:func:`bidirl.cluster.recovery.failure_kind`)."""
        if self.backend.is_death(exc):
            self._worker_failed(worker, root_cause(exc))
            return
        kind = failure_kind(exc)
        if kind == ERROR:
            raise WorkerError(worker, call_name(exc), root_cause(exc),
                              getattr(exc, "traceback_str", "") or str(exc)) from exc
        self._worker_failed(worker, root_cause(exc) if kind == DEATH else f"a peer was lost: {root_cause(exc)}")

    def _worker_failed(self, worker: str, error: str) -> None:
        """``worker``'s current process failed: it is recovered (:meth:`_recover`), with the workers that shared
        its process (``WorkerBackend.worker_failed``)."""
        self.backend.worker_failed(worker, error, self._recover)

    def _recover(self, worker: str, error: str) -> None:
        """Past the bound the run stops; otherwise ``worker``'s calls become void, the coordinator is told, and a
        fresh process is started and restored (``WorkerRestarted``)."""
        if self.restarts.exhausted(worker, self.steps_done):
            raise ClusterError(self.restarts.message(worker, error))
        self.restarts.begin(worker, self.now(), error, self.steps_done)
        self.backend.discard(worker)
        self.r_busy[worker] = self.r_advancing[worker] = False
        self.r_starts.pop(worker, None)           # a fresh process has applied none of them
        self.chunk_queue.pop(worker, None)
        self.chunk_running.pop(worker, None)
        if worker not in self.failed:
            self.failed.add(worker)
            self.feed(P.WorkerFailed(self.now(), worker, error))
        self.backend.spawn(worker)
        self.backend.restore(worker, lambda: self._restarted(worker))

    def _restarted(self, worker: str) -> None:
        self.failed.discard(worker)
        self.feed(P.WorkerRestarted(self.now(), worker))
        self.backend.restarted(worker)
