"""A discrete-event loop small enough to read in one sitting (in the spirit of SimPy's core).

One heap keyed ``(time, priority, seq)``; ``seq`` is a per-loop counter, so equal-time events run in the
order they were scheduled and two loops never share state. ``step()`` / ``peek()`` / ``run(until=)`` let a
notebook advance a simulation in slices; as in SimPy, ``run(until=t)`` leaves the clock at ``t``. An event can
be cancelled before it runs (``cancel``, with the handle ``schedule`` returned); it then never runs and is not
counted.

The simulator runs every worker on one loop; an emulated Ray worker runs its replica model on a loop of its
own, advanced to the wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class EventLoop:
    now: float = 0.0
    _heap: list = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)
    _cancelled: set = field(default_factory=set)
    processed: int = 0

    def schedule(self, delay: float, action: Callable[[], None], priority: int = 1) -> int:
        """Run ``action`` ``delay`` seconds from now (lower ``priority`` first among equal times); returns the
        event's handle for :meth:`cancel`."""
        if delay < 0 or math.isnan(delay):
            raise ValueError(f"cannot schedule {delay} s in the past")
        return self._push(self.now + delay, priority, action)

    def schedule_at(self, t: float, action: Callable[[], None], priority: int = 1) -> int:
        """Run ``action`` at time ``t`` (not before now): for a model that computed the exact time itself."""
        if not t >= self.now:
            raise ValueError(f"cannot schedule at {t}, before now ({self.now})")
        return self._push(t, priority, action)

    def _push(self, t: float, priority: int, action) -> int:
        seq = next(self._seq)
        heapq.heappush(self._heap, (t, priority, seq, action))
        return seq

    def cancel(self, handle: int) -> None:
        """Drop a scheduled event that has not run yet (a later change made it moot)."""
        self._cancelled.add(handle)

    def _drop_cancelled(self) -> None:
        heap = self._heap
        while heap and heap[0][2] in self._cancelled:
            self._cancelled.discard(heapq.heappop(heap)[2])

    @property
    def empty(self) -> bool:
        """No event is scheduled."""
        self._drop_cancelled()
        return not self._heap

    def peek(self) -> float:
        """The time of the next event (``inf`` when none)."""
        self._drop_cancelled()
        return self._heap[0][0] if self._heap else math.inf

    def step(self) -> bool:
        """Run the next event; False when there is none."""
        self._drop_cancelled()
        if not self._heap:
            return False
        t, _, _, action = heapq.heappop(self._heap)
        self.now = t
        action()
        self.processed += 1
        return True

    def run(self, until: float = math.inf, stop: Callable[[], bool] = lambda: False) -> None:
        """Run events up to time ``until`` (or until ``stop()``); a finite ``until`` reached without a stop
        leaves the clock there, never behind it."""
        while not self.empty and self.peek() <= until and not stop():
            self.step()
        if math.isfinite(until) and not stop() and until > self.now:
            self.now = until
