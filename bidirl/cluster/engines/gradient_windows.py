"""The engine driver's side of C_grad (paper §5.2, Algorithm 2; §6.2): auxiliary windows handed to the primary gang.

With the weight transport on (``transport.weights: collective``) an auxiliary trainer gang accumulates the update
chunks of its window into its own sharded ``p.grad`` (``RunChunk`` with ``keep``), and when the window ends — when
the rollout pool switches back to its rollouters, before the gang is offloaded, or at the step's
``MergeGradients`` if it is still lent then — each auxiliary rank sends its shard to the primary ranks that hold
the same shard (:mod:`bidirl.cluster.engines.workers.bridge`: one transfer per auxiliary rank, over a fresh rendezvous).
Each primary rank keeps what it received beside its own gradient; the optimizer step adds exactly the windows of
the current attempt of the step (``apply_kept``'s ``windows``). ``MergeGradients`` waits for windows in flight and
reports their time as C_grad, which the profiler learns (``GradientsMerged``).

Failures: a member that dies is marked gone at its transfers' rendezvous, so nobody waits for it. An auxiliary
gang lost with a window not handed over takes that window's gradients with it; the coordinator rolls the step
back (``TrainerStep.aux_unsent``), and the next attempt of the step drops whatever an earlier one left on either
gang. A transfer that fails while the auxiliary gang lives (a timeout) fails the gang the same way, so the step is
never applied with a window missing.
"""

from __future__ import annotations

from typing import Callable, Optional

from bidirl.cluster.engines.workers import bridge
from bidirl.cluster.engines.workers import weight_transport as wt
from bidirl.core import protocol as P

PRIMARY_TRAINER, AUX_TRAINER = P.PRIMARY_TRAINER, P.AUX_TRAINER


class GradientWindows:
    """Auxiliary windows of one engine run (module docstring). ``driver``: the :class:`EngineDriver`."""

    def __init__(self, driver, bucket_bytes: int, timeout_s: float):
        self.driver = driver
        self.bucket_bytes, self.timeout_s = int(bucket_bytes), float(timeout_s)
        self.pairs: dict = {}             # auxiliary rank -> primary ranks holding its shard
        self.numel: dict = {}             # auxiliary rank -> values in its shard
        self.held: list = []              # update chunks sent to the auxiliary gang since its last window
        self.positions: dict = {}         # chunk id -> (first unit, units) of a held chunk summed in unit order
        self.received: dict = {}          # primary rank -> {transfer id: chunk ids} of this attempt of the step
        self.seconds = 0.0                # C_grad of this attempt's windows
        self.windows = 0                  # windows handed over
        self.transfers = 0                # rank-to-rank transfers (one per primary rank and window)
        self.bytes = 0
        self.attempt = 0
        self._flights: dict = {}          # transfer id -> (Transfer, primary ranks it serves)
        self._in_flight = 0
        self._waiting: list = []
        self._rendezvous = None

    def pair(self, primary_signatures: list, aux_signatures: list) -> None:
        """Pair the gangs' ranks from their shard signatures (``TrainerEngine.shard_signature``)."""
        import math
        self.pairs = bridge.pair_ranks(primary_signatures, aux_signatures)
        self.numel = {a: sum(math.prod(shape) for _, shape in aux_signatures[a]) for a in self.pairs}

    # ---- a step's attempts -----------------------------------------------------------------
    def new_attempt(self, again: bool) -> None:
        """A step starts (``again``: a rolled-back step's new attempt): drop what an earlier attempt left — an
        unsent window on the auxiliary gang, and on a new attempt the primary gang's accumulated gradients."""
        self.attempt += 1
        self.received, self.seconds = {}, 0.0
        if self.held:
            self._discard(AUX_TRAINER)
        self.held, self.positions = [], {}
        if again:
            self._discard(PRIMARY_TRAINER)

    def _discard(self, gang: str, then: Callable[[], None] = lambda: None) -> None:
        """Have ``gang``'s ranks forget the gradients they hold (calls run in order: after their current work)."""
        d = self.driver
        if gang in d.failed:              # a restarted gang holds none
            then()
            return
        d._when_all([(gang, r.discard_gradients.remote()) for r in d.gangs[gang]], lambda _: then(), tolerate=True)

    def hold(self, chunk_id: int, position: Optional[tuple] = None) -> None:
        """An update chunk was sent to the auxiliary gang: its gradient stays there until the window ends.
        ``position`` (first unit, units): the step is summed in unit order, so the gang keeps the chunk apart and
        the window carries one shard per chunk (``TrainerEngine.send_window``)."""
        self.held.append(int(chunk_id))
        if position is not None:
            self.positions[int(chunk_id)] = tuple(int(x) for x in position)

    def windows_for(self, rank: int) -> dict:
        return dict(self.received.get(rank, {}))

    def applied(self) -> None:
        """An optimizer mini-batch's update added the windows received so far (``rl.mini_batch_prompts``): the
        step's later updates must not name them again (the ranks dropped them)."""
        self.received = {}

    # ---- the window ends ----------------------------------------------------------------------
    def send(self, then: Callable[[], None]) -> None:
        """Hand the auxiliary gang's window to the primary gang (if it holds one), then ``then()``."""
        d = self.driver
        ids, self.held = self.held, []
        if not ids:
            then()
            return
        # a window of chunks kept apart (the step summed in unit order): one shard per chunk, in unit order
        pieces = sorted((self.positions.pop(c) + (c,) for c in ids if c in self.positions))
        if pieces and len(pieces) != len(ids):
            raise AssertionError(f"window chunks {ids}: positions for {len(pieces)} only")
        if AUX_TRAINER in d.failed or PRIMARY_TRAINER in d.failed:
            # one gang is being restarted: the step rolls back (the coordinator), nothing to hand over
            self._discard(AUX_TRAINER, then)
            return
        if self._rendezvous is None:
            self._rendezvous = wt.Rendezvous()
        attempt, start = self.attempt, d.now()
        aux, primary = d.gangs[AUX_TRAINER], d.gangs[PRIMARY_TRAINER]
        calls, opened = [], []
        for a, dsts in sorted(self.pairs.items()):
            names = [f"{PRIMARY_TRAINER}/{p}" for p in dsts]
            layout = bridge.window_layout(self.numel[a] * max(1, len(pieces)), self.bucket_bytes)
            transfer = self._rendezvous.open(names, attempt, layout, self.timeout_s)
            self._flights[transfer.tid] = (transfer, list(dsts))
            opened.append((transfer, dsts))
            calls.append((AUX_TRAINER, aux[a].send_window.remote(transfer, ids)))
            calls += [(PRIMARY_TRAINER, primary[p].receive_window.remote(transfer, k, pieces or None))
                      for k, p in enumerate(dsts, start=1)]
        # a rank of a replicated gang whose shard another rank sends holds the same window: it forgets it here, so
        # the next window starts empty on every rank
        calls += [(AUX_TRAINER, rank.discard_gradients.remote()) for a, rank in enumerate(aux) if a not in self.pairs]
        self._in_flight += 1

        def done(replies):
            for transfer, _ in opened:
                self._flights.pop(transfer.tid, None)
                self._rendezvous.close(transfer.tid)
            failed = [r.value["failed"] if r is not None else "a member was lost" for r in replies
                      if r is None or (isinstance(r.value, dict) and r.value.get("failed"))]
            if attempt == self.attempt and not failed:
                for transfer, dsts in opened:
                    for p in dsts:
                        self.received.setdefault(p, {})[transfer.tid] = list(ids)
                elapsed = d.now() - start
                self.seconds += elapsed
                self.windows += 1
                self.transfers += sum(len(dsts) for _, dsts in opened)
                self.bytes += sum(4 * self.numel[a] * max(1, len(pieces)) * len(dsts) for a, dsts in self.pairs.items())
                d._measure((P.TRAINER_ON_ROLLOUT_POOL, "c_grad"), elapsed)
                for lane in (AUX_TRAINER, PRIMARY_TRAINER):
                    d.span(lane, "grad_merge", start, d.now(), {"chunks": len(ids), "window": True})
            elif failed and attempt == self.attempt and AUX_TRAINER not in d.failed:
                d._worker_failed(AUX_TRAINER, f"its gradient window did not reach the primary gang: {failed[0]}")
            self._in_flight -= 1
            then()
            if not self._in_flight:
                waiting, self._waiting = self._waiting, []
                for fn in waiting:
                    fn()
        d._when_all(calls, done, tolerate=True)

    def after_windows(self, fn: Callable[[], None]) -> None:
        """``fn()`` once no window is in flight (``MergeGradients``: the windows sent when the pool switched back)."""
        if self.held:
            self.send(lambda: None)
        if self._in_flight:
            self._waiting.append(fn)
        else:
            fn()

    def member_lost(self, worker: str) -> None:
        """``worker``'s process is gone: its peers in window transfers stop waiting for it."""
        if worker == AUX_TRAINER:
            self.held, self.positions = [], {}
        if self._rendezvous is None or worker not in (AUX_TRAINER, PRIMARY_TRAINER):
            return
        for tid, (transfer, dsts) in list(self._flights.items()):
            ranks = [0] if worker == AUX_TRAINER else range(1, len(dsts) + 1)
            for r in ranks:
                self._rendezvous.gone(tid, r)

    def summary(self) -> dict:
        return {"path": "shard to shard", "windows": self.windows, "senders": len(self.pairs),
                "transfers": self.transfers, "bytes": self.bytes}

    def shutdown(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close_all()
