"""The errors of a Ray run: the cluster cannot run the job (:class:`ClusterError`), or a worker's call raised an error
of its own (:class:`WorkerError`)."""

from __future__ import annotations

from bidirl.errors import BidirlError


class ClusterError(BidirlError, RuntimeError):
    """The cluster cannot run the job as configured (resources, worker start-up, a failed primary)."""


class WorkerError(ClusterError):
    """A worker's call raised an error of its own (its process lives): the run stops and says where and why."""

    fix = "fix the cause the traceback shows; a restart would replay the same inputs into the same code"

    def __init__(self, worker: str, call: str, error: str, traceback: str):
        self.worker, self.call, self.error, self.traceback = worker, call, error, traceback
        super().__init__(f"worker {worker} raised in {call}: {error} — the run stops (an error, not a lost "
                         f"process: a restart would raise it again).\n{traceback}")
