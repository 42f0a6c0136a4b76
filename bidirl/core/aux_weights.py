"""Which weights each segment of a step computes on, and whether the auxiliary trainer gang holds them (paper §5.2,
Trainer-on-RolloutPool, across optimizer mini-batches).

A step's segments compute on the weights of its version plus the optimizer steps taken since: a streamed step's
earlier local updates (``rl.updates_per_sync``) and, within the local update, the mini-batches before the segment
(``rl.mini_batch_prompts``, veRL's ``ppo_mini_batch_size``). The *weights tag* of a segment counts those optimizer
steps (0: the version's own weights, what the Trainer-on-RolloutPool switch in loads). An auxiliary gang is a
data-parallel helper of the primary gang: after each optimizer step it receives the new weights
(``RefreshWeights``, one weight transfer from the primaries) before it may run a chunk of the next mini-batch; the
chunk queue hands it a chunk only while its tag equals the segment's (:meth:`AuxWeights.aux_ready`). So an
auxiliary gang never computes a chunk of mini-batch m + 1 on weights older than mini-batch m's optimizer step.

:class:`AuxWeights` is a part of :class:`bidirl.core.chunks.TrainerStep`, split out by concern (its methods read
the step's segments; the fields ``updates_before``, ``aux_refresh``, ``aux_weights`` and ``aux_refreshing`` are
declared there).
"""

from __future__ import annotations

from typing import Optional

from bidirl.core.protocol import UPDATE_STAGES


class AuxWeights:
    """The weights tag of each segment and the auxiliary gang's (methods of the trainer step; no state of their
    own)."""

    @property
    def aux_window_closed(self) -> bool:
        """Whether no Trainer-on-RolloutPool window may run more of the step: past the last segment an auxiliary
        gang may run (:attr:`aux_last_segment`), or an optimizer step under way."""
        return self.segment_index > self.aux_last_segment or self.optimizing

    def weights_at(self, segment_index: Optional[int] = None) -> int:
        """Optimizer steps since the step's version that segment ``segment_index`` (default: the current one)
        computes on: the earlier local updates' (``updates_before``) and this local update's mini-batches before
        it."""
        k = self.segment_index if segment_index is None else segment_index
        return self.updates_before + self._update_segments_before(k)

    def _update_segments_before(self, k: int) -> int:
        """Update segments among ``segments[:k]`` (slice semantics), in closed form: the step's segments are its
        forward segment, if any, then one update segment per mini-batch (:class:`~bidirl.core.chunks.TrainerStep`
        builds them so), so they are the segments past the first update segment."""
        stop = slice(k).indices(len(self.segments))[1]
        first = next((i for i, seg in enumerate(self.segments) if seg == UPDATE_STAGES), len(self.segments))
        return max(0, stop - first)

    @property
    def aux_ready(self) -> bool:
        """Whether the auxiliary gang holds the weights the current segment computes on (and no refresh is under
        way): only then may it be handed a chunk."""
        return not self.aux_refreshing and self.aux_weights == self.weights_at()

    @property
    def aux_needs_refresh(self) -> bool:
        """The auxiliary gang holds weights (it switched in) older than the current segment's, none coming: a
        ``RefreshWeights`` is due (only where the step may refresh, :attr:`aux_refresh`)."""
        return (self.aux_refresh and self.aux_weights is not None and not self.aux_refreshing
                and self.aux_weights != self.weights_at())

    def refreshes_from(self, start: int, end: Optional[int] = None) -> int:
        """Weight refreshes an auxiliary gang that switches in (holding the version's weights) pays to work in
        segments ``start`` … ``end`` − 1 (default: to the step's end): one per distinct weights tag other than the
        version's among them (the trainer gate charges them, :func:`bidirl.core.gates.charge_refreshes`)."""
        if start < 0:
            raise ValueError(f"refreshes_from: start must be a segment index ≥ 0, got {start}")
        end = len(self.segments) if end is None else end
        if start >= end:
            return 0
        # the tags of consecutive segments grow by 0 or 1: every whole number from the first's to the last's
        first, last = self.weights_at(start), self.weights_at(end - 1)
        return last - first + 1 - (first == 0)
