"""Import a run bidirl did not make — a Ray timeline, a veRL step log, or bidirl's own trace — into bidirl's event
log, so the same Gantt, union-based idle per pool, per-step bubble breakdown and what-if apply to it.

:func:`load_foreign` is the entry point (``bidirl trace import`` calls it); maps are in :mod:`.maps`, the readers
in :mod:`.chrome` / :mod:`.timeline` (Ray timelines), :mod:`.step_timeline` (veRL step logs) and :mod:`.own`
(bidirl), the views' numbers in :mod:`.bubbles`, the what-if in :mod:`.whatif`.
"""

from __future__ import annotations

from typing import Mapping, Optional

from bidirl.ingest.errors import MapError, TraceFormatError, TraceImportError, WorkerPoolConflict
from bidirl.ingest.run import ImportedRun

#: ``--format`` values
FORMATS: tuple = ("ray-timeline", "verl-log", "bidirl")


def load_foreign(path, format: str = "ray-timeline", map=None, *, origin_s: Optional[float] = None,
                 pool_gpus: Optional[Mapping] = None, progress: bool = False,
                 policy: Optional[str] = None) -> ImportedRun:
    """Import ``path`` as an :class:`ImportedRun`.

    * ``ray-timeline``: a Chrome trace (``ray timeline`` / ``ray.timeline(filename)``) through ``map`` (a shipped
      map's name — ``verl-colocated``, ``verl-fully-async``, ``openrlhf``, ``bidirl`` — or a YAML path; required);
      ``origin_s`` is the trace time that becomes 0 (default: the first mapped span);
    * ``verl-log``: a per-step metrics log (JSONL, CSV, veRL console lines) as a coarse per-pool timeline;
    * ``bidirl``: a bidirl run folder, event log (.parquet / .csv) or trace.json (``pool_gpus`` optional).

    ``policy`` names the scheduling policy the run was recorded under when the file does not (a bidirl run's Ray
    timeline); by default the run says what the file or map tells (``ImportedRun.policy``).
    """
    run = _load(path, format, map, origin_s=origin_s, pool_gpus=pool_gpus, progress=progress)
    if policy is not None:
        if not isinstance(policy, str) or not policy.strip():
            raise TraceImportError("--policy", f"policy must be a non-empty name, got {policy!r}",
                                   "pass the policy the run was recorded under, e.g. bidirl or no-borrow")
        run.policy = policy
    return run


def _load(path, format: str, map, *, origin_s, pool_gpus, progress) -> ImportedRun:
    if format not in FORMATS:
        raise TraceImportError("--format", f"unknown format {format!r}", f"use one of {', '.join(FORMATS)}")
    if format == "ray-timeline":
        if map is None:
            from bidirl.ingest.maps import shipped_maps
            raise MapError("--map", "a Ray timeline needs a map from its actors' methods to pools and span kinds",
                           f"pass a shipped map ({', '.join(shipped_maps())}) or a YAML file")
        from bidirl.ingest.timeline import import_timeline
        return import_timeline(path, map, origin_s=origin_s, pool_gpus_override=pool_gpus, progress=progress)
    if map is not None:
        raise MapError("--map", f"a map applies to Ray timelines, not to --format {format}", "drop --map")
    if format == "verl-log":
        from bidirl.ingest.step_timeline import import_step_log
        return import_step_log(path)
    from bidirl.ingest.own import import_own
    return import_own(path, pool_gpus=pool_gpus)


__all__ = ["load_foreign", "ImportedRun", "FORMATS", "TraceImportError", "TraceFormatError", "MapError",
           "WorkerPoolConflict"]
