"""Where a run's training step stands: the coordinator's phase (paper §3, the life of a step)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting"          # for a batch
    CONSUMING = "consuming"      # running the step's chunks
    FINISHING = "finishing"      # gradient merge and optimizer step
    SYNCING = "syncing"          # pushing the new weights
    ROLLING_BACK = "rolling_back"  # the primary trainer failed mid-step: the step starts over once it is back
    DONE = "done"
