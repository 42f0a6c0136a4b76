"""Plotly figures of an event log: per-worker Gantt charts, policy comparisons, throughput bars, export.

Gantt bars are horizontal ``go.Bar`` traces on a linear time axis (``base=t0``, ``x=t1 − t0``, in seconds),
one trace per ``(kind, role)`` holding every span of that kind as arrays — never one trace per span, and never
``px.timeline`` (it forces datetimes) or ``ff.create_gantt`` (removed in plotly 7); see DESIGN.md, "Lessons from
the anchors". Lanes are workers, grouped by pool (the paper's RollPool / TrainPool, §3) with primaries first;
the auxiliary rollouters a pool hosts while it is lent (§5, Rollouter-on-TrainerPool) share one lane, since
they switch in and out together and are idle most of the run. Borrowing windows (a pool lent to the other
stage, from its ``switch_in`` to its ``switch_out``) are shaded, step ends are dotted vertical lines, and both
have legend entries beside the plain-named span kinds.

**What a figure shows** — simulated (model prediction), emulated (model-timed workers on Ray) or measured
(real engines) — comes from the run itself: pass a :class:`bidirl.results.run_result.RunResult` and its ``provenance``
names the time axis and the title (:func:`time_axis_title`, :data:`bidirl.results.provenance.PROVENANCE`).

The array building is pure (:func:`spans_to_bars`, :func:`gantt_shapes`) and tested without a browser;
:class:`GanttState` grows the arrays incrementally for live figures (the widgets assign them inside
``fig.batch_update()``) and clips them at a time ``t`` for replay.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.core.protocol import (AUXILIARY, DIRECTIONS, PRIMARY, ROLLOUT_ON_TRAINER_POOL,
                                  TRAINER_ON_ROLLOUT_POOL)
from bidirl.results.metrics import THROUGHPUT_UNIT, borrow_windows
from bidirl.results.provenance import provenance_text
from bidirl.results.trace import KINDS, ROLES, EventLog, lane_order

#: every possible Gantt trace, in drawing order
TRACE_KEYS: tuple = tuple((kind, role) for kind in KINDS for role in ROLES)

#: colour per (kind, role): hue by kind family, a lighter tint for auxiliary (borrowed-pool) work
COLORS: dict = {
    ("generate", "primary"): "#1f77b4", ("generate", "auxiliary"): "#6baed6",
    ("chunk", "primary"): "#ff7f0e", ("chunk", "auxiliary"): "#fdae6b",
    ("switch_in", "primary"): "#636363", ("switch_in", "auxiliary"): "#969696",
    ("switch_out", "primary"): "#636363", ("switch_out", "auxiliary"): "#969696",
    ("sync", "primary"): "#2ca02c", ("sync", "auxiliary"): "#74c476",
    ("grad_merge", "primary"): "#9467bd", ("grad_merge", "auxiliary"): "#bcbddc",
    ("optimizer", "primary"): "#d62728", ("optimizer", "auxiliary"): "#fc9272",
}
#: plain names of the span kinds (the legend and tooltips; the event log keeps the identifiers)
KIND_NAMES: dict = {"generate": "generation", "chunk": "training chunk", "switch_in": "hot switch in (pool lent)",
                    "switch_out": "hot switch out (pool returned)", "sync": "weight sync",
                    "grad_merge": "gradient merge", "optimizer": "optimizer step"}
#: what the role adds to a name: auxiliary work runs on GPUs borrowed from the other pool (§5)
ROLE_NOTES: dict = {PRIMARY: "", AUXILIARY: " · borrowed GPUs"}
#: fill of borrowing windows per direction
WINDOW_COLORS: dict = {ROLLOUT_ON_TRAINER_POOL: "rgba(31, 119, 180, 0.10)",
                       TRAINER_ON_ROLLOUT_POOL: "rgba(255, 127, 14, 0.12)"}
#: legend names of the shaded windows and the step lines
WINDOW_NAMES: dict = {ROLLOUT_ON_TRAINER_POOL: "window: trainer pool lent to rollout",
                      TRAINER_ON_ROLLOUT_POOL: "window: rollout pool lent to training"}
STEP_LINE_NAME = "end of a training step"
STEP_LINE = {"color": "rgba(0,0,0,0.35)", "width": 1, "dash": "dot"}
DEFAULT_WINDOW_COLOR = "rgba(128, 128, 128, 0.10)"
BAR_WIDTH = 0.8
CUSTOMDATA_COLUMNS: tuple = ("worker", "start", "end", "duration", "step", "version", "info")
HOVER = ("%{customdata[0]}<br>%{customdata[1]:.3f} – %{customdata[2]:.3f} s, lasting %{customdata[3]:.3f} s"
         "<br>step %{customdata[4]}, actor version %{customdata[5]}<br>%{customdata[6]}")
#: the time axis of a run, by provenance (bidirl.results.provenance.PROVENANCE's keys)
TIME_AXIS_TITLES: dict = {
    "simulated": "time (s, simulated: stage-time models on a virtual clock)",
    "emulated": "time (s, emulated: wall clock × time_scale, worker start-up included)",
    "measured": "time (s, measured: wall clock since the workers were ready)",
}
UNKNOWN_TIME_AXIS = "time (s; pass the RunResult to say whether simulated, emulated or measured)"
LEGEND_ROW_PX = 22
GROUPED = "*"                     # the index of a lane that holds every auxiliary rollouter of a pool


def trace_name(kind: str, role: str) -> str:
    """Legend name of the ``(kind, role)`` trace in plain words, e.g. ``generation · borrowed GPUs``."""
    return KIND_NAMES[kind] + ROLE_NOTES[role]


# --------------------------------------------------------------------------------------------------
# provenance: what a figure shows
# --------------------------------------------------------------------------------------------------

def time_axis_title(provenance: Optional[str]) -> str:
    """The Gantt time axis of a run of this provenance (:data:`TIME_AXIS_TITLES`)."""
    provenance_text(provenance)                 # validates
    return TIME_AXIS_TITLES.get(provenance, UNKNOWN_TIME_AXIS)


def titled(title: Optional[str], provenance: Optional[str]) -> str:
    """``title`` followed by what the figure shows, e.g. ``bidirl on 8-8 — simulated (model prediction)``."""
    text = provenance_text(provenance)
    return " — ".join(x for x in (title, text) if x)


def _log_and_provenance(source: Any, provenance: Optional[str]) -> tuple:
    """``(EventLog or spans DataFrame, provenance)`` of a RunResult, an EventLog or a spans table."""
    from bidirl.results.run_result import RunResult
    if isinstance(source, RunResult):
        if provenance is not None and provenance != source.provenance:
            raise ValueError(f"provenance={provenance!r} contradicts the run's own {source.provenance!r}")
        return source.log, source.provenance
    return source, provenance


# --------------------------------------------------------------------------------------------------
# pure array building
# --------------------------------------------------------------------------------------------------

def _spans(log_or_spans: Union[EventLog, pd.DataFrame]) -> pd.DataFrame:
    if isinstance(log_or_spans, EventLog):
        return log_or_spans.spans_df()
    if isinstance(log_or_spans, pd.DataFrame):
        missing = [c for c in ("worker", "pool", "role", "kind", "start", "end") if c not in log_or_spans.columns]
        if missing:
            raise ValueError(f"the spans table lacks column(s) {missing}; pass EventLog.spans_df() or an EventLog")
        return log_or_spans
    raise ValueError(f"expected a RunResult, an EventLog or its spans DataFrame, got {type(log_or_spans).__name__}")


def _info(detail: Any) -> str:
    if not isinstance(detail, dict) or not detail:
        return ""
    return ", ".join(f"{k}={v}" for k, v in detail.items())


def lane_of(worker: str, group_auxiliary: bool = True) -> str:
    """The lane a worker is drawn on: its own, or with ``group_auxiliary`` one lane ``<pool>/rollouter/*`` for
    all auxiliary rollouters of a pool (they switch in and out together and carry little between windows)."""
    parts = str(worker).split("/")
    if group_auxiliary and len(parts) == 3 and parts[1] == "rollouter" and parts[0] != "rollout_pool":
        return f"{parts[0]}/rollouter/{GROUPED}"
    return str(worker)


def default_lanes(spans_df: pd.DataFrame, group_auxiliary: bool = True) -> list:
    """Lanes in Gantt order: rollout pool first, primaries before auxiliaries, numeric index order."""
    if not len(spans_df):
        return []
    return lane_order({lane_of(w, group_auxiliary) for w in spans_df["worker"].astype(str)})


def lane_labels(lanes: Sequence[str], workers: Sequence[str] = ()) -> list:
    """Tick text of the lanes: the worker name, or for a grouped lane how many workers it holds."""
    counts: dict = {}
    for w in set(map(str, workers)):
        lane = lane_of(w)
        if lane.endswith("/" + GROUPED):
            counts[lane] = counts.get(lane, 0) + 1
    out = []
    for lane in lanes:
        if lane.endswith("/" + GROUPED):
            n = counts.get(lane, 0)
            out.append(f"{lane} ({n} auxiliary)" if n else f"{lane} (auxiliary)")
        else:
            out.append(lane)
    return out


def spans_to_bars(spans_df: Union[EventLog, pd.DataFrame], lanes: Optional[Sequence[str]] = None,
                  group_auxiliary: bool = True) -> dict:
    """Bar arrays per Gantt trace: ``{(kind, role): {"y", "base", "x", "customdata"}}``.

    ``y`` is the lane index of each span's worker (:func:`lane_of`) in ``lanes`` (default
    :func:`default_lanes`), ``base`` the start and ``x`` the duration (all float64); ``customdata`` is an object
    array with columns :data:`CUSTOMDATA_COLUMNS`. Only the ``(kind, role)`` pairs present appear, in
    :data:`TRACE_KEYS` order. Raises ``ValueError`` when a span's lane is not among ``lanes``.
    """
    df = _spans(spans_df)
    lanes = default_lanes(df, group_auxiliary) if lanes is None else list(lanes)
    index = {w: float(i) for i, w in enumerate(lanes)}
    if len(index) != len(lanes):
        raise ValueError("lanes must not repeat a worker")
    workers = df["worker"].astype(str).to_numpy(dtype=object)
    lane_names = np.array([lane_of(w, group_auxiliary) for w in workers], dtype=object)
    unknown = sorted(set(lane_names) - set(index))
    if unknown:
        raise ValueError(f"worker(s) {unknown} have spans but no lane; add them to lanes (or pass lanes=None)")
    out: dict = {}
    if not len(df):
        return out
    kinds, roles = df["kind"].to_numpy(dtype=object), df["role"].to_numpy(dtype=object)
    start = df["start"].to_numpy(dtype=np.float64)
    end = df["end"].to_numpy(dtype=np.float64)
    step = df["step"].to_numpy() if "step" in df else np.zeros(len(df), dtype=np.int64)
    version = df["version"].to_numpy() if "version" in df else np.zeros(len(df), dtype=np.int64)
    details = df["detail"].to_numpy(dtype=object) if "detail" in df else np.full(len(df), None, dtype=object)
    y_all = np.array([index[w] for w in lane_names], dtype=np.float64)
    for key in TRACE_KEYS:
        mask = (kinds == key[0]) & (roles == key[1])
        if not mask.any():
            continue
        custom = np.empty((int(mask.sum()), len(CUSTOMDATA_COLUMNS)), dtype=object)
        custom[:, 0] = workers[mask]
        custom[:, 1] = start[mask]
        custom[:, 2] = end[mask]
        custom[:, 3] = end[mask] - start[mask]
        custom[:, 4] = step[mask]
        custom[:, 5] = version[mask]
        custom[:, 6] = [_info(d) for d in details[mask]]
        out[key] = {"y": y_all[mask], "base": start[mask], "x": end[mask] - start[mask], "customdata": custom}
    return out


def _empty_bars() -> dict:
    return {"y": np.empty(0), "base": np.empty(0), "x": np.empty(0),
            "customdata": np.empty((0, len(CUSTOMDATA_COLUMNS)), dtype=object)}


def clip_bars(arrays: Mapping, until: float) -> dict:
    """One trace's arrays as they stood at time ``until``: spans not yet started dropped, running ones cut at
    ``until`` (their tooltip keeps the real end). The replay of a finished run draws these."""
    keep = arrays["base"] <= until
    base = arrays["base"][keep]
    return {"y": arrays["y"][keep], "base": base, "x": np.minimum(base + arrays["x"][keep], until) - base,
            "customdata": arrays["customdata"][keep]}


def clip_spans(spans_df: pd.DataFrame, until: float) -> pd.DataFrame:
    """The spans table at time ``until`` (started spans only, ends cut at ``until``)."""
    df = spans_df[spans_df["start"] <= until].copy()
    df["end"] = np.minimum(df["end"].to_numpy(dtype=np.float64), until)
    return df


def pool_bands(lanes: Sequence[str]) -> dict:
    """``{pool: (first lane index, last lane index)}`` for the pools present among ``lanes``."""
    out: dict = {}
    for i, w in enumerate(lanes):
        pool = str(w).split("/", 1)[0]
        lo, hi = out.get(pool, (i, i))
        out[pool] = (min(lo, i), max(hi, i))
    return out


def gantt_shapes(spans_df: Union[EventLog, pd.DataFrame], steps_df: Optional[pd.DataFrame] = None,
                 lanes: Optional[Sequence[str]] = None, xref: str = "x", yref: str = "y",
                 group_auxiliary: bool = True) -> list:
    """Layout shapes for a Gantt: shaded borrowing windows on the lent pool's lanes, dotted lines at step
    ends, and thin separators between pools. Pure: returns plotly shape dicts."""
    df = _spans(spans_df)
    lanes = default_lanes(df, group_auxiliary) if lanes is None else list(lanes)
    bands = pool_bands(lanes)
    shapes = []
    for pool, direction, t0, t1 in borrow_windows(df).itertuples(index=False):
        if pool not in bands:
            continue
        lo, hi = bands[pool]
        shapes.append({"type": "rect", "xref": xref, "yref": yref, "x0": float(t0), "x1": float(t1),
                       "y0": lo - 0.5, "y1": hi + 0.5, "fillcolor": WINDOW_COLORS.get(direction, DEFAULT_WINDOW_COLOR),
                       "line": {"width": 0}, "layer": "below", "name": f"borrow:{direction}"})
    if steps_df is not None and len(steps_df):
        for t in np.asarray(steps_df["end"], dtype=np.float64):
            shapes.append({"type": "line", "xref": xref, "yref": f"{yref} domain", "x0": float(t), "x1": float(t),
                           "y0": 0.0, "y1": 1.0, "line": dict(STEP_LINE), "layer": "above", "name": "step_end"})
    ordered = sorted(bands.values())
    for (_, hi), _next in zip(ordered[:-1], ordered[1:]):
        shapes.append({"type": "line", "xref": f"{xref} domain", "yref": yref, "x0": 0.0, "x1": 1.0,
                       "y0": hi + 0.5, "y1": hi + 0.5, "line": {"color": "rgba(0,0,0,0.5)", "width": 1},
                       "layer": "above", "name": "pool_separator"})
    return shapes


# --------------------------------------------------------------------------------------------------
# legend
# --------------------------------------------------------------------------------------------------

def window_legend(direction: str, visible: bool = True) -> go.Scatter:
    """A legend-only entry for the shaded windows of one borrowing direction (shapes have no legend)."""
    opaque = WINDOW_COLORS.get(direction, DEFAULT_WINDOW_COLOR).rsplit(",", 1)[0] + ", 0.35)"
    return go.Scatter(x=[None], y=[None], mode="markers", name=WINDOW_NAMES[direction], showlegend=visible,
                      marker={"symbol": "square", "size": 14, "color": opaque}, hoverinfo="skip",
                      legendgroup=f"window:{direction}", meta="legend:window")


def step_legend(visible: bool = True) -> go.Scatter:
    """A legend-only entry for the dotted step-end lines."""
    return go.Scatter(x=[None], y=[None], mode="lines", name=STEP_LINE_NAME, showlegend=visible,
                      line=dict(STEP_LINE, width=2), hoverinfo="skip", legendgroup="step_end", meta="legend:step")


def legend_traces(directions: Sequence[str] = DIRECTIONS, steps: bool = True) -> list:
    """The legend-only entries of a Gantt: one per window direction given, and the step line."""
    return [window_legend(d) for d in directions] + ([step_legend()] if steps else [])


def legend_rows(names: Sequence[str], width: float) -> int:
    """How many rows a horizontal legend of ``names`` takes in ``width`` px (a generous text-width estimate),
    so a figure can reserve room for it below the plot."""
    rows, used = 1, 0.0
    for name in names:
        w = 48 + 6.6 * len(name)
        if used and used + w > width:
            rows, used = rows + 1, 0.0
        used += w
    return rows


def legend_layout(names: Sequence[str], width: float) -> tuple:
    """``(legend, bottom margin px)``: a horizontal legend under the x-axis title, out of the hover's way."""
    rows = legend_rows(names, width - 40)
    legend = {"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom", "x": 0.0,
              "xanchor": "left", "traceorder": "normal", "itemclick": "toggle"}
    return legend, 58 + LEGEND_ROW_PX * rows


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------

def _bar(key: tuple, arrays: Mapping, showlegend: bool = True) -> go.Bar:
    kind, role = key
    name = trace_name(kind, role)
    return go.Bar(orientation="h", name=name, legendgroup=name, showlegend=showlegend,
                  y=arrays["y"], base=arrays["base"], x=arrays["x"], customdata=arrays["customdata"],
                  width=BAR_WIDTH, hovertemplate=HOVER + f"<extra>{name}</extra>", meta=f"{kind}:{role}",
                  marker={"color": COLORS[key], "line": {"width": 0},
                          "pattern": {"shape": "/" if role == "auxiliary" else ""}})


def _yaxis(lanes: Sequence[str], workers: Sequence[str] = ()) -> dict:
    return {"tickmode": "array", "tickvals": list(range(len(lanes))), "ticktext": lane_labels(lanes, workers),
            "range": [len(lanes) - 0.5, -0.5] if lanes else [0.5, -0.5], "zeroline": False}


def _steps_of(log_or_spans: Any) -> Optional[pd.DataFrame]:
    return log_or_spans.steps_df() if isinstance(log_or_spans, EventLog) else None


def _directions(df: pd.DataFrame) -> list:
    present = set(borrow_windows(df)["direction"]) if len(df) else set()
    return [d for d in DIRECTIONS if d in present]


WIDTH = 1000          # px; wide enough for the legend, narrow enough for a notebook next to its file browser
TEMPLATE = "plotly_white"     # a white plot area, so the shaded windows have the colours of their legend entries


def gantt_figure(source: Any, title: Optional[str] = None, lanes: Optional[Sequence[str]] = None, *,
                 provenance: Optional[str] = None, group_auxiliary: bool = True) -> go.Figure:
    """A per-worker Gantt chart of one run: one ``go.Bar`` trace per ``(kind, role)`` present, then legend
    entries for the borrowing windows present and the step lines.

    ``source`` is a :class:`~bidirl.results.run_result.RunResult` (its provenance labels the figure), an ``EventLog`` or
    its spans table (then pass ``provenance``). Step ends (from a log) are dotted lines; borrowing windows are
    shaded on the lent pool.
    """
    log, provenance = _log_and_provenance(source, provenance)
    df = _spans(log)
    lanes = default_lanes(df, group_auxiliary) if lanes is None else list(lanes)
    steps = _steps_of(log)
    bars = spans_to_bars(df, lanes, group_auxiliary)
    traces = [_bar(key, arrays) for key, arrays in bars.items()]
    traces += legend_traces(_directions(df), steps is not None and len(steps) > 0)
    fig = go.Figure(traces)
    legend, bottom = legend_layout([t.name for t in traces], WIDTH)
    full = titled(title, provenance)
    fig.update_layout(title=full or None, barmode="overlay", bargap=0.0, width=WIDTH, template=TEMPLATE,
                      height=110 + bottom + 26 * max(1, len(lanes)),
                      xaxis={"type": "linear", "title": {"text": time_axis_title(provenance)}},
                      yaxis=_yaxis(lanes, df["worker"].astype(str)), legend=legend,
                      shapes=gantt_shapes(df, steps, lanes, group_auxiliary=group_auxiliary),
                      margin={"l": 230, "r": 20, "t": 60 if full else 30, "b": bottom})
    return fig


def compare_gantt(logs: Mapping[str, Any], title: Optional[str] = None, *, provenance: Optional[str] = None,
                  group_auxiliary: bool = True) -> go.Figure:
    """Several runs (e.g. policies) stacked one per row on a shared time axis, with one legend entry per
    ``(kind, role)`` and per window direction. ``logs`` maps row labels to RunResults (their provenance, which
    must agree, labels the figure) or EventLogs (then pass ``provenance``)."""
    if not isinstance(logs, Mapping) or not logs:
        raise ValueError("compare_gantt needs a dict {label: RunResult or EventLog} with at least one run")
    sources, kinds = {}, set()
    for label, src in logs.items():
        log, prov = _log_and_provenance(src, provenance)
        sources[str(label)] = log
        kinds.add(prov)
    if len(kinds) > 1:
        raise ValueError(f"compare_gantt draws runs of one provenance on one time axis; got {sorted(map(str, kinds))}")
    provenance = kinds.pop()
    frames = {label: _spans(log) for label, log in sources.items()}
    lanes = {label: default_lanes(df, group_auxiliary) for label, df in frames.items()}
    heights = [max(1, len(v)) for v in lanes.values()]
    fig = make_subplots(rows=len(frames), cols=1, shared_xaxes=True, vertical_spacing=0.06 if len(frames) > 1 else 0,
                        subplot_titles=list(frames), row_heights=[h / sum(heights) for h in heights])
    shown: set = set()
    shapes: list = []
    directions: set = set()
    any_steps = False
    for row, (label, df) in enumerate(frames.items(), start=1):
        for key, arrays in spans_to_bars(df, lanes[label], group_auxiliary).items():
            fig.add_trace(_bar(key, arrays, showlegend=key not in shown), row=row, col=1)
            shown.add(key)
        sub = fig.get_subplot(row, 1)
        xref, yref = sub.xaxis.plotly_name.replace("axis", ""), sub.yaxis.plotly_name.replace("axis", "")
        steps = _steps_of(sources[label])
        any_steps = any_steps or (steps is not None and len(steps) > 0)
        directions |= set(_directions(df))
        shapes += gantt_shapes(df, steps, lanes[label], xref=xref, yref=yref, group_auxiliary=group_auxiliary)
        fig.update_yaxes(_yaxis(lanes[label], df["worker"].astype(str)), row=row, col=1)
    for trace in legend_traces([d for d in DIRECTIONS if d in directions], any_steps):
        fig.add_trace(trace, row=1, col=1)
    fig.update_xaxes(type="linear")
    fig.update_xaxes(title_text=time_axis_title(provenance), row=len(frames), col=1)
    legend, bottom = legend_layout([t.name for t in fig.data if t.showlegend is not False], WIDTH)
    full = titled(title, provenance)
    fig.update_layout(title=full or None, barmode="overlay", bargap=0.0, shapes=shapes, legend=legend, width=WIDTH,
                      template=TEMPLATE,
                      height=90 + bottom + 60 * len(frames) + 26 * sum(heights),
                      margin={"l": 230, "r": 20, "t": 70, "b": bottom})
    return fig


def throughput_bars(results: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Throughput per policy (paper §7.2/§7.3 style bar charts).

    ``results`` needs columns ``policy`` and ``throughput`` (tokens/s); with a ``setting`` column the bars are
    grouped by setting (one trace per policy), and a ``throughput_std`` column adds error bars.
    """
    if not isinstance(results, pd.DataFrame):
        raise ValueError(f"throughput_bars expects a DataFrame, got {type(results).__name__}")
    missing = [c for c in ("policy", "throughput") if c not in results.columns]
    if missing:
        raise ValueError(f"results lacks column(s) {missing}; it needs one row per run with policy and throughput")
    if results.empty:
        raise ValueError("results is empty; pass at least one row (policy, throughput)")
    values = pd.to_numeric(results["throughput"], errors="coerce")
    bad = results["throughput"].notna() & values.isna()
    if bad.any():
        raise ValueError(f"results.throughput must be numeric; row(s) {list(results.index[bad])} are not")
    df = results.assign(throughput=values)
    policies = list(dict.fromkeys(df["policy"].astype(str)))
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf"]
    error = "throughput_std" in df.columns
    fig = go.Figure()
    if "setting" in df.columns:
        for i, policy in enumerate(policies):
            sub = df[df["policy"].astype(str) == policy]
            fig.add_trace(go.Bar(name=policy, x=sub["setting"].astype(str).to_numpy(),
                                 y=sub["throughput"].to_numpy(dtype=np.float64),
                                 marker_color=palette[i % len(palette)],
                                 error_y={"type": "data", "array": sub["throughput_std"].to_numpy(dtype=np.float64)}
                                 if error else None))
        fig.update_layout(barmode="group", xaxis_title="setting")
    else:
        colors = [palette[policies.index(p) % len(palette)] for p in df["policy"].astype(str)]
        fig.add_trace(go.Bar(x=df["policy"].astype(str).to_numpy(), y=df["throughput"].to_numpy(dtype=np.float64),
                             marker_color=colors, showlegend=False,
                             error_y={"type": "data", "array": df["throughput_std"].to_numpy(dtype=np.float64)}
                             if error else None))
        fig.update_layout(xaxis_title="policy")
    fig.update_layout(title=title, yaxis_title=f"throughput ({THROUGHPUT_UNIT})")
    return fig


# --------------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------------

#: (width, height) px of a PNG whose figure sets no size of its own
PNG_SIZE: tuple = (1000, 600)


def write_pngs(figures: Mapping[Union[str, Path], go.Figure], cache_dir: Optional[Union[str, Path]] = None,
               ) -> Optional[str]:
    """Write each figure as PNG at its path with kaleido, in one batch (one browser start for all); returns
    ``None`` when written, else why not (kaleido missing, or no browser it can drive) — nothing is left half
    written. PNG export is optional; HTML always works.

    With ``cache_dir``, a PNG is kept there under a hash of the figure's JSON, its size and kaleido's version, and
    a figure seen before is copied from it instead of rendered again (a browser start and ≈ 1 s a figure), so a
    re-run whose figures did not change writes its PNGs at once.
    """
    try:
        import kaleido
    except ImportError:
        return "kaleido is not installed (pip install kaleido; it also needs a Chrome or Chromium)"
    import plotly.io as pio
    # kaleido renders at its default size unless told; use each figure's own, so the PNG looks like the HTML
    jobs = [(Path(p), f, int(f.layout.width or PNG_SIZE[0]), int(f.layout.height or PNG_SIZE[1]))
            for p, f in figures.items()]
    cached = {}
    if cache_dir is not None:
        cache = Path(cache_dir)
        version = getattr(kaleido, "__version__", "")
        for path, fig, w, h in jobs:
            key = hashlib.sha256(f"{fig.to_json()}|{w}x{h}|{version}".encode()).hexdigest()
            cached[path] = cache / key[:2] / f"{key}.png"
    render = [j for j in jobs if j[0] not in cached or not cached[j[0]].is_file()]
    try:
        if render:
            pio.write_images([j[1] for j in render], [str(j[0]) for j in render],
                             width=[j[2] for j in render], height=[j[3] for j in render])
    except Exception as exc:  # noqa: BLE001 — no browser, a kaleido/Chrome mismatch, ...
        for path, *_ in jobs:
            path.unlink(missing_ok=True)
        return f"kaleido could not render ({type(exc).__name__}: {str(exc)[:160]})"
    rendered = {j[0] for j in render}
    for path, entry in cached.items():
        if path in rendered:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")   # atomic: no half entry is ever read
            shutil.copyfile(path, tmp)
            os.replace(tmp, entry)
        else:
            shutil.copyfile(entry, path)
    return None


def write_png(fig: go.Figure, path: Union[str, Path]) -> Optional[str]:
    """:func:`write_pngs` for one figure."""
    return write_pngs({path: fig})


def export_figure(fig: go.Figure, path: Union[str, Path], png: bool = True) -> dict:
    """Save ``fig`` as a self-contained HTML file at ``path`` (``.html`` added when missing) and, with ``png``,
    beside it as PNG where kaleido can render. Returns ``{"html": Path, "png": Path or None, "note": str}``."""
    path = Path(path)
    html = path if path.suffix == ".html" else path.with_name(path.name + ".html")
    html.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(html), include_plotlyjs=True)
    out = {"html": html, "png": None, "note": "HTML only"}
    if png:
        target = html.with_suffix(".png")
        why = write_png(go.Figure(fig), target)
        out.update(png=None if why else target, note=f"PNG skipped: {why}" if why else "HTML and PNG")
    return out


# --------------------------------------------------------------------------------------------------
# incremental state for live figures
# --------------------------------------------------------------------------------------------------

@dataclass
class GanttState:
    """Accumulates Gantt bar arrays as spans arrive, for live figures (DESIGN.md, "Live widgets").

    Build the figure once with every trace (:meth:`figure`, one per :data:`TRACE_KEYS` entry, empty), then for
    each batch of new spans call :meth:`add` and assign the returned *whole* float64 arrays inside
    ``fig.batch_update()`` (or call :meth:`apply`). ``lanes`` fixes the lane order; lanes first seen later are
    inserted in :func:`bidirl.results.trace.lane_order` position when ``lanes`` was not given, appended otherwise, and
    every stored bar is re-laned. :meth:`arrays` and :meth:`layout` with ``until`` give the state at a time,
    for replay.
    """
    lanes: list = field(default_factory=list)
    keys: tuple = TRACE_KEYS
    group_auxiliary: bool = True
    _fixed: bool = field(default=False, init=False, repr=False)
    _bars: dict = field(default_factory=dict, init=False, repr=False)
    _spans: list = field(default_factory=list, init=False, repr=False)
    _workers: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
        self.lanes = list(self.lanes)
        self._fixed = bool(self.lanes)
        unknown = [k for k in self.keys if k not in COLORS]
        if unknown:
            raise ValueError(f"GanttState.keys holds unknown (kind, role) pair(s) {unknown}; use TRACE_KEYS entries")
        self._bars = {k: _empty_bars() for k in self.keys}

    @property
    def n_spans(self) -> int:
        return int(sum(len(b["x"]) for b in self._bars.values()))

    @property
    def end(self) -> float:
        """The latest span end seen (0 when empty)."""
        ends = [float(np.max(b["base"] + b["x"])) for b in self._bars.values() if len(b["x"])]
        return max(ends, default=0.0)

    def spans_df(self) -> pd.DataFrame:
        """Every span added so far (the columns the Gantt needs)."""
        if not self._spans:
            return EventLog().spans_df()
        return pd.concat(self._spans, ignore_index=True)

    def _relane(self, workers: Sequence[str]) -> None:
        self._workers.update(workers)
        new = [w for w in dict.fromkeys(lane_of(x, self.group_auxiliary) for x in workers) if w not in self.lanes]
        if not new:
            return
        self.lanes = self.lanes + lane_order(new) if self._fixed else lane_order(self.lanes + new)
        index = {w: float(i) for i, w in enumerate(self.lanes)}
        for bars in self._bars.values():
            if len(bars["y"]):
                bars["y"] = np.array([index[lane_of(w, self.group_auxiliary)] for w in bars["customdata"][:, 0]],
                                     dtype=np.float64)

    def add(self, spans_df_new: Union[EventLog, pd.DataFrame]) -> dict:
        """Add new spans; return ``{(kind, role): {"y", "base", "x", "customdata"}}`` — the full arrays of every
        trace in :attr:`keys` order (empty arrays for kinds not seen yet)."""
        df = _spans(spans_df_new)
        unknown = sorted({(k, r) for k, r in zip(df["kind"], df["role"])} - set(self.keys))
        if unknown:
            raise ValueError(f"spans of (kind, role) {unknown} have no trace in this GanttState; include them in keys")
        if len(df):
            self._relane(df["worker"].astype(str).tolist())
            self._spans.append(df[[c for c in df.columns if c in ("worker", "pool", "role", "kind", "start", "end",
                                                                  "step", "version", "detail")]])
            for key, arrays in spans_to_bars(df, self.lanes, self.group_auxiliary).items():
                old = self._bars[key]
                self._bars[key] = {name: np.concatenate([old[name], arrays[name]]) for name in old}
        return self.arrays()

    def arrays(self, until: Optional[float] = None) -> dict:
        """The full arrays of every trace (not copies; do not mutate them), or as they stood at ``until``."""
        if until is None:
            return {k: self._bars[k] for k in self.keys}
        return {k: clip_bars(self._bars[k], until) for k in self.keys}

    def layout(self, steps_df: Optional[pd.DataFrame] = None, until: Optional[float] = None) -> dict:
        """Layout properties to assign with the arrays: y-axis lanes and the shapes (windows, step ends), at
        ``until`` when given."""
        spans = self.spans_df()
        if until is not None:
            spans = clip_spans(spans, until)
            if steps_df is not None and len(steps_df):
                steps_df = steps_df[steps_df["end"] <= until]
        return {"yaxis": _yaxis(self.lanes, sorted(self._workers)),
                "shapes": gantt_shapes(spans, steps_df, self.lanes, group_auxiliary=self.group_auxiliary),
                "height": 160 + 26 * max(1, len(self.lanes))}

    def figure(self, title: Optional[str] = None) -> go.Figure:
        """A figure with one (possibly empty) trace per key, in :attr:`keys` order, showing the current state."""
        fig = go.Figure([_bar(k, a) for k, a in self.arrays().items()])
        fig.update_layout(title=title, barmode="overlay", bargap=0.0, template=TEMPLATE,
                          xaxis={"type": "linear", "title": {"text": "t (s)"}}, margin={"l": 230, "r": 20, "b": 40},
                          **self.layout())
        return fig

    def apply(self, fig: go.Figure, steps_df: Optional[pd.DataFrame] = None) -> None:
        """Assign the current arrays and layout to a figure made by :meth:`figure` in one ``batch_update``."""
        if len(fig.data) != len(self.keys):
            raise ValueError(f"the figure has {len(fig.data)} traces but this GanttState has {len(self.keys)}; "
                             "build it with GanttState.figure()")
        with fig.batch_update():
            for trace, arrays in zip(fig.data, self.arrays().values()):
                trace.y, trace.base, trace.x, trace.customdata = (arrays["y"], arrays["base"], arrays["x"],
                                                                  arrays["customdata"])
            fig.update_layout(**self.layout(steps_df))
