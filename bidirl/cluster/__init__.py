"""The Ray runtime (``docs/architecture.md``): one placement group over the pools, a ``ray.wait`` loop.

Names are imported on first use so that ``import bidirl.cluster`` stays cheap (no Ray, vLLM or torch):

* ``run`` — a job on Ray (``bidirl.cluster.run``);
* ``PoolDriver`` — the Ray half every Ray driver shares (``bidirl.cluster.pool``), with one
  ``WorkerBackend`` plugged in for what its kind of worker does (``bidirl.cluster.backend``);
* ``ClusterError`` — the cluster cannot run the job (``bidirl.cluster.errors``);
* ``KeptWorkers`` — engine workers kept from run to run on one Ray, reset for each (``bidirl.cluster.kept_workers``);
* ``EmulatedDriver`` — model-timed workers (``bidirl.cluster.emulated``);
* ``EngineDriver`` — real engines (``bidirl.cluster.engines``: vLLM ``RolloutEngine``, torch ``TrainerEngine``,
  their Ray actors ``RolloutActor`` / ``TrainerActor``, position-keyed sampling).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "run": "bidirl.cluster.run",
    "PoolDriver": "bidirl.cluster.pool",
    "ClusterError": "bidirl.cluster.errors",
    "KeptWorkers": "bidirl.cluster.kept_workers",
    "WorkerBackend": "bidirl.cluster.backend",
    "EmulatedDriver": "bidirl.cluster.emulated",
    "EngineDriver": "bidirl.cluster.engines.driver",
    "RolloutEngine": "bidirl.cluster.engines.workers.rollout",
    "GroupRequest": "bidirl.cluster.engines.workers.rollout",
    "request_seed": "bidirl.cluster.engines.workers.rollout",
    "TrainerEngine": "bidirl.cluster.engines.workers.trainer",
    "ChunkGradient": "bidirl.cluster.engines.workers.trainer",
    "RolloutActor": "bidirl.cluster.engines.workers.actors",
    "TrainerActor": "bidirl.cluster.engines.workers.actors",
    "Reply": "bidirl.cluster.engines.workers.actors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bidirl.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
