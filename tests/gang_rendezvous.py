"""Race-free rendezvous for the process gangs tests spawn (torch.distributed over gloo, or NCCL on a GPU).

The rendezvous store listens in the test process on a port the OS picks as it binds (port 0), before any rank
starts, and stays bound until every rank is done (:func:`listening_store`); the ranks join it as clients
(:func:`join_gang`), with the store timeout ``tcp://`` rendezvous gives. No port is chosen before it is bound, so no
other process (an xdist worker running another gang) can take it in between — as it could when a port was picked
by binding and closing a socket and handed to the ranks, the first of which bound it again later: that rank then
failed with "address in use", or the others joined another test's gang. The engine driver opens its weight-transfer
stores the same way (``bidirl.cluster.engines.workers.weight_transport.Rendezvous``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

HOST = "127.0.0.1"


@contextlib.contextmanager
def listening_store() -> Iterator[str]:
    """A rendezvous store listening here, on a port the OS picked as it bound; yields its ``host:port`` and closes
    it on exit (the port is free again then)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)
    try:
        yield f"{HOST}:{store.port}"
    finally:
        del store


def join_gang(rank: int, world: int, addr: str, device=None) -> None:
    """Join the default process group through the store listening at ``addr`` (:func:`listening_store`), as a
    client of it: over gloo, or over NCCL bound to ``device`` when that is a CUDA device (its communicator formed
    now, as ``TrainerEngine.init_process_group`` forms it). An engine's ``init_process_group`` afterwards takes
    this group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=default_pg_timeout)
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            device_id=torch.device(device) if cuda else None)


def spawn_gang(fn: Callable, world: int, *args) -> None:
    """Run ``fn(rank, world, addr, *args)`` on ``world`` spawned ranks and wait for them all; ``addr`` is a store
    listening here for the whole run (:func:`listening_store`), which each rank joins (:func:`join_gang`)."""
    import torch.multiprocessing as mp

    with listening_store() as addr:
        mp.spawn(fn, args=(world, addr, *args), nprocs=world, join=True)
