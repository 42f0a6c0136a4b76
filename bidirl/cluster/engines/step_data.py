"""One training step's data on the engine driver's side: its samples and what the trainer stages computed for them.

Kept by :mod:`.training` while the step runs and by :mod:`.trainer_recovery` afterwards (a restarted primary gang
replays the steps since its recovery point from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def chunk_inputs(self, share: list, kl: bool) -> tuple:
        """``TrainerActor.chunk_gradient``'s inputs after the chunk id for the samples at positions ``share``:
        samples, advantages, old and (with ``kl``) reference log-probs, the step's loss normaliser."""
        return ([self.samples[k] for k in share], self.advantages[share] if share else [],
                [self.old[k] for k in share], [self.ref[k] for k in share] if kl else None, self.normalizer)
