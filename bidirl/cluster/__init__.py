"""The Ray runtime (DESIGN.md: the ``cluster`` driver) and its workers.

Names are imported on first use so that ``import bidirl.cluster`` stays cheap (no Ray, vLLM or torch):

* ``run``, ``PoolDriver``, ``RayDriver`` (emulated workers), ``RunResult``, ``ClusterError`` — the Ray driver
  (``bidirl.cluster.driver``); ``EngineDriver``, ``run_engines`` — the same with real engine workers;
* ``RolloutEngine``, ``GroupRequest``, ``request_seed`` — the vLLM rollout engine;
* ``TrainerEngine``, ``ChunkGradient`` — the torch trainer engine;
* ``RolloutActor``, ``TrainerActor``, ``Reply`` — their Ray actor wrappers.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "run": "bidirl.cluster.driver",
    "RayDriver": "bidirl.cluster.driver",
    "PoolDriver": "bidirl.cluster.driver",
    "EngineDriver": "bidirl.cluster.engine_driver",
    "run_engines": "bidirl.cluster.engine_driver",
    "RunResult": "bidirl.cluster.driver",
    "ClusterError": "bidirl.cluster.driver",
    "RolloutEngine": "bidirl.cluster.rollout_engine",
    "GroupRequest": "bidirl.cluster.rollout_engine",
    "request_seed": "bidirl.cluster.rollout_engine",
    "TrainerEngine": "bidirl.cluster.trainer_engine",
    "ChunkGradient": "bidirl.cluster.trainer_engine",
    "RolloutActor": "bidirl.cluster.actors",
    "TrainerActor": "bidirl.cluster.actors",
    "Reply": "bidirl.cluster.actors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bidirl.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
