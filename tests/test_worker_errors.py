"""Engine exceptions are errors, not deaths (issue 38; ``bidirl.cluster.recovery.failure_kind``).

A lost process (Ray's ``RayActorError``) and a rank whose collective broke because its peer's process was lost are
recovered; any other exception a worker raised stops the run with a ``WorkerError`` naming the worker, the call
and its traceback — a restart would replay the same inputs into the same code and raise again.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from bidirl.cluster import recovery
from bidirl.cluster.errors import WorkerError
from bidirl.job import config as cfgmod

from gang_rendezvous import join_gang, listening_store


def _rank(rank: int, addr: str, out) -> None:
    import time

    import torch
    import torch.distributed as dist
    join_gang(rank, 2, addr)
    t = torch.ones(16)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(1)                                   # the peer's process is lost between two collectives
    time.sleep(0.5)
    try:
        dist.all_reduce(t)
        out.put(None)
    except Exception as exc:                          # what the surviving rank's call raises
        out.put(exc)


@pytest.fixture(scope="module")
def broken_collective():
    """The exception a gloo rank gets from a collective whose peer's process exited (a real one, not a copy)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with listening_store() as addr:
        procs = [ctx.Process(target=_rank, args=(r, addr, out)) for r in range(2)]
        for p in procs:
            p.start()
        exc = out.get(timeout=120)
        for p in procs:
            p.join(60)
    assert exc is not None, "the collective did not break when its peer exited"
    return exc


def _task_error(cause: BaseException, call: str = "TrainerActor.chunk_gradient"):
    from ray.exceptions import RayTaskError
    return RayTaskError(call, f"Traceback (most recent call last):\n  ...\n{type(cause).__name__}: {cause}", cause,
                        proctitle=f"ray::{call}()")


def test_a_lost_process_is_a_death():
    from ray.exceptions import ActorDiedError, RayActorError
    assert recovery.failure_kind(RayActorError()) == recovery.DEATH
    assert recovery.failure_kind(ActorDiedError()) == recovery.DEATH


def test_a_collective_broken_by_a_lost_peer_is_the_deaths_consequence(broken_collective):
    assert recovery.failure_kind(_task_error(broken_collective)) == recovery.PEER_LOST


def test_an_engines_own_exception_is_an_error():
    err = _task_error(ValueError("chunk_gradients: old_logprobs[0] has 3 values for a response of 4 tokens"))
    assert recovery.failure_kind(err) == recovery.ERROR
    assert recovery.call_name(err) == "TrainerActor.chunk_gradient"
    # what ray.get raises: an instance of both RayTaskError and the cause's class (the cause's attributes only)
    raised = err.as_instanceof_cause()
    assert isinstance(raised, ValueError)
    assert recovery.failure_kind(raised) == recovery.ERROR
    assert recovery.call_name(raised) == "TrainerActor.chunk_gradient"
    # an out-of-memory error of the engine's own is an error too: a restart would run out of memory again
    assert recovery.failure_kind(_task_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))) \
        == recovery.ERROR


class _Recorded(Exception):
    pass


@pytest.fixture
def driver(monkeypatch):
    """An emulated pool driver (no Ray started) whose restarts are recorded instead of run."""
    from bidirl.cluster.emulated import EmulatedDriver
    d = EmulatedDriver(cfgmod.load("tiny-cpu"), "bidirl", steps=1, seed=0)
    d.restarted = []
    monkeypatch.setattr(d, "_worker_failed", lambda worker, error: d.restarted.append((worker, error)))
    return d


def test_the_pool_driver_stops_on_an_error_and_names_the_worker_the_call_and_the_traceback(driver):
    from bidirl.core import protocol as P
    cause = ValueError("chunk_gradients: got 3 advantages for 4 samples")
    with pytest.raises(WorkerError) as info:
        driver._call_failed(P.PRIMARY_TRAINER, _task_error(cause))
    err = info.value
    assert (err.worker, err.call) == (P.PRIMARY_TRAINER, "TrainerActor.chunk_gradient")
    assert "got 3 advantages for 4 samples" in err.error and "Traceback" in err.traceback
    assert str(err).startswith(f"worker {P.PRIMARY_TRAINER} raised in TrainerActor.chunk_gradient: ")
    assert driver.restarted == [], "an error is not recovered as a death"


def test_the_pool_driver_recovers_deaths_and_their_consequences(driver, broken_collective):
    from ray.exceptions import ActorDiedError

    from bidirl.core import protocol as P
    driver._call_failed(P.PRIMARY_TRAINER, ActorDiedError())
    driver._call_failed(P.AUX_TRAINER, _task_error(broken_collective))
    assert [w for w, _ in driver.restarted] == [P.PRIMARY_TRAINER, P.AUX_TRAINER]
    assert driver.restarted[1][1].startswith("a peer was lost: ")
