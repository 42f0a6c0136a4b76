"""One launch order per rank for a gang's collectives on two threads (paper §5, §6.2; issue #38's NCCL item).

A trainer rank launches collectives from two threads: the chunk's (FSDP2's all-gathers and reduce-scatters, the
normaliser and norm all-reduces) on the main thread, over the gang's mesh, and the weight transport's (the
transfer check, the live-receiver broadcast and every bucket's all-gather, :meth:`TrainerEngine.send_weights`) on
the actor's ``transport`` thread, over the gang's second group. NCCL documents that operations on two
communicators may deadlock unless every rank launches them in the same order (a rank's kernel of one
communicator can wait on a peer whose GPU is busy with a kernel of the other that waits in turn; NCCL User Guide,
"Using multiple NCCL communicators concurrently"). Gloo tolerates any order, so nothing fails on CPU when the
order differs — but the order is the same logic on both backends, which is what the tests check on gloo.

The order: launches happen in *turns*. A turn is either ``main`` (the chunk's thread, from the start of a gang
call or a yield point — each transformer block's forward — to the next yield point or the end of the call) or
``transport`` (one collective of a transfer: its check, its broadcast, one bucket's gather). Rank 0 leads: it
grants turns in the order its two threads ask for them (first come, first served; a thread that yields goes
behind one that waits) and appends each turn's kind to a log in the gang's rendezvous store (host-side TCP, no
GPU kernel: it cannot take part in the hazard). Every other rank follows: a thread takes its turn only when the
log's next entry names its kind. So every rank launches every collective in the leader's order, and the send
still overlaps the chunk — a bucket's gather slips in between two blocks, and rank 0's point-to-point sends to
the receivers (pair groups of their own, never waiting on a gang peer) run beside the chunk with no turn at all.

Why no rank waits forever: a turn holds no collective open across another turn's wait (each turn's launches are
complete, on gloo, or enqueued, on NCCL, when it ends), the leader only logs a turn it is taking, and every rank
runs the same calls (the driver sends each gang call and each transfer to every rank), so a follower that waits
on an entry waits for a call that reaches it. The yield points are the same on every rank (the same blocks run
on every rank, an empty share included), so the logs agree entry for entry.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

import torch

MAIN, TRANSPORT = "main", "transport"
KINDS = (MAIN, TRANSPORT)


class LaunchOrderError(RuntimeError):
    """A follower found an entry that is no kind of turn in the log."""


class LaunchOrder:
    """The turns of one rank of a ``world``-rank gang (module docstring). ``store``: a ``torch.distributed.Store``
    every rank of the gang shares, under a prefix of this gang's own; ``rank`` 0 leads. A follower waits for the
    next entry as long as the store's timeout (the process group's), then raises the store's error."""

    def __init__(self, store, rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"LaunchOrder: rank must be in [0, world), got rank={rank}, world={world}")
        self.store, self.rank, self.world = store, int(rank), int(world)
        self._cond = threading.Condition()
        self._busy: Optional[str] = None          # the kind holding the turn now
        self._depth = 0                           # nested main turns (a gang call inside another)
        self._next = 0                            # leader: the next log index; follower: the next entry to take
        self._waiting = {MAIN: 0, TRANSPORT: 0}   # leader: threads waiting per kind (a yield lets them go first)
        self._known: dict = {}                    # follower: entries fetched and not taken yet
        self._fetching = False                    # follower: a thread waits on the store for the next entry
        self.log: list = []                       # the kinds this rank took, in order (tests and benchmarks)

    # ---- leader -------------------------------------------------------------------------------
    def _lead(self, kind: str, behind_waiters: bool) -> None:
        other = TRANSPORT if kind == MAIN else MAIN
        self._waiting[kind] += 1
        try:
            while self._busy is not None or (behind_waiters and self._waiting[other]):
                self._cond.wait()
                behind_waiters = False             # once woken, first come first served
        finally:
            self._waiting[kind] -= 1
        self.store.set(f"turn/{self._next}", kind)
        self._next += 1

    # ---- follower -----------------------------------------------------------------------------
    def _fetch(self, index: int) -> str:
        """Entry ``index`` of the log, waiting for the leader to write it (one blocking ``get``: the store answers
        when the key is set). Called without the lock, by one waiting thread at a time."""
        # the store's own error propagates as it is (c10d's DistStoreError / DistNetworkError): a leader whose
        # process is gone takes the store with it, and the pool recovers that as a peer's death, as it does a
        # collective that broke (bidirl.cluster.recovery.failure_kind); a leader alive that logs nothing for the
        # store's timeout is the same as a collective it never joins
        entry = self.store.get(f"turn/{index}").decode()
        if entry not in KINDS:
            raise LaunchOrderError(f"launch order: entry {index} is {entry!r}, not one of {KINDS}")
        return entry

    def _follow(self, kind: str) -> None:
        while True:
            if self._busy is None:
                entry = self._known.get(self._next)
                if entry is None and not self._fetching:
                    index, self._fetching = self._next, True
                    self._cond.release()
                    try:
                        entry = self._fetch(index)
                    finally:
                        self._cond.acquire()
                        self._fetching = False
                        self._cond.notify_all()
                    self._known[index] = entry
                if entry == kind:
                    del self._known[self._next]
                    self._done(self._next)
                    self._next += 1
                    return
            self._cond.wait()

    def _done(self, index: int) -> None:
        """The last follower to take entry ``index`` deletes it: the log holds only entries some rank still needs
        (a gang of two has one follower: no count)."""
        if self.world == 2:
            self.store.delete_key(f"turn/{index}")
        elif self.store.add(f"taken/{index}", 1) == self.world - 1:
            self.store.delete_key(f"turn/{index}")
            self.store.delete_key(f"taken/{index}")

    # ---- both ---------------------------------------------------------------------------------
    def _acquire(self, kind: str, behind_waiters: bool = False) -> None:
        with self._cond:
            if kind == MAIN and self._busy == MAIN:
                self._depth += 1                   # a gang call inside another: the main turn it holds goes on
                return
            if self.rank == 0:
                self._lead(kind, behind_waiters)
            else:
                self._follow(kind)
            self._busy, self._depth = kind, 1
            self.log.append(kind)

    def _release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._busy = None
                self._cond.notify_all()

    @contextmanager
    def turn(self, kind: str):
        """Hold a turn of ``kind`` while the block launches its collectives. A ``main`` turn is the main side's:
        re-entrant (a gang call inside another), and a yield point may come from the autograd thread that runs
        the main thread's backward on a GPU. Only the transport's thread takes ``transport`` turns."""
        if kind not in KINDS:
            raise ValueError(f"LaunchOrder.turn: kind must be one of {KINDS}, got {kind!r}")
        self._acquire(kind)
        try:
            yield
        finally:
            self._release()

    def yield_turn(self) -> None:
        """A yield point of the main side: if it holds the (outermost) main turn, give it up and take a new one,
        behind a transport turn that waits (so a bucket's gather slips in between two blocks of a chunk)."""
        with self._cond:
            if self._busy != MAIN or self._depth != 1:
                return
            self._busy, self._depth = None, 0
            self._cond.notify_all()
        self._acquire(MAIN, behind_waiters=True)


def gang_store(generation: str):
    """The gang's rendezvous store under a prefix of its own (``generation``: one per joining of the gang, so a
    restarted gang never reads an earlier gang's log)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return dist.PrefixStore(f"bidirl-launch-order/{generation}/", c10d._get_default_store())


def yield_at_blocks(blocks, order_of: Callable[[], Optional[LaunchOrder]]) -> list:
    """Yield points between the blocks of a forward and of a backward: before each block's forward (FSDP2's
    all-gather for the block launches in its own forward pre-hook, registered earlier, so in the new turn), and
    when the gradient of a block's output is ready, before the block's backward (its gradient's reduce-scatter
    follows it). The same blocks run on every rank (an empty share's one token included), so every rank yields
    at the same points. Returns the hook handles."""
    def yield_now(*_):
        order = order_of()
        if order is not None:
            order.yield_turn()

    def on_output(module, args, output):
        out = output[0] if isinstance(output, (tuple, list)) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(yield_now)

    handles = []
    for b in blocks:
        handles.append(b.register_forward_pre_hook(yield_now, prepend=True))
        handles.append(b.register_forward_hook(on_output))
    return handles


def gang_call(method):
    """Decorate a trainer engine's method that launches the gang's collectives on the main thread: it runs in a
    ``main`` turn of the engine's :class:`LaunchOrder` (``_launches``; none outside a gang of several ranks)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        order = getattr(self, "_launches", None)
        with order.turn(MAIN) if order is not None else nullcontext():
            return method(self, *args, **kwargs)
    return call
