"""Worker restarts: the bound on them, and which calls belong to a worker's current process.

When a worker of a Ray run dies — a rollouter, or any rank of a trainer gang (a gang is one worker: its ranks
share collectives, so they fail and restart together) — the driver gives its remaining actors up, starts fresh
ones on the same placement-group bundles, brings them to the state the worker serves (weights, and for the
primary trainer the optimizer state) and tells the coordinator, which re-dispatches the lost work
(``WorkerFailed`` / ``WorkerRestarted``, ``docs/architecture.md`` "Failures"). Fresh actors rather than Ray's
``max_restarts``: a gang must restart as a unit and rendezvous again, and an actor killed by ``ray.kill`` or
lost with its node is not restarted by Ray; one path covers all of them.

:class:`Restarts` keeps the bound — a worker may be restarted ``max_restarts`` times in a row (default
:data:`MAX_RESTARTS`), a row being failures with no whole training step completed between them; its next
failure ends the run with a :class:`~bidirl.cluster.pool.ClusterError` naming the worker, its failures and the
last error. Once a whole step has run since a worker's last restart its count starts over: a run of days may
lose the same worker to unrelated causes (a node lost, a pre-emption) many times and goes on while it makes
progress, whereas a worker that dies again before a step completes most likely has a deterministic error, and
each restart costs an engine start. Three restarts in a row ride out a flaky node or a failure during recovery
itself (the fresh process dies while loading its state) and stop a crash loop after at most three engine starts.
:class:`Restarts` also keeps each worker's *incarnation*: calls sent to an earlier process of a worker are void
once it failed (their results are dropped), so nothing it reported after its death reaches the coordinator twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: restarts allowed per worker in a row (no whole step completed between its failures): the fourth ends the run
MAX_RESTARTS = 3


@dataclass
class Restarts:
    """Restart bookkeeping of one run: counts, incarnations and the record of every recovery."""
    limit: int = MAX_RESTARTS
    counts: dict = field(default_factory=dict)          # worker -> restarts in a row so far
    last_step: dict = field(default_factory=dict)       # worker -> steps done when it last failed
    incarnations: dict = field(default_factory=dict)    # worker -> its current process's number (0: the first)
    record: list = field(default_factory=list)          # one dict per failure: worker, t, error, restart

    def __post_init__(self):
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"max_restarts must be an integer ≥ 0 (restarts allowed per worker), got {self.limit!r}")

    def incarnation(self, worker: str) -> int:
        return self.incarnations.get(worker, 0)

    def _settle(self, worker: str, steps_done: int) -> None:
        """Start ``worker``'s count over if a whole step ran since its last failure (during step ``last``)."""
        if worker in self.last_step and steps_done >= self.last_step[worker] + 2:
            self.counts[worker] = 0

    def exhausted(self, worker: str, steps_done: int) -> bool:
        """Whether ``worker``, failing now (``steps_done`` steps done), has used up its restarts in a row."""
        self._settle(worker, steps_done)
        return self.counts.get(worker, 0) >= self.limit

    def message(self, worker: str, error: str) -> str:
        n = self.counts.get(worker, 0)
        return (f"worker {worker} failed {n + 1} times: it was restarted {n} times, the limit (max_restarts="
                f"{self.limit}), with no whole step completed between its failures, so the run stops. Last error: "
                f"{error}. Check the worker's logs (ray logs) and the node's memory; a worker that fails at once "
                "after each restart usually has a deterministic error")

    def begin(self, worker: str, t: float, error: str, steps_done: int = 0) -> int:
        """Count a failure of ``worker``'s current process (``steps_done`` steps done) and start its next
        incarnation; returns it."""
        self._settle(worker, steps_done)
        self.last_step[worker] = int(steps_done)
        self.counts[worker] = self.counts.get(worker, 0) + 1
        self.incarnations[worker] = self.incarnation(worker) + 1
        self.record.append({"worker": worker, "t": float(t), "error": error, "restart": self.counts[worker]})
        return self.incarnations[worker]
