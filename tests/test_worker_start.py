"""What a worker's start skips (``benchmarks/bench_worker_start.py`` measures what it saves): the garbage collector
paused while an actor starts, and no compilation on an eager rollout engine. Unit tests, no Ray cluster, no vLLM."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch


def test_the_collector_is_paused_for_a_start_and_restored_whatever_happens():
    from bidirl.cluster.engines.workers.actors import _collector_paused

    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
        gc.collect()                                    # an explicit collection (vLLM makes some) still runs
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="engine"):
        with _collector_paused():
            raise RuntimeError("the engine failed to start")
    assert gc.isenabled(), "a failed start left the collector off"
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled(), "a process that had the collector off must keep it off"
    finally:
        gc.enable()


def test_an_eager_rollout_engine_steps_without_compiling_and_leaves_compilation_on_elsewhere():
    from bidirl.cluster.engines.workers.rollout import RolloutEngine

    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    def rank_count(x, values):                      # the shape of vLLM's compiled rank count
        return (x >= values).sum(-1)

    def other_count(x, values):
        return (x > values).sum(-1)

    x, v = torch.arange(12.0).reshape(3, 4), torch.tensor([[1.0], [5.0], [20.0]])
    try:
        with RolloutEngine._eager_steps(SimpleNamespace(enforce_eager=True)):
            assert torch.compile(rank_count, backend=backend)(x, v).tolist() == [3, 3, 0]
        assert compiled == [], "an eager engine's step compiled"
        assert torch._dynamo.config.disable is False, "compilation stayed off after the engine's step"
        with RolloutEngine._eager_steps(SimpleNamespace(enforce_eager=False)):    # CUDA graphs: vLLM compiles
            assert torch.compile(other_count, backend=backend)(x, v).tolist() == [2, 2, 0]
        assert len(compiled) == 1
    finally:
        torch._dynamo.reset()
