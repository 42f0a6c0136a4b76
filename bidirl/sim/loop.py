"""A discrete-event loop small enough to read in one sitting (in the spirit of SimPy's core).

One heap keyed ``(time, priority, seq)``; ``seq`` is a per-loop counter, so equal-time events run in the
order they were scheduled and two loops never share state. ``step()`` / ``peek()`` / ``run(until=)`` let a
notebook advance a simulation in slices.
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

    def peek(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def step(self) -> bool:
        if not self._heap:
            return False
        t, _, _, action = heapq.heappop(self._heap)
        self.now = t
        action()
        self.processed += 1
        return True

    def run(self, until: float = math.inf, stop: Callable[[], bool] = lambda: False) -> None:
        while self._heap and self.peek() <= until and not stop():
            self.step()
