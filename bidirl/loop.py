"""A discrete-event loop small enough to read in one sitting (in the spirit of SimPy's core).

One heap keyed ``(time, priority, seq)``; ``seq`` is a per-loop counter, so equal-time events run in the
order they were scheduled and two loops never share state. ``step()`` / ``peek()`` / ``run(until=)`` let a
notebook advance a simulation in slices; as in SimPy, ``run(until=t)`` leaves the clock at ``t``.

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
    processed: int = 0

    def schedule(self, delay: float, action: Callable[[], None], priority: int = 1) -> None:
        """Run ``action`` ``delay`` seconds from now (lower ``priority`` first among equal times)."""
        if delay < 0 or math.isnan(delay):
            raise ValueError(f"cannot schedule {delay} s in the past")
        heapq.heappush(self._heap, (self.now + delay, priority, next(self._seq), action))

    @property
    def empty(self) -> bool:
        """No event is scheduled."""
        return not self._heap

    def peek(self) -> float:
        """The time of the next event (``inf`` when none)."""
        return self._heap[0][0] if self._heap else math.inf

    def step(self) -> bool:
        """Run the next event; False when there is none."""
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
        while self._heap and self.peek() <= until and not stop():
            self.step()
        if math.isfinite(until) and not stop() and until > self.now:
            self.now = until
