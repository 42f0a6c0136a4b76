"""Plotly figures of an event log: per-worker Gantt charts, policy comparisons, throughput bars.

Gantt bars are horizontal ``go.Bar`` traces on a linear time axis (``base=t0``, ``x=t1 − t0``, in seconds),
one trace per ``(kind, role)`` holding every span of that kind as arrays — never one trace per span, and never
``px.timeline`` (it forces datetimes) or ``ff.create_gantt`` (removed in plotly 7); see DESIGN.md, "Lessons from
the anchors". Lanes are workers, grouped by pool (the paper's RollPool / TrainPool, §3) with primaries first;
borrowing windows (§5: a pool lent to the other stage, from its ``switch_in`` to its ``switch_out``) are
shaded, and step ends are dotted vertical lines.

The array building is pure (:func:`spans_to_bars`, :func:`gantt_shapes`) and tested without a browser;
:class:`GanttState` grows the arrays incrementally for live figures (the widgets assign them inside
``fig.batch_update()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.core.protocol import ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL
from bidirl.metrics import borrow_windows
from bidirl.trace import KINDS, ROLES, EventLog, lane_order

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
#: fill of borrowing windows per direction
WINDOW_COLORS: dict = {ROLLOUT_ON_TRAINER_POOL: "rgba(31, 119, 180, 0.10)",
                       TRAINER_ON_ROLLOUT_POOL: "rgba(255, 127, 14, 0.12)"}
DEFAULT_WINDOW_COLOR = "rgba(128, 128, 128, 0.10)"
BAR_WIDTH = 0.8
CUSTOMDATA_COLUMNS: tuple = ("worker", "start", "end", "step", "version", "info")
HOVER = ("%{customdata[0]}<br>%{customdata[1]:.3f} – %{customdata[2]:.3f} s (%{x:.3f} s)"
         "<br>step %{customdata[3]}, version %{customdata[4]}<br>%{customdata[5]}")


def trace_name(kind: str, role: str) -> str:
    """Legend name of the ``(kind, role)`` trace, e.g. ``generate (auxiliary)``."""
    return f"{kind} ({role})"


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
    raise ValueError(f"expected an EventLog or its spans DataFrame, got {type(log_or_spans).__name__}")


def _info(detail: Any) -> str:
    if not isinstance(detail, dict) or not detail:
        return ""
    return ", ".join(f"{k}={v}" for k, v in detail.items())


def default_lanes(spans_df: pd.DataFrame) -> list:
    """Workers in Gantt order: rollout pool first, primaries before auxiliaries, numeric index order."""
    return lane_order(spans_df["worker"].astype(str)) if len(spans_df) else []


def spans_to_bars(spans_df: Union[EventLog, pd.DataFrame], lanes: Optional[Sequence[str]] = None) -> dict:
    """Bar arrays per Gantt trace: ``{(kind, role): {"y", "base", "x", "customdata"}}``.

    ``y`` is the lane index of each span's worker in ``lanes`` (default :func:`default_lanes`), ``base`` the
    start and ``x`` the duration (all float64); ``customdata`` is an object array with columns
    :data:`CUSTOMDATA_COLUMNS`. Only the ``(kind, role)`` pairs present appear, in :data:`TRACE_KEYS` order.
    Raises ``ValueError`` when a span's worker is not among ``lanes``.
    """
    df = _spans(spans_df)
    lanes = default_lanes(df) if lanes is None else list(lanes)
    index = {w: float(i) for i, w in enumerate(lanes)}
    if len(index) != len(lanes):
        raise ValueError("lanes must not repeat a worker")
    unknown = sorted(set(df["worker"].astype(str)) - set(index))
    if unknown:
        raise ValueError(f"worker(s) {unknown} have spans but no lane; add them to lanes (or pass lanes=None)")
    out: dict = {}
    if not len(df):
        return out
    kinds, roles = df["kind"].to_numpy(dtype=object), df["role"].to_numpy(dtype=object)
    workers = df["worker"].astype(str).to_numpy(dtype=object)
    start = df["start"].to_numpy(dtype=np.float64)
    end = df["end"].to_numpy(dtype=np.float64)
    step = df["step"].to_numpy() if "step" in df else np.zeros(len(df), dtype=np.int64)
    version = df["version"].to_numpy() if "version" in df else np.zeros(len(df), dtype=np.int64)
    details = df["detail"].to_numpy(dtype=object) if "detail" in df else np.full(len(df), None, dtype=object)
    y_all = np.array([index[w] for w in workers], dtype=np.float64)
    for key in TRACE_KEYS:
        mask = (kinds == key[0]) & (roles == key[1])
        if not mask.any():
            continue
        custom = np.empty((int(mask.sum()), len(CUSTOMDATA_COLUMNS)), dtype=object)
        custom[:, 0] = workers[mask]
        custom[:, 1] = start[mask]
        custom[:, 2] = end[mask]
        custom[:, 3] = step[mask]
        custom[:, 4] = version[mask]
        custom[:, 5] = [_info(d) for d in details[mask]]
        out[key] = {"y": y_all[mask], "base": start[mask], "x": end[mask] - start[mask], "customdata": custom}
    return out


def _empty_bars() -> dict:
    return {"y": np.empty(0), "base": np.empty(0), "x": np.empty(0),
            "customdata": np.empty((0, len(CUSTOMDATA_COLUMNS)), dtype=object)}


def pool_bands(lanes: Sequence[str]) -> dict:
    """``{pool: (first lane index, last lane index)}`` for the pools present among ``lanes``."""
    out: dict = {}
    for i, w in enumerate(lanes):
        pool = str(w).split("/", 1)[0]
        lo, hi = out.get(pool, (i, i))
        out[pool] = (min(lo, i), max(hi, i))
    return out


def gantt_shapes(spans_df: Union[EventLog, pd.DataFrame], steps_df: Optional[pd.DataFrame] = None,
                 lanes: Optional[Sequence[str]] = None, xref: str = "x", yref: str = "y") -> list:
    """Layout shapes for a Gantt: shaded borrowing windows on the lent pool's lanes, dotted lines at step
    ends, and thin separators between pools. Pure: returns plotly shape dicts."""
    df = _spans(spans_df)
    lanes = default_lanes(df) if lanes is None else list(lanes)
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
                           "y0": 0.0, "y1": 1.0, "line": {"color": "rgba(0,0,0,0.35)", "width": 1, "dash": "dot"},
                           "layer": "above", "name": "step_end"})
    ordered = sorted(bands.values())
    for (_, hi), _next in zip(ordered[:-1], ordered[1:]):
        shapes.append({"type": "line", "xref": f"{xref} domain", "yref": yref, "x0": 0.0, "x1": 1.0,
                       "y0": hi + 0.5, "y1": hi + 0.5, "line": {"color": "rgba(0,0,0,0.5)", "width": 1},
                       "layer": "above", "name": "pool_separator"})
    return shapes


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------

def _bar(key: tuple, arrays: Mapping, showlegend: bool = True) -> go.Bar:
    kind, role = key
    name = trace_name(kind, role)
    return go.Bar(orientation="h", name=name, legendgroup=name, showlegend=showlegend,
                  y=arrays["y"], base=arrays["base"], x=arrays["x"], customdata=arrays["customdata"],
                  width=BAR_WIDTH, hovertemplate=HOVER + f"<extra>{name}</extra>",
                  marker={"color": COLORS[key], "line": {"width": 0},
                          "pattern": {"shape": "/" if role == "auxiliary" else ""}})


def _yaxis(lanes: Sequence[str]) -> dict:
    return {"tickmode": "array", "tickvals": list(range(len(lanes))), "ticktext": list(lanes),
            "range": [len(lanes) - 0.5, -0.5] if lanes else [0.5, -0.5], "zeroline": False}


def _steps_of(log_or_spans: Any) -> Optional[pd.DataFrame]:
    return log_or_spans.steps_df() if isinstance(log_or_spans, EventLog) else None


def gantt_figure(log_or_spans: Union[EventLog, pd.DataFrame], title: Optional[str] = None,
                 lanes: Optional[Sequence[str]] = None) -> go.Figure:
    """A per-worker Gantt chart of one run: one ``go.Bar`` trace per ``(kind, role)`` present.

    Step ends (from an ``EventLog``) are drawn as dotted lines; borrowing windows are shaded on the lent pool.
    """
    df = _spans(log_or_spans)
    lanes = default_lanes(df) if lanes is None else list(lanes)
    bars = spans_to_bars(df, lanes)
    fig = go.Figure([_bar(key, arrays) for key, arrays in bars.items()])
    fig.update_layout(title=title, barmode="overlay", bargap=0.0, height=160 + 26 * max(1, len(lanes)),
                      xaxis={"type": "linear", "title": {"text": "t (s)"}}, yaxis=_yaxis(lanes),
                      legend={"traceorder": "normal"}, shapes=gantt_shapes(df, _steps_of(log_or_spans), lanes),
                      margin={"l": 180, "r": 20, "t": 60 if title else 30, "b": 40})
    return fig


def compare_gantt(logs: Mapping[str, Union[EventLog, pd.DataFrame]], title: Optional[str] = None) -> go.Figure:
    """Several runs (e.g. policies) stacked one per row on a shared time axis, with one legend entry per
    ``(kind, role)``."""
    if not isinstance(logs, Mapping) or not logs:
        raise ValueError("compare_gantt needs a dict {label: EventLog} with at least one run")
    frames = {str(label): _spans(log) for label, log in logs.items()}
    lanes = {label: default_lanes(df) for label, df in frames.items()}
    heights = [max(1, len(v)) for v in lanes.values()]
    fig = make_subplots(rows=len(frames), cols=1, shared_xaxes=True, vertical_spacing=0.06 if len(frames) > 1 else 0,
                        subplot_titles=list(frames), row_heights=[h / sum(heights) for h in heights])
    shown: set = set()
    shapes: list = []
    for row, (label, df) in enumerate(frames.items(), start=1):
        for key, arrays in spans_to_bars(df, lanes[label]).items():
            fig.add_trace(_bar(key, arrays, showlegend=key not in shown), row=row, col=1)
            shown.add(key)
        sub = fig.get_subplot(row, 1)
        xref, yref = sub.xaxis.plotly_name.replace("axis", ""), sub.yaxis.plotly_name.replace("axis", "")
        shapes += gantt_shapes(df, _steps_of(logs[label]), lanes[label], xref=xref, yref=yref)
        fig.update_yaxes(_yaxis(lanes[label]), row=row, col=1)
    fig.update_xaxes(type="linear")
    fig.update_xaxes(title_text="t (s)", row=len(frames), col=1)
    fig.update_layout(title=title, barmode="overlay", bargap=0.0, shapes=shapes,
                      height=120 + 60 * len(frames) + 26 * sum(heights), margin={"l": 180, "r": 20, "b": 40})
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
    fig.update_layout(title=title, yaxis_title="throughput (tokens/s)")
    return fig


# --------------------------------------------------------------------------------------------------
# incremental state for live figures
# --------------------------------------------------------------------------------------------------

@dataclass
class GanttState:
    """Accumulates Gantt bar arrays as spans arrive, for live figures (DESIGN.md, "Live widgets").

    Build the figure once with every trace (:meth:`figure`, one per :data:`TRACE_KEYS` entry, empty), then for
    each batch of new spans call :meth:`add` and assign the returned *whole* float64 arrays inside
    ``fig.batch_update()`` (or call :meth:`apply`). ``lanes`` fixes the lane order; workers first seen later
    are inserted in :func:`bidirl.trace.lane_order` position when ``lanes`` was not given, appended otherwise,
    and every stored bar is re-laned.
    """
    lanes: list = field(default_factory=list)
    keys: tuple = TRACE_KEYS
    _fixed: bool = field(default=False, init=False, repr=False)
    _bars: dict = field(default_factory=dict, init=False, repr=False)
    _spans: list = field(default_factory=list, init=False, repr=False)

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

    def spans_df(self) -> pd.DataFrame:
        """Every span added so far (the columns the Gantt needs)."""
        if not self._spans:
            return EventLog().spans_df()
        return pd.concat(self._spans, ignore_index=True)

    def _relane(self, workers: Sequence[str]) -> None:
        new = [w for w in dict.fromkeys(workers) if w not in self.lanes]
        if not new:
            return
        self.lanes = self.lanes + lane_order(new) if self._fixed else lane_order(self.lanes + new)
        index = {w: float(i) for i, w in enumerate(self.lanes)}
        for bars in self._bars.values():
            if len(bars["y"]):
                bars["y"] = np.array([index[w] for w in bars["customdata"][:, 0]], dtype=np.float64)

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
            for key, arrays in spans_to_bars(df, self.lanes).items():
                old = self._bars[key]
                self._bars[key] = {name: np.concatenate([old[name], arrays[name]]) for name in old}
        return self.arrays()

    def arrays(self) -> dict:
        """The current full arrays of every trace (copies are not made; do not mutate them)."""
        return {k: self._bars[k] for k in self.keys}

    def layout(self, steps_df: Optional[pd.DataFrame] = None) -> dict:
        """Layout properties to assign with the arrays: y-axis lanes and the shapes (windows, step ends)."""
        return {"yaxis": _yaxis(self.lanes), "shapes": gantt_shapes(self.spans_df(), steps_df, self.lanes),
                "height": 160 + 26 * max(1, len(self.lanes))}

    def figure(self, title: Optional[str] = None) -> go.Figure:
        """A figure with one (possibly empty) trace per key, in :attr:`keys` order, showing the current state."""
        fig = go.Figure([_bar(k, a) for k, a in self.arrays().items()])
        fig.update_layout(title=title, barmode="overlay", bargap=0.0,
                          xaxis={"type": "linear", "title": {"text": "t (s)"}}, margin={"l": 180, "r": 20, "b": 40},
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
