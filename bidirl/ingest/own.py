"""bidirl's own trace as an import: a run's event log (``events.parquet`` / ``.csv``, a run folder holding one,
or the Chrome trace ``trace.json`` bidirl writes), so a user's run and a bidirl run sit side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import pandas as pd

from bidirl.core.protocol import POOLS, StepRecord
from bidirl.ingest.errors import TraceFormatError
from bidirl.ingest.run import ImportedRun
from bidirl.results.trace import EventLog, Span
from bidirl.results.tracking import EVENTS_FILE, TRACE_FILE

US = 1e-6


def _from_chrome(path: Path) -> EventLog:
    """The spans of a Chrome trace written by :meth:`EventLog.to_chrome_trace` (thread names are workers,
    ``cat`` is ``kind,role``, ``args`` hold step, version and detail)."""
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path.name}, line {exc.lineno}, column {exc.colno}", f"not valid JSON ({exc.msg})",
                               "re-export the trace; a truncated file ends like this") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list) or (doc.get("otherData") or {}).get("producer") != "bidirl":
        raise TraceFormatError(path.name, "not a trace bidirl wrote (no otherData.producer = 'bidirl')",
                               "pass --format ray-timeline with a map for other Chrome traces")
    threads = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = []
    for i, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        where = f"{path.name}, event {i}"
        if "ts" not in e or "dur" not in e:
            raise TraceFormatError(where, "a span without 'ts' or 'dur'", "re-export the trace from the event log")
        worker = threads.get((e.get("pid"), e.get("tid")))
        kind, _, role = str(e.get("cat", "")).partition(",")
        args = dict(e.get("args") or {})
        step, version = int(args.pop("step", 0)), int(args.pop("version", 0))
        args.pop("role", None)
        try:
            spans.append(Span(worker, str(worker).split("/", 1)[0], role, kind, e["ts"] * US,
                              (e["ts"] + e["dur"]) * US, step, version, args))
        except ValueError as exc:
            raise TraceFormatError(where, str(exc), "re-export the trace from the event log") from None
    steps = []
    for e in events:
        if e.get("ph") == "i" and e.get("cat") == "step":
            a = e["args"]
            steps.append(StepRecord(step=a["step"], start=a["start"], end=e["ts"] * US, tokens=a["tokens"],
                                    samples=a["samples"], wait=a["wait"], consume=a["consume"], version=a["version"]))
    return EventLog(spans=spans, steps=steps)


def import_own(path, pool_gpus: Optional[Mapping] = None, gpus_per_worker: Optional[Mapping] = None) -> ImportedRun:
    """A bidirl event log as an :class:`ImportedRun`. GPUs are not in the log: pass ``pool_gpus`` and
    ``gpus_per_worker`` (default: one GPU per worker, said in the notes)."""
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS_FILE if (path / EVENTS_FILE).exists() else path / TRACE_FILE
    if not path.exists():
        raise TraceFormatError(str(path), "no such bidirl trace", f"pass a run folder (with {EVENTS_FILE}), an event "
                               "log .parquet / .csv, or a trace.json bidirl wrote")
    if path.suffix.lower() == ".json":
        log = _from_chrome(path)
    else:
        try:
            log = EventLog.load(path)
        except (ValueError, OSError) as exc:
            raise TraceFormatError(path.name, f"not a bidirl event log ({exc})",
                                   "pass the events.parquet of a bidirl run") from None
    workers = sorted({s.worker for s in log.spans})
    notes = []
    if gpus_per_worker is None:
        gpus_per_worker = {w: 1.0 for w in workers}
        notes.append("GPUs per worker are not in an event log: each worker counts as 1 GPU (pass gpus_per_worker)")
    if pool_gpus is None:
        pool_gpus = {p: float(sum(g for w, g in gpus_per_worker.items() if w.startswith(p + "/"))) for p in POOLS}
    frame = pd.DataFrame({"worker": workers, "source": workers, "name": workers,
                          "label": [w.split("/")[1] for w in workers], "pool": [w.split("/")[0] for w in workers],
                          "gpus": [float(gpus_per_worker.get(w, 0.0)) for w in workers]})
    return ImportedRun(log=log, source=str(path), format="bidirl", map_name="(bidirl)", pool_gpus=dict(pool_gpus),
                       gpus_per_worker=dict(gpus_per_worker), workers=frame, origin_s=0.0, resolution_s=1e-9,
                       notes=notes, policy=_policy(path))


def _policy(path: Path) -> str:
    """The policy of the run whose event log ``path`` is: the ``policy`` of the ``summary.json`` beside it."""
    summary = path.parent / "summary.json"
    try:
        policy = json.loads(summary.read_text()).get("policy") if summary.is_file() else None
    except (OSError, json.JSONDecodeError, AttributeError):
        policy = None
    return str(policy) if policy else "not in the event log (no summary.json beside it; pass --policy)"
