"""The event log shared by the simulator and the Ray runtime (DESIGN.md, "Lessons from the anchors: Traces").

Every timed thing a driver observes becomes one :class:`Span` in seconds; every finished training step one
:class:`StepRecord`; every borrowing opportunity the scheduler evaluated (paper §5.2, the benefit-over-overhead
admission rule) one :class:`Decision`. The same records come out of ``bidirl.sim`` and ``bidirl.cluster``, so a
Gantt chart or a metric computed from a simulated log means the same thing as one from a real run.

:class:`EventLog` keeps the three record lists, turns them into pandas DataFrames with fixed columns and dtypes
(also when empty), exports a Chrome/Perfetto trace (``chrome://tracing``, https://ui.perfetto.dev), saves and
loads Parquet/CSV, and fingerprints its content for determinism tests.

Span schema (the contract drivers produce)::

    Span(worker, pool, role, kind, start, end, step, version, detail)

* ``worker``  ``<pool>/<rollouter|trainer>[/<i>]`` as in :mod:`bidirl.core.protocol`;
* ``pool``    ``rollout_pool`` | ``trainer_pool`` (the paper's RollPool / TrainPool);
* ``role``    ``primary`` (the worker's home pool) | ``auxiliary`` (a borrowed pool, §3.2);
* ``kind``    ``generate`` | ``chunk`` | ``switch_in`` | ``switch_out`` | ``sync`` | ``grad_merge`` | ``optimizer``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np
import pandas as pd

from bidirl.core.checks import choice, finite, integer
from bidirl.core.protocol import (BORROWED_POOL, DIRECTIONS, POOLS, ROLES, ROLLOUT_POOL,  # noqa: F401 (re-exported)
                                  TRAINER_POOL, Decision, StepRecord)
from bidirl.core.protocol import SPAN_KINDS as KINDS

SPAN_COLUMNS: dict = {"worker": "str", "pool": "str", "role": "str", "kind": "str", "start": "float64",
                      "end": "float64", "step": "int64", "version": "int64", "detail": "object"}
STEP_COLUMNS: dict = {"step": "int64", "start": "float64", "end": "float64", "tokens": "int64",
                      "samples": "int64", "wait": "float64", "consume": "float64", "version": "int64"}
DECISION_COLUMNS: dict = {"t": "float64", "direction": "str", "admitted": "bool", "predicted_gain": "float64",
                          "cost": "float64", "detail": "object"}

#: decimals kept when fingerprinting times (1 ns); finer differences are treated as equal
FINGERPRINT_DECIMALS = 9


# --------------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """One timed activity of one worker, ``[start, end]`` in seconds (driver clock).

    ``detail`` carries kind-specific data: ``chunk`` spans hold ``stage``, ``chunk_id`` and ``samples``;
    ``switch_in``/``switch_out`` hold ``direction``; ``sync`` holds ``version``. Raises ``ValueError`` naming the
    field when a time is not finite, ``end < start``, or ``pool``/``role``/``kind`` is unknown.
    """
    worker: str
    pool: str
    role: str
    kind: str
    start: float
    end: float
    step: int = 0
    version: int = 0
    detail: dict = field(default_factory=dict)

    def __post_init__(self):
        choice(self.pool, POOLS, "Span", "pool")
        choice(self.role, ROLES, "Span", "role")
        choice(self.kind, KINDS, "Span", "kind")
        if not isinstance(self.worker, str) or not self.worker.startswith(self.pool + "/"):
            raise ValueError(f"Span.worker must be named '<pool>/<role-kind>[/<i>]' on pool {self.pool!r} "
                             f"(see bidirl.core.protocol); got {self.worker!r}")
        start, end = finite(self.start, "Span", "start"), finite(self.end, "Span", "end")
        if end < start:
            raise ValueError(f"Span.end ({end!r}) is before Span.start ({start!r}) for {self.kind} on "
                             f"{self.worker}; a span must end at or after its start")
        if not isinstance(self.detail, dict):
            raise ValueError(f"Span.detail must be a dict, got {type(self.detail).__name__}")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "step", integer(self.step, "Span", "step"))
        object.__setattr__(self, "version", integer(self.version, "Span", "version"))

    @property
    def duration(self) -> float:
        return self.end - self.start


Record = Union[Span, StepRecord, Decision]


# --------------------------------------------------------------------------------------------------
# JSON helpers (numpy scalars, tuples, NaN)
# --------------------------------------------------------------------------------------------------

def _plain(value: Any, keep_nonfinite: bool = False) -> Any:
    """A JSON-ready copy of ``value``: numpy scalars to Python, tuples to lists, and non-finite floats to None
    (strict JSON, for Chrome traces) unless ``keep_nonfinite`` (Python's JSON dialect, for our own files)."""
    if isinstance(value, dict):
        return {str(k): _plain(v, keep_nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v, keep_nonfinite) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        x = float(value)
        return x if keep_nonfinite or math.isfinite(x) else None
    if value is None or isinstance(value, str):
        return value
    return str(value)


def _canonical(value: Any, decimals: int = FINGERPRINT_DECIMALS) -> Any:
    """``_plain`` with floats rounded and formatted, so equal logs hash equally."""
    if isinstance(value, dict):
        return {str(k): _canonical(v, decimals) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_canonical(v, decimals) for v in value]
    if isinstance(value, (float, np.floating)) and not isinstance(value, bool):
        x = float(value)
        if not math.isfinite(x):
            return repr(x)
        x = round(x, decimals) + 0.0  # + 0.0 turns -0.0 into 0.0
        return f"{x:.{decimals}f}"
    return _plain(value)


def _dumps(value: Any) -> str:
    """JSON text for our own files: keeps NaN/inf (Python's JSON dialect) so a round trip is exact."""
    return json.dumps(_plain(value, keep_nonfinite=True), sort_keys=True)


def _loads(text: Any) -> dict:
    if isinstance(text, dict):
        return text
    if text is None or (isinstance(text, float) and math.isnan(text)) or text == "":
        return {}
    return json.loads(text)


# --------------------------------------------------------------------------------------------------
# the log
# --------------------------------------------------------------------------------------------------

def _frame(rows: dict, columns: dict) -> pd.DataFrame:
    return pd.DataFrame({name: pd.Series(rows[name], dtype=dtype) for name, dtype in columns.items()})


def _extension(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".parquet", ".csv"):
        raise ValueError(f"cannot tell the trace format from {str(path)!r}: use a path ending in .json "
                         "(Chrome/Perfetto trace), .parquet or .csv")
    return suffix


def _sidecar(path: Path, table: str) -> Path:
    return path.with_name(f"{path.stem}.{table}{path.suffix}")


@dataclass
class EventLog:
    """Spans, step records and scheduler decisions of one run, in the order they were appended."""
    spans: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    decisions: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)      # run-level facts (``reproducibility``); not in the fingerprint

    def __post_init__(self):
        for name, cls in (("spans", Span), ("steps", StepRecord), ("decisions", Decision)):
            items = list(getattr(self, name))
            for item in items:
                if not isinstance(item, cls):
                    raise ValueError(f"EventLog.{name} must hold {cls.__name__} records, got {type(item).__name__}")
            setattr(self, name, items)

    # ------------------------------------------------------------------ appending
    def add_span(self, span: Span) -> None:
        if not isinstance(span, Span):
            raise ValueError(f"add_span expects a Span, got {type(span).__name__}")
        self.spans.append(span)

    def add_step(self, step: StepRecord) -> None:
        if not isinstance(step, StepRecord):
            raise ValueError(f"add_step expects a StepRecord, got {type(step).__name__}")
        self.steps.append(step)

    def add_decision(self, decision: Decision) -> None:
        if not isinstance(decision, Decision):
            raise ValueError(f"add_decision expects a Decision, got {type(decision).__name__}")
        self.decisions.append(decision)

    def add(self, record: Record) -> None:
        """Append any record, dispatching on its type."""
        if isinstance(record, Span):
            self.spans.append(record)
        elif isinstance(record, StepRecord):
            self.steps.append(record)
        elif isinstance(record, Decision):
            self.decisions.append(record)
        else:
            raise ValueError(f"EventLog.add expects a Span, StepRecord or Decision, got {type(record).__name__}")

    def extend(self, records: Union["EventLog", Iterable[Record]]) -> None:
        """Append another log's records (spans, steps, decisions) or an iterable of records."""
        if isinstance(records, EventLog):
            self.spans.extend(records.spans)
            self.steps.extend(records.steps)
            self.decisions.extend(records.decisions)
            return
        for record in records:
            self.add(record)

    def __len__(self) -> int:
        return len(self.spans) + len(self.steps) + len(self.decisions)

    # ------------------------------------------------------------------ tables
    def spans_df(self) -> pd.DataFrame:
        """Spans as a DataFrame with columns and dtypes :data:`SPAN_COLUMNS` (also when empty)."""
        s = self.spans
        return _frame({"worker": [x.worker for x in s], "pool": [x.pool for x in s], "role": [x.role for x in s],
                       "kind": [x.kind for x in s], "start": [x.start for x in s], "end": [x.end for x in s],
                       "step": [x.step for x in s], "version": [x.version for x in s],
                       "detail": [x.detail for x in s]}, SPAN_COLUMNS)

    def steps_df(self) -> pd.DataFrame:
        """Step records as a DataFrame with columns and dtypes :data:`STEP_COLUMNS`."""
        return _frame({name: [getattr(x, name) for x in self.steps] for name in STEP_COLUMNS}, STEP_COLUMNS)

    def decisions_df(self) -> pd.DataFrame:
        """Decisions as a DataFrame with columns and dtypes :data:`DECISION_COLUMNS`."""
        return _frame({name: [getattr(x, name) for x in self.decisions] for name in DECISION_COLUMNS},
                      DECISION_COLUMNS)

    @classmethod
    def from_frames(cls, spans: pd.DataFrame | None = None, steps: pd.DataFrame | None = None,
                    decisions: pd.DataFrame | None = None) -> "EventLog":
        """Rebuild a log from DataFrames shaped like :meth:`spans_df` / :meth:`steps_df` / :meth:`decisions_df`.

        ``detail`` columns may hold dicts or JSON strings. Every row is validated like a new record.
        """
        log = cls()
        tables = (("spans", spans, SPAN_COLUMNS, Span), ("steps", steps, STEP_COLUMNS, StepRecord),
                  ("decisions", decisions, DECISION_COLUMNS, Decision))
        for name, df, columns, make in tables:
            if df is None:
                continue
            missing = [c for c in columns if c not in df.columns]
            if missing:
                raise ValueError(f"{name} table lacks column(s) {missing}; expected {list(columns)}")
            rows = df[list(columns)].to_dict("records")
            out = getattr(log, name)
            for row in rows:
                if "detail" in row:
                    row["detail"] = _loads(row["detail"])
                if name == "decisions":
                    row["admitted"] = bool(row["admitted"])
                out.append(make(**row))
        return log

    # ------------------------------------------------------------------ Chrome / Perfetto
    def to_chrome_trace(self) -> dict:
        """The log as Chrome trace-event JSON (viewable in ``chrome://tracing`` and Perfetto).

        One process per pool (pid 1 ``rollout_pool``, pid 2 ``trainer_pool``), one thread per worker; spans are
        ``"X"`` complete events with ``ts``/``dur`` in microseconds; scheduler decisions are process-scoped
        instant events (``"i"``) on the pool they would lend; step ends are global instant events on the
        trainer pool's process. Metadata (``"M"``) events name the processes and threads.
        """
        pid = {pool: i + 1 for i, pool in enumerate(POOLS)}
        workers = sorted({s.worker for s in self.spans}, key=_lane_key)
        tid = {w: i + 1 for i, w in enumerate(workers)}
        events: list = []
        for pool in POOLS:
            events.append({"ph": "M", "name": "process_name", "pid": pid[pool], "tid": 0, "args": {"name": pool}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid[pool], "tid": 0,
                           "args": {"sort_index": pid[pool]}})
        for w in workers:
            p = pid[w.split("/", 1)[0]]
            events.append({"ph": "M", "name": "thread_name", "pid": p, "tid": tid[w], "args": {"name": w}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": p, "tid": tid[w],
                           "args": {"sort_index": tid[w]}})
        for s in self.spans:
            name = s.kind if s.kind != "chunk" or "stage" not in s.detail else f"chunk:{s.detail['stage']}"
            events.append({"ph": "X", "name": name, "cat": f"{s.kind},{s.role}", "pid": pid[s.pool],
                           "tid": tid[s.worker], "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                           "args": _plain({"step": s.step, "version": s.version, "role": s.role, **s.detail})})
        for d in self.decisions:
            pool = BORROWED_POOL[d.direction]
            events.append({"ph": "i", "s": "p", "name": f"{'admit' if d.admitted else 'reject'} {d.direction}",
                           "cat": "decision", "pid": pid[pool], "tid": 0, "ts": d.t * 1e6,
                           "args": _plain({"admitted": d.admitted, "predicted_gain": d.predicted_gain,
                                           "cost": d.cost, **d.detail})})
        for r in self.steps:
            events.append({"ph": "i", "s": "g", "name": f"step {r.step} end", "cat": "step",
                           "pid": pid[TRAINER_POOL], "tid": 0, "ts": r.end * 1e6,
                           "args": _plain({"step": r.step, "start": r.start, "tokens": r.tokens,
                                           "samples": r.samples, "wait": r.wait, "consume": r.consume,
                                           "version": r.version})})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"producer": "bidirl", "spans": len(self.spans), "steps": len(self.steps),
                              "decisions": len(self.decisions), **_plain(self.meta)}}

    # ------------------------------------------------------------------ files
    def save(self, path: Union[str, Path]) -> Path:
        """Write the log, the format chosen by extension.

        * ``.json``: Chrome/Perfetto trace (:meth:`to_chrome_trace`); write-only.
        * ``.parquet``: the spans table, with steps and decisions stored as JSON in the file's schema metadata
          (key ``bidirl``), so :meth:`load` restores the whole log from one file.
        * ``.csv``: the spans table at ``path``; steps and decisions go to ``<stem>.steps.csv`` and
          ``<stem>.decisions.csv`` beside it. ``detail`` columns are JSON strings.
        """
        path = Path(path)
        ext = _extension(path)
        if ext == ".json":
            path.write_text(json.dumps(self.to_chrome_trace(), allow_nan=False))
            return path
        spans = self.spans_df()
        spans["detail"] = [_dumps(d) for d in spans["detail"]]
        steps = self.steps_df()
        decisions = self.decisions_df()
        decisions["detail"] = [_dumps(d) for d in decisions["detail"]]
        if ext == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            table = pa.Table.from_pandas(spans, preserve_index=False)
            extra = _dumps({"steps": steps.to_dict("list"), "decisions": decisions.to_dict("list"),
                            "meta": self.meta})
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"bidirl": extra.encode()})
            pq.write_table(table, path)
        else:
            spans.to_csv(path, index=False)
            steps.to_csv(_sidecar(path, "steps"), index=False)
            decisions.to_csv(_sidecar(path, "decisions"), index=False)
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "EventLog":
        """Read a log written by :meth:`save` as ``.parquet`` or ``.csv`` (Chrome traces are write-only)."""
        path = Path(path)
        ext = _extension(path)
        if ext == ".json":
            raise ValueError(f"{str(path)!r} is a Chrome trace, which is export-only; save the log as .parquet "
                             "or .csv to load it back")
        if not path.exists():
            raise FileNotFoundError(f"no event log at {str(path)!r}")
        if ext == ".parquet":
            import pyarrow.parquet as pq
            table = pq.read_table(path)
            spans = table.to_pandas()
            meta = (table.schema.metadata or {}).get(b"bidirl")
            extra = json.loads(meta) if meta else {"steps": None, "decisions": None}
            steps = pd.DataFrame(extra["steps"]) if extra.get("steps") is not None else None
            decisions = pd.DataFrame(extra["decisions"]) if extra.get("decisions") is not None else None
            log = cls.from_frames(spans, steps, decisions)
            log.meta = dict(extra.get("meta") or {})
            return log
        else:
            def read(p: Path, columns: dict):
                dtypes = {c: ("str" if t in ("object", "str") else t) for c, t in columns.items() if t != "bool"}
                df = pd.read_csv(p, dtype=dtypes)
                if "admitted" in df:
                    df["admitted"] = df["admitted"].map(lambda v: str(v).lower() in ("true", "1"))
                return df
            spans = read(path, SPAN_COLUMNS)
            steps_path, decisions_path = _sidecar(path, "steps"), _sidecar(path, "decisions")
            steps = read(steps_path, STEP_COLUMNS) if steps_path.exists() else None
            decisions = read(decisions_path, DECISION_COLUMNS) if decisions_path.exists() else None
        return cls.from_frames(spans, steps, decisions)

    # ------------------------------------------------------------------ determinism
    def fingerprint(self) -> str:
        """SHA-256 of the log's content: every record, times rounded to :data:`FINGERPRINT_DECIMALS` decimals.

        Records are sorted within each table before hashing, so the fingerprint describes *what* happened, not
        the order in which a driver happened to append it (Ray results arrive in nondeterministic order).
        """
        payload = {"spans": _canonical_rows(self.spans_df()), "steps": _canonical_rows(self.steps_df()),
                   "decisions": _canonical_rows(self.decisions_df())}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _canonical_rows(df: pd.DataFrame) -> list:
    """Each row of a log table as one canonical string (floats rounded and formatted), sorted."""
    columns = []
    for name in df.columns:
        col = df[name]
        if name == "detail":
            columns.append([json.dumps(_canonical(d), sort_keys=True) if d else "{}" for d in col])
        elif col.dtype == np.float64:
            x = np.round(col.to_numpy(dtype=np.float64), FINGERPRINT_DECIMALS) + 0.0  # + 0.0: -0.0 -> 0.0
            columns.append(np.char.mod(f"%.{FINGERPRINT_DECIMALS}f", x).tolist() if len(x) else [])
        else:
            columns.append([str(v) for v in col.tolist()])
    return sorted("\x1f".join(row) for row in zip(*columns))


def _lane_key(worker: str) -> tuple:
    """Sort key for workers: pool order, primary workers first, then natural (numeric) index order."""
    parts = worker.split("/")
    pool = POOLS.index(parts[0]) if parts[0] in POOLS else len(POOLS)
    kind = parts[1] if len(parts) > 1 else ""
    home = "rollouter" if parts[0] == ROLLOUT_POOL else "trainer"
    index = tuple(int(p) if p.isdigit() else math.inf for p in parts[2:])
    return (pool, 0 if kind == home else 1, kind, index, worker)


def lane_order(workers: Iterable[str]) -> list:
    """Workers grouped by pool (rollout pool first), primaries before auxiliaries, indices in numeric order."""
    return sorted(set(workers), key=_lane_key)
