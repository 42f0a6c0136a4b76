"""The one interface a kind of Ray worker plugs into the pool driver through (composition, issue 38).

:class:`~bidirl.cluster.pool.PoolDriver` owns everything Ray runs share — start-up, the placement group, the calls
in flight and the ``ray.wait`` loop, failures and restarts, the chunk queue, checkpoints, the output folder — and
holds one :class:`WorkerBackend`, which it calls for what differs between a kind of worker and another: emulated,
model-timed workers (:class:`bidirl.cluster.emulated.EmulatedBackend`) or real engines
(:class:`bidirl.cluster.engines.backend.EngineBackend`). The pool driver never asks a backend for anything else,
and a backend reaches the pool driver's services (``feed``, ``span`` and ``record_*``, ``_submit`` / ``_when_all``,
``_measure``, ``now``, the actors it placed) through the ``pool`` it was given.

The interface, in three parts:

* **the workers' life** — :meth:`~WorkerBackend.place` every worker once, and for a worker whose process was lost
  :meth:`~WorkerBackend.discard` what is left of it, :meth:`~WorkerBackend.spawn` a fresh one on the same
  bundles and :meth:`~WorkerBackend.restore` it to the state it serves (§3.2; ``docs/architecture.md``
  "Failures");
* **work started and stopped** — a rollouter's :meth:`~WorkerBackend.generate` / :meth:`~WorkerBackend.interrupt`,
  a trainer gang's :meth:`~WorkerBackend.run_chunk` (the pool driver queues chunks and calls
  :meth:`~bidirl.cluster.pool.PoolDriver._chunk_done` when the backend reports one ran);
* **state moved** — a pool's hot :meth:`~WorkerBackend.switch` (§3.2), a :meth:`~WorkerBackend.sync_weights`,
  the :meth:`~WorkerBackend.merge_gradients` of the auxiliary windows, the
  :meth:`~WorkerBackend.optimizer_step` that makes the next version (§6) and the
  :meth:`~WorkerBackend.refresh_weights` of an auxiliary trainer gang after an optimizer step that kept the version
  (an optimizer mini-batch's; :mod:`bidirl.core.aux_weights`).

Each of these answers its command with the matching protocol event (``feed``), as the paper's Table 2 has it.
The hooks below them have defaults that do nothing (what emulated workers need): what a run adds around its
workers (its start, a step's data, its summary and end), how a lost process is told apart, and what a checkpoint
and the kept workers must match.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from bidirl.core import protocol as P


def is_stream(call) -> bool:
    """Whether a backend's Ray call is a stream (a Ray ``ObjectRefGenerator``: a streaming actor method, handed to
    :meth:`~bidirl.cluster.pool.PoolDriver._submit_stream`) rather than one object ref (``_submit``)."""
    import ray
    return isinstance(call, ray.ObjectRefGenerator)


class WorkerBackend(ABC):
    """What one kind of worker does under the pool driver (module doc). ``pool``: the
    :class:`~bidirl.cluster.pool.PoolDriver` it is plugged into."""

    #: virtual seconds per wall second of the run's clock (emulated workers run faster than the wall clock)
    time_scale: float = 1.0
    #: whether its workers run on real GPUs when the cluster offers enough of them (else logical ``gpu_slot`` units)
    uses_gpus: bool = False

    def __init__(self, pool):
        self.pool = pool

    # ---- the workers' life --------------------------------------------------------------------
    @abstractmethod
    def place(self) -> None:
        """Start every worker on its bundles (or take the kept ones) and wait until they are ready; in a resumed run,
        load the checkpoint's worker state too."""

    @abstractmethod
    def spawn(self, worker: str) -> None:
        """Start ``worker``'s actor(s) afresh on its bundle(s), after its process was lost."""

    @abstractmethod
    def discard(self, worker: str) -> None:
        """Give up what is left of a lost worker's actor(s) (a gang's other ranks would hang in collectives)."""

    @abstractmethod
    def restore(self, worker: str, then: Callable[[], None]) -> None:
        """Bring a freshly spawned ``worker`` to the state it serves (calls through ``pool._submit``), then call
        ``then``; a call that fails instead counts as the worker's next failure."""

    # ---- work started and stopped -------------------------------------------------------------
    @abstractmethod
    def generate(self, cmd: P.Generate) -> None:
        """Start ``cmd``'s groups on its rollouter and keep it reporting (``GroupFinished``) while it is busy."""

    @abstractmethod
    def interrupt(self, cmd: P.Interrupt) -> None:
        """Stop groups on a rollouter (``GenerationStopped``, with their states)."""

    @abstractmethod
    def run_chunk(self, cmd: P.RunChunk) -> None:
        """Run the chunk on its gang; call ``pool._chunk_done(cmd, start, end)`` when it has run."""

    # ---- state moved --------------------------------------------------------------------------
    @abstractmethod
    def switch(self, cmd: P.Switch) -> None:
        """Offload the pool's passive role, onload the active one (``SwitchFinished``)."""

    @abstractmethod
    def sync_weights(self, cmd: P.SyncWeights) -> None:
        """Bring the targets to the command's version (``SyncFinished``)."""

    @abstractmethod
    def merge_gradients(self, cmd: P.MergeGradients) -> None:
        """Hand the auxiliary windows' gradients to the primary gang (``GradientsMerged``)."""

    @abstractmethod
    def optimizer_step(self, cmd: P.OptimizerStep) -> None:
        """Take the step's optimizer step on the primary gang (``OptimizerStepped``)."""

    @abstractmethod
    def refresh_weights(self, cmd: P.RefreshWeights) -> None:
        """Bring the auxiliary trainer gang ``cmd.worker`` to the primary gang's current weights, ``cmd.updates``
        optimizer steps past ``cmd.version`` (``WeightsRefreshed``; when the coordinator sends it:
        :mod:`bidirl.core.aux_weights`)."""

    # ---- hooks (defaults: nothing to add) -----------------------------------------------------
    def begin(self) -> None:
        """After placement, right before ``Started`` (or the resumed boundary)."""

    def start_step(self, cmd: P.StartStep) -> None:
        """A step starts (its groups are the step's samples)."""

    def worker_failed(self, worker: str, error: str, fail: Callable[[str, str], None]) -> None:
        """``worker``'s process was lost: ``fail(w, error)`` recovers a worker ``w``; workers that shared the
        process are lost with it (emulated rollout hosts)."""
        fail(worker, error)

    def restarted(self, worker: str) -> None:
        """``worker`` is back (``WorkerRestarted`` was fed)."""

    def is_death(self, exc: Exception) -> bool:
        """Whether a call that raised in a living process is recovered as a death all the same (a weight transfer
        that broke off leaves its receiver half-loaded)."""
        return False

    def shape(self) -> dict:
        """What kept workers must have been started with to serve this run, besides the layout."""
        return {}

    def identity(self) -> dict:
        """The model and the data a checkpoint of this run records (``RunIdentity``'s ``model`` / ``data``)."""
        return {"model": {"name": self.pool.config.model}, "data": {}}

    def save_trainer_state(self, folder: Path) -> bool:
        """Write the trainer's state into a checkpoint's ``folder``; False if the workers hold none."""
        return False

    def summarize(self, out: dict) -> None:
        """Add the backend's own keys to the run summary ``out``."""

    def run_state(self) -> dict:
        """The backend's own per-run state a checkpoint keeps beside the pool driver's (JSON-able)."""
        return {}

    def take_run_state(self, state: dict) -> None:
        """Take back what :meth:`run_state` returned (a resumed run; ``{}`` from a checkpoint without any)."""

    def close(self) -> None:
        """The run ends (finished or failed), before the workers are stopped or kept."""
