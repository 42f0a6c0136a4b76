"""A trainer gang's rendezvous (``TrainerEngine.listen`` / ``init_process_group``; ``TrainerActor.address`` on rank
0): rank 0 opens a store listening on a port the OS picked as it bound and holds it until the gang has joined
through it, so nothing else on the node can take the port between the moment it is named and the ranks' joining —
as anything could when a port was picked by binding and releasing a socket and bound again by rank 0's ``tcp://``
rendezvous later. Two ranks over gloo, each in a process of its own.
"""

from __future__ import annotations

import errno
import multiprocessing
import socket

import pytest

HOST = "127.0.0.1"
#: seconds a step of the test waits for a rank: two tiny-model engines starting on a loaded 2-core machine
WAIT_S = 300


def _assert_taken(port: int) -> None:
    """Binding ``port`` here fails: something (the gang's store) listens on it."""
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("", port))
    assert taken.value.errno == errno.EADDRINUSE


def _get(queue, procs):
    """The next item of ``queue``, failing at once when a rank's process has died meanwhile."""
    import queue as queues
    import time
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank's process failed (exit codes {[p.exitcode for p in procs]})"
    raise AssertionError(f"no rank reported within {WAIT_S} s")


def _rank(rank, model_dir, named, handed, join, leave, results):
    """One rank: rank 0 opens the rendezvous and names its address to the test (``named``), which hands it to
    rank 1 (``handed``); each joins when its ``join`` event is set, reports, and leaves when ``leave`` is."""
    import torch
    import torch.distributed as dist

    from bidirl.cluster.engines.workers.trainer import TrainerEngine

    engine = TrainerEngine(model_dir, lr=1e-3, seed=0, threads=1, gang=True)
    if rank == 0:
        addr = engine.listen(HOST)
        named.put(addr)
    else:
        addr = handed.get(timeout=WAIT_S)
        try:
            engine.init_process_group(rank, 2, f"{HOST}:http")
        except ValueError as exc:
            results.put(("bad addr", str(exc)))
    assert join[rank].wait(WAIT_S)
    engine.init_process_group(rank, 2, addr)
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)
    joined = engine._rendezvous[1].get("bidirl-gang/2/joined/1") == b"1" if rank == 0 else None
    results.put((rank, float(x.item()), engine.sharded, joined))
    assert leave.wait(WAIT_S)
    engine.destroy_process_group()


def test_rank_zero_holds_the_rendezvous_port_it_names_until_the_gang_has_joined(model_dir):
    ctx = multiprocessing.get_context("spawn")
    named, handed, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    join, leave = (ctx.Event(), ctx.Event()), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, str(model_dir), named, handed, join, leave, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        addr = _get(named, procs)
        host, port = addr.rsplit(":", 1)
        assert host == HOST and int(port) > 0
        handed.put(addr)                                      # to rank 1
        assert _get(results, procs) == ("bad addr", "init_process_group: addr must be 'host:port', got "
                                                    f"'{HOST}:http'")
        _assert_taken(int(port))                              # named, nobody joined yet: held
        join[1].set()                                         # rank 1 joins and waits at the store for rank 0
        _assert_taken(int(port))
        join[0].set()                                         # rank 0 joins through its own store
        seen = sorted(_get(results, procs) for _ in range(2))
        # both ranks summed 1 + 2 over the gang, are sharded over it, and rank 1 joined through rank 0's store
        assert seen == [(0, 3.0, True, True), (1, 3.0, True, None)]
        _assert_taken(int(port))                              # the gang's store for as long as the gang lives
        leave.set()
        for p in procs:
            p.join(WAIT_S)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
