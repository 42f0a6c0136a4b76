"""Engine workers kept from run to run on one Ray (:class:`KeptWorkers`), so a short run does not spend most of its
time starting engines; the pool driver takes a kept set whose shape matches its job (``PoolDriver.worker_shape``)
and gives its workers back when it finishes (``PoolDriver.shutdown``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Workers:
    """A finished run's placement group and actors, as :class:`KeptWorkers` holds them for the next run of the
    same ``shape`` (:meth:`PoolDriver.worker_shape`) on the same Ray (``ray_job``). :meth:`release` ends them."""
    pg: object
    actors: dict
    gangs: dict
    shape: dict                   # what the next run must match (PoolDriver.worker_shape)
    ray_job: str = ""             # the Ray session they live in (a new ``ray.init`` ends them)

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        for actor in list(self.actors.values()) + [r for ranks in self.gangs.values() for r in ranks]:
            try:
                ray.kill(actor)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def ray_job() -> str:
    """The Ray session this process is connected to (empty when none)."""
    import ray
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""


@dataclass
class KeptWorkers:
    """Engine workers kept from run to run on one Ray, each reset to a fresh engine's state for the next run.

    Starting engines is most of a short run's time (vLLM and torch processes, the gangs' process groups). A notebook
    that runs jobs one after another, a side-by-side comparison of policies or a test session passes one
    ``KeptWorkers`` to every run (``run(..., kept_workers=kw)``, ``EngineDriver(..., kept_workers=kw)``): a run whose
    job needs the same workers (:meth:`PoolDriver.worker_shape`: layout, model, engine settings) takes them and
    resets each one (``reset``: the model folder's weights, a new optimizer, no groups, version 0, auxiliaries
    offloaded), other runs start their own; a run that finishes gives its workers back, one that fails ends them.
    At most ``capacity`` sets are held, the least recently used is ended first; sets of an earlier Ray session
    (after ``ray.shutdown``) are dropped. :meth:`release` ends them all (also at the end of a ``with`` block).
    ``started`` / ``reused`` count the runs that started workers and those that took kept ones."""
    capacity: int = 1
    sets: list = field(default_factory=list)        # Workers, least recently used first
    started: int = 0
    reused: int = 0

    def __post_init__(self):
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"KeptWorkers.capacity must be an integer ≥ 1 (sets of workers held), "
                             f"got {self.capacity!r}")

    def take(self, shape: dict) -> Optional[Workers]:
        """The kept set started for ``shape`` in the current Ray session (removed from the cache), or ``None``."""
        job = ray_job()
        self.sets = [w for w in self.sets if w.ray_job == job]
        for i, workers in enumerate(self.sets):
            if workers.shape == shape:
                self.reused += 1
                return self.sets.pop(i)
        self.started += 1
        return None

    def give(self, workers: Workers) -> None:
        """Keep a finished run's workers; end the least recently used set beyond ``capacity``."""
        self.sets.append(workers)
        while len(self.sets) > self.capacity:
            self.sets.pop(0).release()

    def release(self) -> None:
        """End every kept worker."""
        while self.sets:
            self.sets.pop().release()

    def __enter__(self) -> "KeptWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
