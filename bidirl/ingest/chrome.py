"""Read a Chrome trace-event file (what ``ray timeline`` and ``ray.timeline(filename)`` write) into one table.

The format is Google's Trace Event Format (the "JSON Array" or "JSON Object" form, ``{"traceEvents": [...]}``):
complete events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds), begin/end pairs (``"B"``/``"E"`` on one
``pid``/``tid``, nested as a stack), and metadata (``"M"``: ``process_name``, ``thread_name``). Instant, counter,
flow and async events carry no busy time and are counted, not read. Ray writes one ``X`` event per task or actor
method call per worker process: ``pid`` the node, ``tid`` the worker process, ``args`` the task's ids
(``actor_id``, ``task_id``, ``func_or_class_name``) — ``ray/_private/profiling.py`` (``chrome_tracing_dump``)
and ``ray/_private/state.py`` (``GlobalState.chrome_tracing_dump``).

:func:`read_chrome_trace` returns a :class:`RawTrace`: one row per busy interval with the event's index in the
file, so every later error can name it. A malformed file raises :class:`~bidirl.ingest.errors.TraceFormatError`
naming the event index (or the line and column, for JSON that does not parse).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
import pandas as pd

from bidirl.ingest.errors import TraceFormatError

#: columns of :attr:`RawTrace.events`
RAW_COLUMNS = ("index", "name", "cat", "label", "worker", "start_us", "end_us", "args")
#: Ray names an actor method call ``cat: "task::Class.method"``, ``name: "method"``; maps match ``Class.method``
RAY_TASK_PREFIX = "task::"
#: phases that carry no busy time: counted in :attr:`RawTrace.skipped`, never drawn
SKIPPED_PHASES = frozenset("iIRCsftbenNODPpacv")


@dataclass
class RawTrace:
    """A trace's busy intervals before mapping: ``events`` (columns :data:`RAW_COLUMNS`, times in µs of the file's
    clock), ``workers`` (worker key -> display name from ``thread_name``/``process_name`` metadata) and ``skipped``
    (phase -> count of events that carry no busy time)."""
    path: str
    events: pd.DataFrame
    workers: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)


def _number(value, where: str, key: str) -> float:
    if type(value) in (float, int) and math.isfinite(value):       # the common case, checked first
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                value = None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TraceFormatError(where, f"{key!r} must be a number of microseconds, got {value!r}",
                                   "write every timed event with numeric ts (and dur for 'X' events)")
    x = float(value)
    if not math.isfinite(x):
        raise TraceFormatError(where, f"{key!r} is not finite ({x!r})", "write finite microsecond times")
    return x


def _load(path: Path) -> list:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(str(path), f"cannot read the file ({exc})", "pass a Chrome trace JSON file") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and _first_line_is_an_event(text):
            raise TraceFormatError(f"{path.name}, line {exc.lineno}",
                                   "one trace event per line (JSON lines, as AReaL's perf_tracer writes each rank's "
                                   "traces-r<rank>.jsonl), not one Chrome trace document",
                                   "merge the per-rank files into one Chrome trace JSON first: `python -m "
                                   "areal.tools.perf_trace_converter <trial dir> traces.json`, then import "
                                   "traces.json (--map areal)") from None
        raise TraceFormatError(f"{path.name}, line {exc.lineno}, column {exc.colno}",
                               f"not valid JSON ({exc.msg}); a truncated file ends like this",
                               "re-export the timeline (ray timeline / ray.timeline(filename)) and check that the "
                               "write finished") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceFormatError(path.name, "expected a JSON list of trace events or an object with 'traceEvents'",
                               "pass the file `ray timeline` writes (Chrome trace-event format)")
    return events


def label_of(name: str, cat: str) -> str:
    """What a map matches: ``Class.method`` for a Ray task (``cat`` ``task::Class.method``), else the name."""
    return cat[len(RAY_TASK_PREFIX):] if cat.startswith(RAY_TASK_PREFIX) else name


def _first_line_is_an_event(text: str) -> bool:
    """Whether the first line of ``text`` is one whole trace event (a JSON object with a phase): a JSON-lines file."""
    try:
        first = json.loads(text.split("\n", 1)[0])
    except json.JSONDecodeError:
        return False
    return isinstance(first, dict) and "ph" in first


def read_chrome_trace(path: Union[str, Path]) -> RawTrace:
    """Every busy interval of a Chrome trace file (module doc). Raises ``TraceFormatError`` naming the event."""
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(str(path), "no such file", "pass the path of a Ray timeline JSON file")
    events = _load(path)
    index, names, cats, workers, starts, ends, args = [], [], [], [], [], [], []
    labels: dict = {}
    processes: dict = {}
    open_stacks: dict = {}
    skipped: dict = {}
    for i, ev in enumerate(events):
        where = f"{path.name}, event {i}"
        if not isinstance(ev, dict):
            raise TraceFormatError(where, f"expected a JSON object, got {type(ev).__name__}",
                                   "every entry of the event list is one trace event object")
        ph = ev.get("ph")
        if ph is None:
            raise TraceFormatError(where, "the event has no 'ph' (phase)", "give every event a phase, e.g. \"X\"")
        key = f"{ev.get('pid', '')}/{ev.get('tid', '')}"
        if ph == "M":
            meta_args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
            if ev.get("name") == "thread_name" and "name" in meta_args:
                labels[key] = str(meta_args["name"])
            elif ev.get("name") == "process_name" and "name" in meta_args:
                processes[str(ev.get("pid", ""))] = str(meta_args["name"])
            continue
        if ph in SKIPPED_PHASES:
            skipped[ph] = skipped.get(ph, 0) + 1
            continue
        if "ts" not in ev:
            raise TraceFormatError(where, f"the {ph!r} event {ev.get('name', '')!r} has no 'ts' (start time)",
                                   "every timed event needs ts in microseconds")
        ts = _number(ev["ts"], where, "ts")
        if ph == "X":
            if "dur" not in ev:
                raise TraceFormatError(where, f"the complete event {ev.get('name', '')!r} has no 'dur'",
                                       "an 'X' event needs dur in microseconds (or use a 'B'/'E' pair)")
            dur = _number(ev["dur"], where, "dur")
            if dur < 0:
                raise TraceFormatError(where, f"negative duration {dur!r} µs", "dur must be >= 0")
            index.append(i), names.append(str(ev.get("name", ""))), cats.append(str(ev.get("cat", "")))
            workers.append(key), starts.append(ts), ends.append(ts + dur)
            args.append(ev.get("args") if isinstance(ev.get("args"), dict) else {})
        elif ph == "B":
            open_stacks.setdefault(key, []).append((i, ts, ev))
        elif ph == "E":
            stack = open_stacks.get(key)
            if not stack:
                raise TraceFormatError(where, f"an 'E' event on {key} with no open 'B' event",
                                       "pair every 'E' with an earlier 'B' on the same pid/tid")
            j, t0, begin = stack.pop()
            if ts < t0:
                raise TraceFormatError(where, f"ends at {ts} µs, before its 'B' (event {j}) at {t0} µs",
                                       "an event must end at or after its start")
            index.append(j), names.append(str(begin.get("name", ev.get("name", "")))), cats.append(str(begin.get("cat", "")))
            workers.append(key), starts.append(t0), ends.append(ts)
            args.append(begin.get("args") if isinstance(begin.get("args"), dict) else {})
        else:
            raise TraceFormatError(where, f"unknown phase {ph!r}", "use the Chrome trace-event phases (X, B/E, M, i)")
    unclosed = [(j, k) for k, stack in open_stacks.items() for j, _, _ in stack]
    if unclosed:
        j, k = min(unclosed)
        raise TraceFormatError(f"{path.name}, event {j}", f"a 'B' event on {k} is never closed by an 'E' event",
                               "the trace was cut off mid-event: re-export it, or close the event")
    frame = pd.DataFrame({"index": np.asarray(index, dtype=np.int64), "name": pd.Series(names, dtype=object),
                          "cat": pd.Series(cats, dtype=object), "label": pd.Series(
                              [label_of(n, c) for n, c in zip(names, cats)], dtype=object), "worker": pd.Series(workers, dtype=object),
                          "start_us": np.asarray(starts, dtype=np.float64),
                          "end_us": np.asarray(ends, dtype=np.float64), "args": pd.Series(args, dtype="object")})
    names_of = {}
    for key in set(workers):
        pid = key.split("/", 1)[0]
        names_of[key] = " / ".join(x for x in (processes.get(pid), labels.get(key)) if x) or key
    return RawTrace(str(path), frame.sort_values(["start_us", "index"], kind="stable").reset_index(drop=True),
                    names_of, skipped)
