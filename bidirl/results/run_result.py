"""What a run leaves in memory: :class:`RunResult` (event log, summary, provenance, final view)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bidirl.job import config as cfgmod
from bidirl.results.trace import EventLog


@dataclass
class RunResult:
    """What a run produced: its event log, summary and provenance (``simulated`` | ``emulated`` | ``measured``).

    ``view`` is the coordinator's final read-only snapshot; ``weights`` the final actor weights of an engine run.
    """
    policy: str
    config: cfgmod.JobConfig
    log: EventLog
    summary_dict: dict
    provenance: str
    view: Any = None
    events_processed: int = 0
    weights: Any = None

    def summary(self) -> dict:
        return dict(self.summary_dict)

    @property
    def events(self):
        return self.log.spans_df()
