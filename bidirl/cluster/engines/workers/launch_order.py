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

import threading
import time
import functools
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

MAIN, TRANSPORT = "main", "transport"
KINDS = (MAIN, TRANSPORT)
#: seconds a follower sleeps between two looks at the store for the next entry (a turn is a block of a chunk or
#: one bucket's gather: milliseconds at least; a look is one TCP round trip, ~0.1 ms)
_POLL_S = 2e-4


class LaunchOrderError(RuntimeError):
    """A follower found another kind in the log than the turn it waits for would allow, or waited too long."""


class LaunchOrder:
    """The turns of one rank of a gang (module docstring). ``store``: a ``torch.distributed.Store`` every rank of
    the gang shares (``set``/``get``/``check``), under a prefix of this gang's generation; ``rank`` 0 leads.
    ``timeout_s``: how long a follower waits for the next entry before it gives up (a lost leader)."""

    def __init__(self, store, rank: int, timeout_s: float = 1800.0):
        self.store, self.rank, self.timeout_s = store, int(rank), float(timeout_s)
        self._cond = threading.Condition()
        self._busy: Optional[str] = None          # the kind holding the turn now
        self._owner: Optional[int] = None         # the thread holding it
        self._depth = 0                           # nested turns of that thread (a gang call inside another)
        self._next = 0                            # leader: the next log index; follower: the next entry to take
        self._waiting = {MAIN: 0, TRANSPORT: 0}   # leader: threads waiting per kind (a yield lets them go first)
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
    def _entry(self, index: int) -> Optional[str]:
        key = f"turn/{index}"
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def _follow(self, kind: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._busy is None:
                entry = self._entry(self._next)
                if entry is not None and entry not in KINDS:
                    raise LaunchOrderError(f"launch order: entry {self._next} is {entry!r}, not one of {KINDS}")
                if entry == kind:
                    self._next += 1
                    return
            if time.monotonic() > deadline:
                raise LaunchOrderError(f"launch order: rank {self.rank} waited {self.timeout_s:g} s for a {kind} "
                                       f"turn at entry {self._next} (the leader, rank 0, logged none)")
            self._cond.wait(_POLL_S)

    # ---- both ---------------------------------------------------------------------------------
    def _acquire(self, kind: str, behind_waiters: bool = False) -> None:
        with self._cond:
            me = threading.get_ident()
            if self._owner == me:                  # a gang call inside another: the turn it holds goes on
                self._depth += 1
                return
            if self.rank == 0:
                self._lead(kind, behind_waiters)
            else:
                self._follow(kind)
            self._busy, self._owner, self._depth = kind, me, 1
            self.log.append(kind)

    def _release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._busy = self._owner = None
                self._cond.notify_all()

    @contextmanager
    def turn(self, kind: str):
        """Hold a turn of ``kind`` while the block launches its collectives (re-entrant on one thread)."""
        if kind not in KINDS:
            raise ValueError(f"LaunchOrder.turn: kind must be one of {KINDS}, got {kind!r}")
        self._acquire(kind)
        try:
            yield
        finally:
            self._release()

    def yield_turn(self) -> None:
        """A yield point of the main thread: if it holds the (outermost) main turn, give it up and take a new one,
        behind a transport turn that waits (so a bucket's gather slips in between two blocks of a chunk)."""
        with self._cond:
            if self._owner != threading.get_ident() or self._depth != 1 or self._busy != MAIN:
                return
            self._busy = self._owner = None
            self._depth = 0
            self._cond.notify_all()
        self._acquire(MAIN, behind_waiters=True)


def gang_store(generation: str):
    """The gang's rendezvous store under a prefix of its own (``generation``: one per joining of the gang, so a
    restarted gang never reads an earlier gang's log)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return dist.PrefixStore(f"bidirl-launch-order/{generation}/", c10d._get_default_store())


def yield_at_blocks(blocks, order_of: Callable[[], Optional[LaunchOrder]]) -> list:
    """Register a yield point before each block's forward (FSDP2's all-gather for the block launches in its own
    forward pre-hook, registered earlier, so it launches in the new turn); returns the hook handles."""
    def hook(module, args):
        order = order_of()
        if order is not None:
            order.yield_turn()
    return [b.register_forward_pre_hook(hook, prepend=True) for b in blocks]


def gang_call(method):
    """Decorate a trainer engine's method that launches the gang's collectives on the main thread: it runs in a
    ``main`` turn of the engine's :class:`LaunchOrder` (``_launches``; none outside a gang of several ranks)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        order = getattr(self, "_launches", None)
        with order.turn(MAIN) if order is not None else nullcontext():
            return method(self, *args, **kwargs)
    return call
