"""One training step's data on the engine driver's side: its samples and what the trainer stages computed for them.

Kept by :mod:`.training` while the step runs and by :mod:`.trainer_recovery` afterwards (a restarted primary gang
replays the steps since its recovery point from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from bidirl.core.protocol import mini_batch_bounds


@dataclass
class StepData:
    """One training step's samples and what the trainer stages computed for them (batch order)."""
    step: int
    version: int                # the actor version the step updates (its on-policy samples' version)
    samples: list
    index: dict                 # (group_id, response index) -> position in ``samples``
    advantages: object          # torch tensor [n]
    normalizer: float
    old: list
    ref: list
    stats: list = field(default_factory=list)     # loss statistics of each update-chunk share
    gaps_without_replay: dict = field(default_factory=dict)   # position -> max |Δ log-prob| with R3 off (compared)
    #: samples per optimizer mini-batch (``rl.mini_batch_prompts`` × group size; 0: the step is one update) and each
    #: mini-batch's loss normaliser: a mini-batch's gradient is its own loss's (veRL's ``update_policy`` normalises
    #: each mini-batch's loss over that mini-batch)
    mini_batch: int = 0
    mini_normalizers: tuple = ()
    earlier_updates: int = 0    # optimizer updates these samples took before their last (one per earlier mini-batch)
    local: int = 0              # the local update of a streamed step (rl.updates_per_sync) these samples are
    sync_checked: Optional[int] = None   # leading samples whose old log-probs are on the version's weights (None: all)

    @property
    def optimizer_updates(self) -> int:
        """Optimizer updates these samples took: the mini-batches' before the last, and the last."""
        return self.earlier_updates + 1

    def mini_batches(self) -> list:
        """The optimizer mini-batches ``[(lo, hi)]`` of the step's samples, in batch order (one without them)."""
        return mini_batch_bounds(len(self.samples), self.mini_batch or None)

    def normalizer_of(self, k: int) -> float:
        """The loss normaliser of sample ``k``'s optimizer update: its mini-batch's, or the step's."""
        if not self.mini_normalizers:
            return self.normalizer
        return self.mini_normalizers[k // self.mini_batch]

    def chunk_inputs(self, share: list, kl: bool) -> tuple:
        """``TrainerActor.chunk_gradient``'s inputs after the chunk id for the samples at positions ``share``:
        samples, advantages, old and (with ``kl``) reference log-probs, the loss normaliser of the update they
        belong to (an update chunk never spans two mini-batches)."""
        return ([self.samples[k] for k in share], self.advantages[share] if share else [],
                [self.old[k] for k in share], [self.ref[k] for k in share] if kl else None,
                self.normalizer_of(share[0]) if share else self.normalizer)
