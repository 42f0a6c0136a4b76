"""What an import produces: :class:`ImportedRun`, the foreign run as bidirl's own records plus what the import
could not place.

``log`` is a :class:`bidirl.results.trace.EventLog` (spans and step records on the run's own clock, seconds from
``origin_s``), so every view bidirl has — the Gantt, union-based idle, utilisation — reads it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from bidirl.results.trace import EventLog

#: what a foreign trace's times are: imported from a file the importer did not make (how the file was made —
#: real engines, emulation, a simulation — the importer cannot know)
PROVENANCE = "imported"


@dataclass
class ImportedRun:
    """A foreign run in bidirl's terms.

    * ``log`` — spans and step records (times in seconds from ``origin_s``);
    * ``source``, ``format``, ``map_name`` — the file, its format and the map that placed its spans;
    * ``pool_gpus`` / ``gpus_per_worker`` — GPUs per pool and per worker (lane), as the metrics take them;
    * ``unmapped`` — the events no rule matched: columns ``name, count`` (never dropped silently);
    * ``ignored`` — the events a rule deliberately left out: ``name, reason, count``;
    * ``workers`` — one row per lane: ``worker`` (lane), ``source`` (the trace's id), ``label``, ``pool``, ``gpus``;
    * ``origin_s`` — the trace clock's time (seconds) of the log's zero;
    * ``resolution_s`` — the finest time step the source records (Chrome traces: 1 µs; a step log: its rounding);
    * ``coarse`` — True when the source has no per-GPU detail (a step log): one lane per stage, not per worker;
    * ``notes`` — what the reader should know (said on figures too);
    * ``breakdown`` — a step log's per-step categories (:mod:`bidirl.ingest.step_breakdown`), ``None`` for a
      timeline (whose breakdown :mod:`bidirl.ingest.bubbles` computes from the spans); ``gpu_idle_categories``
      — which of its categories leave the GPUs idle; ``validation_rows`` — a log's validation-only lines;
    * ``policy`` — the scheduling policy the run was recorded under, where the source says it (bidirl's own
      traces), else the framework's trainer the map or format names.
    """
    log: EventLog
    source: str
    format: str
    map_name: str
    pool_gpus: dict
    gpus_per_worker: dict
    unmapped: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"name": [], "count": []}))
    ignored: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"name": [], "reason": [], "count": []}))
    workers: pd.DataFrame = field(default_factory=pd.DataFrame)
    origin_s: float = 0.0
    resolution_s: float = 1e-6
    coarse: bool = False
    colocated: bool = False
    notes: list = field(default_factory=list)
    provenance: str = PROVENANCE
    breakdown: Optional[pd.DataFrame] = None
    gpu_idle_categories: tuple = ()
    validation_rows: list = field(default_factory=list)
    policy: str = "not recorded"

    @property
    def unmapped_count(self) -> int:
        return int(self.unmapped["count"].sum()) if len(self.unmapped) else 0

    def summary(self) -> dict:
        """A JSON-ready summary: source, counts, pools, unmapped names with counts, notes."""
        return {"source": self.source, "format": self.format, "map": self.map_name,
                "spans": len(self.log.spans), "steps": len(self.log.steps),
                "workers": int(len(self.workers)), "pool_gpus": dict(self.pool_gpus),
                "unmapped": {str(n): int(c) for n, c in zip(self.unmapped["name"], self.unmapped["count"])},
                "ignored": {str(n): int(c) for n, c in zip(self.ignored["name"], self.ignored["count"])},
                "origin_s": self.origin_s, "resolution_s": self.resolution_s, "coarse": self.coarse,
                "colocated": self.colocated, "notes": list(self.notes), "provenance": self.provenance,
                "provenance_text": self.provenance_text, "policy": self.policy,
                "validation_rows": len(self.validation_rows)}

    @property
    def provenance_text(self) -> str:
        """What the numbers are, in words: ``imported from FILE``."""
        return f"imported from {self.source}"


def count_names(names, reasons: Optional[list] = None) -> pd.DataFrame:
    """``name, count`` (and ``reason``) of a list of event names, most frequent first, then by name."""
    frame = pd.DataFrame({"name": list(names)} if reasons is None else {"name": list(names), "reason": list(reasons)})
    keys = ["name"] if reasons is None else ["name", "reason"]
    if frame.empty:
        return pd.DataFrame({k: pd.Series([], dtype="str") for k in keys} | {"count": pd.Series([], dtype="int64")})
    out = frame.groupby(keys, sort=False).size().reset_index(name="count")
    return out.sort_values(["count", "name"], ascending=[False, True], kind="stable").reset_index(drop=True)
