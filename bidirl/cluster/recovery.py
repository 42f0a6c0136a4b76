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

**Deaths and errors** (issue 38). Only a death is recovered: Ray reports a lost process as ``RayActorError``
(``ActorDiedError``) and an exception the worker's own code raised, its process alive, as ``RayTaskError``.
:func:`failure_kind` tells them apart, with one exception on the error side: a trainer rank whose collective broke
because a peer died raises from ``torch.distributed`` (NCCL: ``DistBackendError`` / ``DistNetworkError``; gloo: a
``RuntimeError`` from its TCP transport, "Connection closed by peer" when the peer's process exits, measured here
with torch 2.8) — a consequence of a death, recovered as one. Any other exception is the engine's own error: a
restart would replay the same inputs into the same code and raise again, three times, before the restart bound
ended the run and made a bug look like flaky hardware; instead the run stops at once with a
:class:`~bidirl.cluster.pool.WorkerError`
that names the worker, the call and the worker's traceback. No call is retried on an error: none is retryable
by design (a weight transfer that broke off because its peer died is a death's consequence: its receiver is
restarted, :meth:`bidirl.cluster.engines.weight_sync.WeightSync.is_transfer_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


#: the kinds :func:`failure_kind` returns
DEATH, PEER_LOST, ERROR = "death", "peer-lost", "error"
#: exception class names torch.distributed raises when a collective's peer is gone (torch >= 2.1: c10d's errors)
COLLECTIVE_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
#: where a gloo collective's own transport errors come from (its message names the source file): a peer that
#: exited ("Connection closed by peer"), reset its connection, or went silent past the timeout
GLOO_TRANSPORT = "gloo/transport/"


def _cause(exc: BaseException) -> BaseException:
    return getattr(exc, "cause", None) or getattr(exc, "__cause__", None) or exc


def failure_kind(exc: BaseException) -> str:
    """:data:`DEATH` (the worker's process is lost), :data:`PEER_LOST` (a collective of the worker broke because a
    peer's process is lost) or :data:`ERROR` (the worker's own code raised): module docstring."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        return DEATH
    cause = _cause(exc)
    names = {k.__name__ for k in type(cause).__mro__}
    text = f"{cause}\n{exc}"
    if names & set(COLLECTIVE_ERRORS) or GLOO_TRANSPORT in text:
        return PEER_LOST
    return ERROR


def call_name(exc: BaseException) -> str:
    """The actor method a failed call ran: ``RayTaskError.function_name``, or — on the exception ``ray.get`` raises,
    an instance of both ``RayTaskError`` and the cause's class, which keeps only the cause's attributes — the
    worker's process title at the head of its message (``ray::TrainerActor.chunk_gradient()``); else the cause's
    type."""
    import re

    name = exc.__dict__.get("function_name") if hasattr(exc, "__dict__") else None
    if name:
        return str(name)
    found = re.search(r"ray::([\w.]+)\(", str(exc))
    return found.group(1) if found else type(_cause(exc)).__name__

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


def root_cause(exc: Exception) -> str:
    """The innermost error message of a failed actor construction or call (one line)."""
    cause = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
    text = str(cause if cause is not None else exc)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln
    return lines[-1] if lines else type(exc).__name__
