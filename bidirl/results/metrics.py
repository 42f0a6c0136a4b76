"""Run metrics from the event log: throughput (paper §7.1), idle time, utilisation, borrow counts.

All functions read the tables of :class:`bidirl.results.trace.EventLog` (``spans_df()``, ``steps_df()``,
``decisions_df()``), so the simulator and the Ray runtime are measured by the same code.

Throughput (paper §7.1, Experimental Setup, "Metrics"; DESIGN.md "Throughput", which calls it §6.1): prompt
+ response tokens consumed by the measured steps divided by their time, after dropping ``max(1, ⌈s⌉)`` steps
from the head and ``⌈s⌉`` from the tail for a staleness bound ``s``. Steps of one trainer run back to back,
so the time of step ``i`` is ``end[i] − end[i−1]`` (step 0, which has no predecessor, uses
``end[0] − start[0]``). The measured time is therefore ``end[last kept] − end[step before the first kept]``;
the head drop is at least one step, so that predecessor always exists and the first kept step's waiting time
is counted — the same quantity as summing the kept steps' ``end − start`` when each step starts where the
previous one ended.

**Idle** is GPU-weighted everywhere a number is called "idle": GPU-seconds idle over GPU-seconds available, per
pool and over all pools (:func:`idle_gpu_seconds`, :func:`idle_share`). A pool of four replicas with one busy is
75 % idle. Busy time comes from the *union* of each worker's busy intervals on the event log, never from one
start/stop pair per version (veRL's ``rollouter/idle_ratio`` misses pause windows that way, verl issue #6693).
The **pool-union** idle (:func:`idle`: seconds in which *no* GPU of the pool is busy) is a different, smaller
number — idle only when every GPU of the pool idles — and is always labelled "pool-union" where it is shown
(:data:`POOL_UNION_LABEL`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import numpy as np
import pandas as pd

from bidirl.core.protocol import (DIRECTIONS, POOLS, PRIMARY, ROLLOUT_ON_TRAINER_POOL, ROLLOUT_POOL,
                                  TRAINER_ON_ROLLOUT_POOL, TRAINER_POOL)
from bidirl.results.provenance import provenance_text
from bidirl.results.trace import EventLog

SAMPLE_KEYS: tuple = ("generated", "consumed", "lost", "duplicated")

#: how every view names the GPU-weighted idle share (module doc)
IDLE_LABEL = "idle (GPU-weighted: GPU-seconds idle / GPU-seconds available)"
#: how every view names the pool-union idle share (:func:`idle`), never plain "idle"
POOL_UNION_LABEL = "pool-union idle (no GPU of the pool busy)"
#: the ``overall`` entry of an idle table: all pools' GPUs together
OVERALL = "overall"

#: the unit of throughput (§7.1): prompt + response tokens per second
THROUGHPUT_UNIT = "tokens/s"
#: the one unit of a rate — the planner's λ_r, λ_t, λ_pipe (§4.2) and a simulated partition's rate: prompt groups
#: (one prompt and its ``group_size`` responses) per second
RATE_UNIT = "prompt groups/s"


# --------------------------------------------------------------------------------------------------
# interval arithmetic (vectorised: sort + cumulative max)
# --------------------------------------------------------------------------------------------------

def union_intervals(starts: Any, ends: Any, t0: Optional[float] = None,
                    t1: Optional[float] = None) -> tuple:
    """The union of intervals ``[starts[i], ends[i]]`` as disjoint, sorted ``(starts, ends)`` arrays.

    Intervals are first clipped to ``[t0, t1]`` when given (empty ones dropped). Sorting by start and taking
    the running maximum of ends finds where a new disjoint piece begins: where a start exceeds every end
    seen before it. Touching intervals merge.
    """
    s = np.asarray(starts, dtype=np.float64).ravel()
    e = np.asarray(ends, dtype=np.float64).ravel()
    if s.shape != e.shape:
        raise ValueError(f"starts and ends differ in length ({s.size} vs {e.size})")
    if t0 is not None:
        s = np.maximum(s, t0)
    if t1 is not None:
        e = np.minimum(e, t1)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], reach[last]


def union_length(starts: Any, ends: Any, t0: Optional[float] = None, t1: Optional[float] = None) -> float:
    """Total length covered by the intervals (clipped to ``[t0, t1]``); overlaps are counted once."""
    us, ue = union_intervals(starts, ends, t0, t1)
    return float(np.sum(ue - us))


# --------------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------------

def _frame(data: Any, table: str) -> pd.DataFrame:
    if isinstance(data, EventLog):
        return {"spans": data.spans_df, "steps": data.steps_df, "decisions": data.decisions_df}[table]()
    if not isinstance(data, pd.DataFrame):
        raise ValueError(f"expected the {table} DataFrame (EventLog.{table}_df()) or an EventLog, "
                         f"got {type(data).__name__}")
    return data


def _need(df: pd.DataFrame, columns: tuple, table: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"the {table} table lacks column(s) {missing}; pass EventLog.{table}_df()")


def _window(t0: Any, t1: Any) -> tuple:
    try:
        a, b = float(t0), float(t1)
    except (TypeError, ValueError):
        raise ValueError(f"t0 and t1 must be numbers of seconds, got {t0!r}, {t1!r}") from None
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"t0 and t1 must be finite, got {a!r}, {b!r}")
    if b < a:
        raise ValueError(f"t1 ({b}) is before t0 ({a}); pass a window with t0 <= t1")
    return a, b


def _pool(pool: str) -> str:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {', '.join(POOLS)}; got {pool!r}")
    return pool


def _staleness(staleness: Any) -> float:
    try:
        s = float(staleness)
    except (TypeError, ValueError):
        raise ValueError(f"staleness must be a number >= 0, got {staleness!r}") from None
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"staleness must be a finite number >= 0, got {staleness!r}")
    return s


def _pool_gpus(pool_gpus: Mapping) -> dict:
    if not isinstance(pool_gpus, Mapping):
        raise ValueError(f"pool_gpus must map pool name -> GPU count, got {type(pool_gpus).__name__}")
    out = {}
    for pool, n in pool_gpus.items():
        _pool(pool)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer, float)) or not n >= 0:
            raise ValueError(f"pool_gpus[{pool!r}] must be a GPU count >= 0, got {n!r}")
        out[pool] = float(n)
    return out


# --------------------------------------------------------------------------------------------------
# steps and throughput (§7.1)
# --------------------------------------------------------------------------------------------------

def dropped_steps(staleness: float) -> tuple:
    """``(head, tail)`` steps dropped for staleness bound ``s``: ``(max(1, ⌈s⌉), ⌈s⌉)`` (paper §7.1)."""
    c = int(math.ceil(_staleness(staleness)))
    return max(1, c), c


def ordered_steps(steps_df: Union[pd.DataFrame, EventLog]) -> pd.DataFrame:
    """Step records sorted by step index; checks indices are unique and steps finish in order."""
    df = _frame(steps_df, "steps")
    _need(df, ("step", "start", "end", "tokens"), "steps")
    df = df.sort_values("step", kind="stable").reset_index(drop=True)
    if df["step"].duplicated().any():
        dup = sorted(set(df.loc[df["step"].duplicated(), "step"].tolist()))
        raise ValueError(f"step indices must be unique; step(s) {dup} appear more than once")
    end = df["end"].to_numpy(dtype=np.float64)
    if np.any(np.diff(end) < 0):
        i = int(np.flatnonzero(np.diff(end) < 0)[0])
        raise ValueError(f"step {int(df['step'].iloc[i + 1])} ends before step {int(df['step'].iloc[i])}; "
                         "a trainer's steps must finish in step order")
    return df


def step_times(steps_df: Union[pd.DataFrame, EventLog]) -> np.ndarray:
    """Per-step durations in step order: ``end[i] − end[i−1]``, and ``end[0] − start[0]`` for the first."""
    df = ordered_steps(steps_df)
    end = df["end"].to_numpy(dtype=np.float64)
    if end.size == 0:
        return np.empty(0)
    prev = np.concatenate([[float(df["start"].iloc[0])], end[:-1]])
    return end - prev


def measured_window(steps_df: Union[pd.DataFrame, EventLog], staleness: float) -> tuple:
    """``(t0, t1, kept)``: the measured window of §7.1 and the kept steps (a DataFrame in step order).

    Raises ``ValueError`` when fewer than ``head + tail + 1`` steps exist.
    """
    head, tail = dropped_steps(staleness)
    df = ordered_steps(steps_df)
    n, need = len(df), head + tail + 1
    if n < need:
        raise ValueError(f"throughput needs at least {need} steps for staleness {staleness} (drops {head} head "
                         f"and {tail} tail steps, keeps >= 1), but the log has {n}; run at least {need} steps")
    kept = df.iloc[head:n - tail]
    return float(df["end"].iloc[head - 1]), float(kept["end"].iloc[-1]), kept


def throughput(steps_df: Union[pd.DataFrame, EventLog], staleness: float) -> float:
    """Tokens per second over the measured steps (paper §7.1; see the module docstring for step time).

    ``sum(tokens of kept steps) / (end of last kept − end of the step before the first kept)``.
    """
    t0, t1, kept = measured_window(steps_df, staleness)
    if t1 <= t0:
        raise ValueError(f"the steps of the §7.1 window take no time (window [{t0}, {t1}]); throughput is undefined")
    return float(kept["tokens"].to_numpy(dtype=np.float64).sum() / (t1 - t0))


# --------------------------------------------------------------------------------------------------
# idle time and utilisation
# --------------------------------------------------------------------------------------------------

def _pool_spans(spans_df: Union[pd.DataFrame, EventLog], pool: str) -> pd.DataFrame:
    df = _frame(spans_df, "spans")
    _need(df, ("worker", "pool", "start", "end"), "spans")
    return df[df["pool"] == _pool(pool)]


def idle(spans_df: Union[pd.DataFrame, EventLog], pool: str, t0: float, t1: float) -> float:
    """Pool-union idle: seconds in ``[t0, t1]`` during which no worker on ``pool`` is busy.

    Not the GPU-weighted idle of :func:`idle_gpu_seconds`: a pool with one of four replicas busy is not idle here.
    Shown only under :data:`POOL_UNION_LABEL`.

    A pool is busy whenever any of its workers has a span (any kind: generation, chunks, switches, syncs,
    merges, optimizer steps); the busy time is the union of those intervals, so overlapping replicas are
    never double counted. The result lies in ``[0, t1 − t0]``.
    """
    a, b = _window(t0, t1)
    df = _pool_spans(spans_df, pool)
    return max(0.0, (b - a) - union_length(df["start"].to_numpy(), df["end"].to_numpy(), a, b))


def _gpus_of(gpus_per_worker: Mapping, worker: str) -> float:
    if not isinstance(gpus_per_worker, Mapping):
        raise ValueError(f"gpus_per_worker must map worker name -> GPUs, got {type(gpus_per_worker).__name__}")
    if worker not in gpus_per_worker:
        raise ValueError(f"gpus_per_worker has no entry for worker {worker!r}; add how many GPUs it occupies")
    g = gpus_per_worker[worker]
    if isinstance(g, bool) or not isinstance(g, (int, np.integer, float)) or not g >= 0:
        raise ValueError(f"gpus_per_worker[{worker!r}] must be a GPU count >= 0, got {g!r}")
    return float(g)


def busy_gpu_seconds(spans_df: Union[pd.DataFrame, EventLog], pool: str, gpus_per_worker: Mapping,
                     pool_gpus: Union[float, Mapping], t0: float, t1: float) -> float:
    """GPU-seconds in ``[t0, t1]`` during which GPUs of ``pool`` are busy.

    Each worker's spans are merged (union) and weighted by the GPUs it occupies; the pool's load at any
    instant is capped at its size, so workers sharing GPUs (e.g. a sync on the trainer and on an auxiliary
    rollouter of the same pool) never count more than the pool holds.
    """
    a, b = _window(t0, t1)
    cap = _pool_gpus(pool_gpus)[pool] if isinstance(pool_gpus, Mapping) else _pool_gpus({pool: pool_gpus})[pool]
    df = _pool_spans(spans_df, pool)
    times, deltas = [], []
    for worker, group in df.groupby("worker", sort=True):
        g = _gpus_of(gpus_per_worker, str(worker))
        us, ue = union_intervals(group["start"].to_numpy(), group["end"].to_numpy(), a, b)
        times += [us, ue]
        deltas += [np.full(us.size, g), np.full(ue.size, -g)]
    if not times:
        return 0.0
    t, d = np.concatenate(times), np.concatenate(deltas)
    if t.size == 0:
        return 0.0
    order = np.argsort(t, kind="stable")
    t, load = t[order], np.cumsum(d[order])
    return float(np.sum(np.minimum(load[:-1], cap) * np.diff(t)))


def idle_gpu_seconds(spans_df: Union[pd.DataFrame, EventLog], pool: str, gpus_per_worker: Mapping,
                     pool_gpus: Union[float, Mapping], t0: float, t1: float) -> float:
    """GPU-weighted idleness: ``pool_gpus · (t1 − t0) − busy_gpu_seconds(...)`` (see :func:`busy_gpu_seconds`).

    Unlike :func:`idle`, a pool of four replicas with one busy counts three quarters of its GPUs as idle.
    """
    a, b = _window(t0, t1)
    cap = _pool_gpus(pool_gpus)[pool] if isinstance(pool_gpus, Mapping) else _pool_gpus({pool: pool_gpus})[pool]
    return max(0.0, cap * (b - a) - busy_gpu_seconds(spans_df, pool, gpus_per_worker, cap, a, b))


def idle_share(spans_df: Union[pd.DataFrame, EventLog], pool_gpus: Mapping, gpus_per_worker: Mapping,
               t0: float, t1: float) -> dict:
    """GPU-weighted idle share per pool with GPUs and :data:`OVERALL` (all those pools' GPUs together):
    ``idle GPU-seconds / (GPUs · (t1 − t0))``, each in [0, 1]; ``None`` for a pool without GPUs or an empty
    window (module doc)."""
    a, b = _window(t0, t1)
    caps = _pool_gpus(pool_gpus)
    out: dict = {}
    idle_total = 0.0
    for pool in POOLS:
        cap = caps.get(pool, 0.0)
        if cap <= 0 or b <= a:
            out[pool] = None
            continue
        seconds = idle_gpu_seconds(spans_df, pool, gpus_per_worker, caps, a, b)
        idle_total += seconds
        out[pool] = seconds / (cap * (b - a))
    total = sum(c for p, c in caps.items() if p in POOLS) * (b - a)
    out[OVERALL] = idle_total / total if total > 0 else None
    return out


def utilization(spans_df: Union[pd.DataFrame, EventLog], pool_gpus: Mapping, gpus_per_worker: Mapping,
                t0: float, t1: float) -> float:
    """Busy GPU-seconds of all pools over the total, ``Σ_pool busy / (Σ_pool GPUs · (t1 − t0))``, in [0, 1]."""
    a, b = _window(t0, t1)
    caps = _pool_gpus(pool_gpus)
    total = sum(caps.values()) * (b - a)
    if total <= 0:
        raise ValueError(f"utilization needs GPUs and a window of positive length; got pool_gpus={dict(pool_gpus)} "
                         f"and window [{a}, {b}]")
    busy = sum(busy_gpu_seconds(spans_df, pool, gpus_per_worker, caps, a, b) for pool in caps)
    return float(busy / total)


# --------------------------------------------------------------------------------------------------
# borrowing
# --------------------------------------------------------------------------------------------------

def borrow_counts(decisions_df: Union[pd.DataFrame, EventLog]) -> dict:
    """Admitted borrows per direction and rejected opportunities: ``{rollout_on_trainer_pool,
    trainer_on_rollout_pool, rejected}`` (paper §5.2)."""
    df = _frame(decisions_df, "decisions")
    _need(df, ("direction", "admitted"), "decisions")
    unknown = sorted(set(df["direction"]) - set(DIRECTIONS))
    if unknown:
        raise ValueError(f"decision direction(s) {unknown} are unknown; use one of {', '.join(DIRECTIONS)}")
    admitted = df["admitted"].to_numpy(dtype=bool)
    out = {d: int(np.sum(admitted & (df["direction"] == d).to_numpy())) for d in DIRECTIONS}
    out["rejected"] = int(np.sum(~admitted))
    return out


def borrow_windows(spans_df: Union[pd.DataFrame, EventLog], until: Optional[float] = None) -> pd.DataFrame:
    """Borrowing windows: each ``switch_in`` on a pool paired with the next ``switch_out`` on that pool.

    Returns columns ``pool, direction, start, end`` (start of the switch-in, end of the switch-out). A window
    still open at the end of the log closes at ``until`` (default: the log's last span end).
    """
    df = _frame(spans_df, "spans")
    _need(df, ("pool", "kind", "start", "end"), "spans")
    sw = df[df["kind"].isin(["switch_in", "switch_out"])].sort_values(["start", "end"], kind="stable")
    horizon = float(df["end"].max()) if until is None and len(df) else (float(until) if until is not None else 0.0)
    rows = []
    for pool, group in sw.groupby("pool", sort=True):
        open_at, direction = None, ""
        for kind, start, end, detail in zip(group["kind"], group["start"], group["end"],
                                            group["detail"] if "detail" in group else [{}] * len(group)):
            if kind == "switch_in" and open_at is None:
                open_at = float(start)
                direction = str((detail or {}).get("direction", "")) if isinstance(detail, dict) else ""
            elif kind == "switch_out" and open_at is not None:
                rows.append((pool, direction, open_at, float(end)))
                open_at = None
        if open_at is not None:
            rows.append((pool, direction, open_at, max(horizon, open_at)))
    return pd.DataFrame({"pool": pd.Series([r[0] for r in rows], dtype="str"),
                         "direction": pd.Series([r[1] for r in rows], dtype="str"),
                         "start": pd.Series([r[2] for r in rows], dtype="float64"),
                         "end": pd.Series([r[3] for r in rows], dtype="float64")})


# --------------------------------------------------------------------------------------------------
# the simulate / run JSON
# --------------------------------------------------------------------------------------------------

def _median(values: np.ndarray) -> Optional[float]:
    return float(np.median(values)) if len(values) else None


def summary(log: EventLog, *, policy: str, staleness: float, pool_gpus: Mapping, gpus_per_worker: Mapping,
            samples: Mapping) -> dict:
    """The ``bidirl simulate --json`` object of DESIGN.md ("Contracts others rely on").

    Keys: ``policy``; ``throughput`` (tokens/s over the measured steps, §7.1, or ``None`` with a
    ``throughput_note`` when the run is too short); ``step_times`` (every step, :func:`step_times`);
    ``idle`` (per pool, GPU-weighted: idle GPU-seconds over the pool's GPU-seconds in the measured window;
    ``None`` for a pool without GPUs); ``idle_overall`` (the same over all GPUs, ``1 − utilization``);
    ``utilization`` (busy GPU-seconds over all GPU-seconds); ``borrows`` (:func:`borrow_counts`); ``samples``
    (``generated, consumed, lost, duplicated`` plus any extra counters passed in). Extras: ``idle_pool_union``
    (per pool, the share of the window in which no worker of the pool was busy — :func:`idle`, shown only under
    :data:`POOL_UNION_LABEL`), ``window``
    (the measured ``[t0, t1]``), ``measured_steps``, and veRL-named metrics where the meaning is the same:
    ``timing_s/step`` (median step time), ``timing_s/gen`` (median time the trainer waited for its batch),
    ``fully_async/trainer/idle_ratio`` (waiting time over step time of the measured steps) and
    ``fully_async/rollouter/idle_ratio`` (share of the window in which no primary rollouter generated).

    The measured window is the throughput window when the run has enough steps, else the whole run.
    """
    if not isinstance(log, EventLog):
        raise ValueError(f"summary expects an EventLog, got {type(log).__name__}")
    if not isinstance(samples, Mapping):
        raise ValueError(f"samples must be a dict with keys {', '.join(SAMPLE_KEYS)}, got {type(samples).__name__}")
    missing = [k for k in SAMPLE_KEYS if k not in samples]
    if missing:
        raise ValueError(f"samples lacks key(s) {missing}; pass the counts {', '.join(SAMPLE_KEYS)}")
    s = _staleness(staleness)
    caps = _pool_gpus(pool_gpus)
    spans, steps, decisions = log.spans_df(), ordered_steps(log.steps_df()), log.decisions_df()
    durations = step_times(steps)

    out: dict = {"policy": str(policy), "throughput": None}
    try:
        t0, t1, kept = measured_window(steps, s)
        out["throughput"] = throughput(steps, s)
    except ValueError as err:
        out["throughput_note"] = str(err)
        kept = steps
        if len(steps):
            t0, t1 = float(steps["start"].min()), float(steps["end"].max())
        elif len(spans):
            t0, t1 = float(spans["start"].min()), float(spans["end"].max())
        else:
            t0 = t1 = 0.0
    length = t1 - t0

    out["step_times"] = [float(x) for x in durations]
    shares = idle_share(spans, caps, gpus_per_worker, t0, t1)
    out["idle"] = {pool: shares[pool] for pool in POOLS}
    out["idle_overall"] = shares[OVERALL]
    out["utilization"] = (utilization(spans, caps, gpus_per_worker, t0, t1)
                          if length > 0 and sum(caps.values()) > 0 else None)
    out["borrows"] = borrow_counts(decisions)
    out["samples"] = {k: int(v) for k, v in samples.items()}

    out["idle_pool_union"] = {pool: (idle(spans, pool, t0, t1) / length if length > 0 and caps.get(pool, 0) > 0
                                     else None) for pool in POOLS}
    out["window"] = [t0, t1]
    out["measured_steps"] = int(len(kept))
    out["timing_s/step"] = _median(durations)
    out["timing_s/gen"] = _median(steps["wait"].to_numpy(dtype=np.float64)) if "wait" in steps else None
    kept_time = float(np.sum(step_times(steps)[steps["step"].isin(kept["step"]).to_numpy()])) if len(kept) else 0.0
    out["fully_async/trainer/idle_ratio"] = (float(kept["wait"].sum()) / kept_time
                                             if kept_time > 0 and "wait" in kept else None)
    gen = spans[(spans["pool"] == ROLLOUT_POOL) & (spans["role"] == PRIMARY) & (spans["kind"] == "generate")]
    out["fully_async/rollouter/idle_ratio"] = (
        1.0 - union_length(gen["start"].to_numpy(), gen["end"].to_numpy(), t0, t1) / length
        if length > 0 and caps.get(ROLLOUT_POOL, 0) > 0 else None)
    return out


#: the flat numbers of a run summary: (column, path into the summary dict)
SUMMARY_ROW: tuple = (
    ("throughput", ("throughput",)),
    ("utilization", ("utilization",)),
    ("idle_rollout_pool", ("idle", ROLLOUT_POOL)),
    ("idle_trainer_pool", ("idle", TRAINER_POOL)),
    ("idle_overall", ("idle_overall",)),
    ("borrows_rollout_on_trainer_pool", ("borrows", ROLLOUT_ON_TRAINER_POOL)),
    ("borrows_trainer_on_rollout_pool", ("borrows", TRAINER_ON_ROLLOUT_POOL)),
    ("borrows_rejected", ("borrows", "rejected")),
    ("samples_lost", ("samples", "lost")),
    ("samples_duplicated", ("samples", "duplicated")),
    ("step_time_s", ("timing_s/step",)),
)


def summary_row(summary: Mapping) -> dict:
    """A run summary's numbers as one flat row (:data:`SUMMARY_ROW`; NaN where the summary has none, e.g. a run
    too short for the throughput window) — what tables of several runs are made of."""
    out = {}
    for name, path in SUMMARY_ROW:
        value: Any = summary
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        out[name] = math.nan if value is None else float(value)
    return out


#: how a run's switch costs were obtained, by provenance (``run --json``'s ``costs``)
COST_SOURCES: dict = {"measured": "measured on the real engines",
                      "emulated": "timed on emulated workers: the models' costs as slept, plus Ray's overhead",
                      "simulated": "charged by the models"}


def group_rate(summary: Mapping, prompts_per_step: int) -> Optional[float]:
    """A run's rate in :data:`RATE_UNIT` (the planner's unit, λ_pipe): the prompt groups of its measured steps over
    their §7.1 window — the same window as its throughput in tokens/s. ``None`` when the run has no window."""
    if summary.get("throughput") is None or summary.get("window") is None:
        return None
    t0, t1 = summary["window"]
    return int(summary["measured_steps"]) * int(prompts_per_step) / (t1 - t0)


def calibration_line(cal: dict) -> str:
    """The online profiler (§5.1) in one line: how many times it refitted the stage-time models and their median
    relative error before and after (:meth:`bidirl.core.profiler.Profiler.error_summary`); the correction factors
    only where the fallback set them (after a refit they are 1.0 and say nothing)."""
    before, after = cal.get("median_error_pct_before"), cal.get("median_error_pct_after")
    n = cal.get("refits", 0)
    line = f"online profiler: {n} refit{'' if n == 1 else 's'} of the stage-time models"
    if before is None:
        return line + " (no stage-time records yet)"
    if not cal.get("changes"):
        return (line + f"; median prediction error {before:.1f} % over {cal['records_before']} records "
                f"(refits above {cal['tolerance_pct']:g} %)")
    line += f"; median prediction error {before:.1f} % before ({cal['records_before']} records), "
    line += (f"{after:.1f} % after ({cal['records_after']} records)" if after is not None
             else "after: no record since the last change")
    factors = {k: v for k, v in cal.get("scales", {}).items() if abs(v - 1.0) > 1e-9}
    if factors:
        line += "; correction factors (measured / predicted) " + ", ".join(f"{k} {v:.2f}" for k, v in factors.items())
    return line


def idle_line(s: Mapping) -> str:
    """The idle of a run summary in one line: GPU-weighted per pool and overall (:data:`IDLE_LABEL`), then the
    utilisation; the pool-union figures, where the summary has them, follow under :data:`POOL_UNION_LABEL`."""
    parts = [f"{k} {v:.1%}" for k, v in (s.get("idle") or {}).items() if v is not None]
    if s.get("idle_overall") is not None:
        parts.append(f"{OVERALL} {s['idle_overall']:.1%}")
    line = f"{IDLE_LABEL}: " + ", ".join(parts)
    if s.get("utilization") is not None:
        line += f"; utilization {s['utilization']:.1%}"
    union = [f"{k} {v:.1%}" for k, v in (s.get("idle_pool_union") or {}).items() if v is not None]
    if union:
        line += f"; {POOL_UNION_LABEL}: " + ", ".join(union)
    return line


def format_summary(s: dict) -> str:
    """The human-readable summary of ``simulate`` / ``run`` (what ``bidirl simulate`` prints), headed by what
    the numbers are (the summary's ``provenance``: simulated, emulated or measured)."""
    tput = s.get("throughput")
    what = s.get("provenance")
    head = f"policy {s['policy']}" + (f" ({provenance_text(what)})" if what else "")
    lines = [f"{head}: throughput "
             + (f"{tput:,.0f} {THROUGHPUT_UNIT} over the §7.1 window" if tput is not None
                else f"n/a ({s.get('throughput_note', 'too few steps')})"),
             "step times (s): " + " ".join(f"{t:.1f}" for t in s["step_times"]),
             idle_line(s),
             "borrows: " + ", ".join(f"{k} {v}" for k, v in s["borrows"].items()),
             "samples: " + ", ".join(f"{k} {v}" for k, v in s["samples"].items())]
    if s.get("costs"):
        lines.append(f"switch costs (s, {COST_SOURCES.get(what, 'source not given')}): " + "; ".join(
            f"{d} " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) for d, c in s["costs"].items()))
    if s.get("calibration"):
        lines.append(calibration_line(s["calibration"]))
    if s.get("reward"):
        lines.append("mean reward per step: " + " ".join(f"{r:.3f}" for r in s["reward"]))
    return "\n".join(lines)


def length_label(tokens: int) -> str:
    """A response length as the paper writes it: ``2K`` for 2048 tokens, else the token count."""
    tokens = int(tokens)
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens} tok"


def config_label(config: Any) -> str:
    """What sets a run apart, in a few words: split, model, GPUs, prompts per step, max response length and
    staleness, e.g. ``8-8 · qwen3-vl-4b · 16×a6000 · 64 prompts/step · 2K · s=1``. The split is the fixed
    ``cluster.partition`` (``planner's split`` when the planner chooses)."""
    from bidirl.job import config as cfgmod
    cfg = cfgmod.load(config)
    split = cfg.cluster.partition.label() if cfg.cluster.partition is not None else "planner's split"
    w = cfg.workload
    return " · ".join([split, cfg.model, f"{cfg.cluster.gpus}×{cfg.hardware}", f"{w.prompts_per_step} prompts/step",
                       length_label(w.max_response_len), f"s={cfg.rl.staleness:g}"])


def run_label(config: Any, policy: Optional[str] = None) -> str:
    """A run's label carrying its config: the policy (default: the config's), then :func:`config_label`, e.g.
    ``bidirl · 8-8 · qwen3-vl-4b · 16×a6000 · 64 prompts/step · 2K · s=1``."""
    from bidirl.job import config as cfgmod
    cfg = cfgmod.load(config)
    return f"{policy or cfg.scheduler.policy} · {config_label(cfg)}"


def window_text(summary: Mapping) -> str:
    """Which steps the §7.1 throughput of ``summary`` covers, in words."""
    kept, steps = summary.get("measured_steps"), len(summary.get("step_times", ()) or ())
    if summary.get("throughput") is None or not kept:
        return f"no §7.1 window: {summary.get('throughput_note', 'too few steps')}"
    return f"§7.1 window: {int(kept)} of {steps} steps, warm-up and tail steps dropped"


def run_time(summary: Mapping) -> float:
    """The whole run's time in seconds: the sum of its step times (first step's start to last step's end)."""
    times = summary.get("step_times") or ()
    return float(sum(times)) if len(times) else math.nan


def format_comparison(summaries: Mapping[str, Mapping], baseline: str) -> str:
    """Each run against ``baseline`` twice: throughput over its §7.1 window (steady state, warm-up dropped) and
    the whole run's time (warm-up included) — borrowing during warm-up shows only in the second, so a ratio is
    never printed without both. Headed by what the numbers are (the runs' provenance)."""
    if baseline not in summaries:
        raise ValueError(f"baseline {baseline!r} is not among the runs {list(summaries)}")
    kinds = {s.get("provenance") for s in summaries.values()}
    head = (provenance_text(kinds.pop()) or "source not given") if len(kinds) == 1 else "runs of mixed provenance"
    base = summaries[baseline]
    lines = [f"{head}:"]
    for label, s in summaries.items():
        tput, total = s.get("throughput"), run_time(s)
        first = (f"{tput:,.0f} {THROUGHPUT_UNIT}" if tput is not None else "throughput n/a") + f" ({window_text(s)})"
        line = f"  {label}: {first}; whole run {total:,.0f} s"
        if label != baseline:
            ratios = []
            if tput is not None and base.get("throughput"):
                ratios.append(f"{tput / base['throughput']:.3f}x the throughput in the window")
            if math.isfinite(total) and total > 0:
                ratios.append(f"whole run {run_time(base) / total:.3f}x as fast")
            line += f" — vs {baseline}: " + ", ".join(ratios) if ratios else ""
        lines.append(line)
    return "\n".join(lines)


ROLE_OF_KIND = {"generate": "rollout", "chunk": "trainer", "optimizer": "trainer", "grad_merge": "trainer"}


def role_conflicts(spans_df: Union[pd.DataFrame, EventLog], tol: float = 1e-6) -> list:
    """``(pool, t)`` for every instant at which a pool ran rollout work and trainer work at once.

    The exclusive-pool rule of §3.2 (preempt-and-yield) says this list is always empty; tests and drivers
    check it on the event log of simulated and Ray runs alike.
    """
    spans = _frame(spans_df, "spans")
    role = spans["kind"].map(ROLE_OF_KIND)
    out = []
    for pool, df in spans.assign(role=role).groupby("pool"):
        r = df[df["role"] == "rollout"][["start", "end"]].to_numpy(float)
        t = df[df["role"] == "trainer"][["start", "end"]].to_numpy(float)
        if not len(r) or not len(t):
            continue
        for a0, a1 in r:
            hit = (t[:, 0] < a1 - tol) & (t[:, 1] > a0 + tol)
            if hit.any():
                out.append((pool, float(max(a0, t[hit, 0].min()))))
    return out


def reward_trend(rewards) -> dict:
    """Whether a run's mean reward per step rose: ``rise`` (the least-squares slope × the steps spanned, the
    fitted change from the first step to the last), ``spread`` (the standard deviation of the step-to-step
    changes, ddof 1: how much the reward moves from one step to the next by itself), ``rises`` (``rise > spread``;
    ``None`` with fewer than three steps, when no spread can be measured) and ``text``, one sentence. A run
    "learns" only where ``rises`` is true."""
    r = np.asarray([float(x) for x in rewards], dtype=float)
    if r.size < 3:
        return {"rise": math.nan, "spread": math.nan, "rises": None,
                "text": f"mean reward over {r.size} step(s): too few to tell a trend from step-to-step noise"}
    rise = float(np.polyfit(np.arange(r.size), r, 1)[0] * (r.size - 1))
    spread = float(np.std(np.diff(r), ddof=1))
    rises = bool(rise > spread)
    verdict = ("rises by more than its step-to-step spread" if rises
               else "does not rise by more than its step-to-step spread")
    return {"rise": rise, "spread": spread, "rises": rises,
            "text": f"mean reward {r[0]:.3f} → {r[-1]:.3f} over {r.size} steps (fitted change {rise:+.3f}, "
                    f"step-to-step spread {spread:.3f}): it {verdict}"}
