"""Plotly figures of an event log: per-worker Gantt charts, policy comparisons, throughput bars.

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
:class:`bidirl.viz.live.GanttState` grows the arrays incrementally for live figures, and
:mod:`bidirl.viz.export` writes figures to HTML and PNG.
"""

from __future__ import annotations

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
    ("weight_refresh", "primary"): "#31a354", ("weight_refresh", "auxiliary"): "#a1d99b",
    # what borrowing costs, drawn over the span it sits in (bidirl.core.protocol.COST_SPAN_KINDS)
    ("reprefill", "primary"): "#e377c2", ("reprefill", "auxiliary"): "#f7b6d2",
    ("pin_alloc", "primary"): "#8c564b", ("pin_alloc", "auxiliary"): "#c49c94",
    ("switch_no_work", "primary"): "#17becf", ("switch_no_work", "auxiliary"): "#9edae5",
    # what the reproducible mode costs (rl.reproducible): the trainer or the sync held by the rule
    ("rule_wait", "primary"): "#bcbd22", ("rule_wait", "auxiliary"): "#dbdb8d",
}
#: plain names of the span kinds (the legend and tooltips; the event log keeps the identifiers)
KIND_NAMES: dict = {"generate": "generation", "chunk": "training chunk", "switch_in": "hot switch in (pool lent)",
                    "switch_out": "hot switch out (pool returned)", "sync": "weight sync",
                    "grad_merge": "gradient merge", "optimizer": "optimizer step",
                    "weight_refresh": "weights refreshed after an optimizer step",
                    "reprefill": "re-prefill (KV cache lost)", "pin_alloc": "first switch: pinned allocation",
                    "switch_no_work": "switch paid for no work", "rule_wait": "held by the reproducible mode"}
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

def spans_table(log_or_spans: Union[EventLog, pd.DataFrame]) -> pd.DataFrame:
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
    df = spans_table(spans_df)
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


def empty_bars() -> dict:
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
    df = spans_table(spans_df)
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

def bar_trace(key: tuple, arrays: Mapping, showlegend: bool = True) -> go.Bar:
    kind, role = key
    name = trace_name(kind, role)
    return go.Bar(orientation="h", name=name, legendgroup=name, showlegend=showlegend,
                  y=arrays["y"], base=arrays["base"], x=arrays["x"], customdata=arrays["customdata"],
                  width=BAR_WIDTH, hovertemplate=HOVER + f"<extra>{name}</extra>", meta=f"{kind}:{role}",
                  marker={"color": COLORS[key], "line": {"width": 0},
                          "pattern": {"shape": "/" if role == "auxiliary" else ""}})


def lane_axis(lanes: Sequence[str], workers: Sequence[str] = ()) -> dict:
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
    df = spans_table(log)
    lanes = default_lanes(df, group_auxiliary) if lanes is None else list(lanes)
    steps = _steps_of(log)
    bars = spans_to_bars(df, lanes, group_auxiliary)
    traces = [bar_trace(key, arrays) for key, arrays in bars.items()]
    traces += legend_traces(_directions(df), steps is not None and len(steps) > 0)
    fig = go.Figure(traces)
    legend, bottom = legend_layout([t.name for t in traces], WIDTH)
    full = titled(title, provenance)
    fig.update_layout(title=full or None, barmode="overlay", bargap=0.0, width=WIDTH, template=TEMPLATE,
                      height=110 + bottom + 26 * max(1, len(lanes)),
                      xaxis={"type": "linear", "title": {"text": time_axis_title(provenance)}},
                      yaxis=lane_axis(lanes, df["worker"].astype(str)), legend=legend,
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
    frames = {label: spans_table(log) for label, log in sources.items()}
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
            fig.add_trace(bar_trace(key, arrays, showlegend=key not in shown), row=row, col=1)
            shown.add(key)
        sub = fig.get_subplot(row, 1)
        xref, yref = sub.xaxis.plotly_name.replace("axis", ""), sub.yaxis.plotly_name.replace("axis", "")
        steps = _steps_of(sources[label])
        any_steps = any_steps or (steps is not None and len(steps) > 0)
        directions |= set(_directions(df))
        shapes += gantt_shapes(df, steps, lanes[label], xref=xref, yref=yref, group_auxiliary=group_auxiliary)
        fig.update_yaxes(lane_axis(lanes[label], df["worker"].astype(str)), row=row, col=1)
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
