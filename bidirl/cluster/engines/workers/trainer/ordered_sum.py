"""The step's gradient summed in unit order, whichever gang computed each chunk and whenever it finished (§6.3,
Table 2: "finished chunks are merged in original order"; issue 42, reproducible runs).

fp32 addition is not associative, so a sum taken in the order chunks finish depends on timing and on which gang
ran which chunk. With every chunk's gradient the same bits wherever it is computed (the coordinator's fixed chunk
grid, gangs of one shape: ``Settings.reproducible``), a left-to-right sum in unit order —
``((g₀ + g₁) + g₂) + …`` — is the same bits in every run. A primary rank adds a chunk straight into ``p.grad``
when it is the next in order (``p.grad ← p.grad + g``: one rounding, as ``S.add_(g)``), and keeps a chunk that
arrives ahead of a gap in a buffer of its own — one shard of the gradient per early chunk (the device-memory cost,
``bidirl.perf.memory``'s ``order_buffers``) — until the gap is filled. An auxiliary rank keeps every chunk of its
window apart and hands them over in order; the primary adds them where they belong.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OrderedSum:
    """Where the in-order sum stands: units ``[0, upto)`` of the update segment are summed into ``p.grad``;
    ``held`` keeps the chunks that arrived ahead of a gap (first unit -> (units, flat shard, chunk id))."""
    upto: int = 0
    held: dict = field(default_factory=dict)
    peak: int = 0                       # the most chunks held at once this step (the buffers it needed)

    def expects(self, first: int) -> bool:
        """Whether the chunk that starts at unit ``first`` is the next one in order."""
        return first == self.upto

    def advance(self, first: int, units: int) -> None:
        """The chunk ``[first, first + units)`` was added into ``p.grad`` in order."""
        if first != self.upto:
            raise AssertionError(f"chunk at unit {first} added in order while the sum stands at unit {self.upto}")
        self.upto += int(units)

    def hold(self, first: int, units: int, flat, chunk_id) -> None:
        """Keep a chunk's gradient shard until its turn."""
        first, units = int(first), int(units)
        if units < 1:
            raise ValueError(f"chunk {chunk_id} at unit {first} has no units")
        if first < self.upto or first in self.held:
            raise RuntimeError(f"chunk {chunk_id} at unit {first} is already in the step's gradient (sum at unit "
                               f"{self.upto}; held: {sorted(self.held)}); a chunk counts once")
        self.held[first] = (units, flat, chunk_id)
        self.peak = max(self.peak, len(self.held))

    def ready(self):
        """Pop the held chunks that are now next in order, in order (each advances the sum)."""
        while self.upto in self.held:
            units, flat, _ = self.held.pop(self.upto)
            self.upto += units
            yield flat

    def pieces(self) -> list:
        """Every held chunk, in unit order, as ``(first, units, chunk id, flat)`` (an auxiliary window)."""
        return [(first, units, cid, flat) for first, (units, flat, cid) in sorted(self.held.items())]

    def check_complete(self, who: str) -> None:
        if self.held:
            raise RuntimeError(f"{who}: the step's gradient has a gap before unit(s) {sorted(self.held)} (summed up "
                               f"to unit {self.upto}); every update chunk must be computed or received before it")
