"""The state of a Gantt that grows while a run goes on, and its replay: :class:`GanttState` accumulates the bar
arrays of :mod:`bidirl.viz.gantt` as spans arrive (the widgets assign them inside ``fig.batch_update()``) and
clips them at a time ``t``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from bidirl.results.trace import EventLog, lane_order
from bidirl.viz.gantt import (COLORS, TEMPLATE, TRACE_KEYS, bar_trace, clip_bars, clip_spans, empty_bars,
                              gantt_shapes, lane_axis, lane_of, spans_table, spans_to_bars)

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
        self._bars = {k: empty_bars() for k in self.keys}

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
        df = spans_table(spans_df_new)
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
        return {"yaxis": lane_axis(self.lanes, sorted(self._workers)),
                "shapes": gantt_shapes(spans, steps_df, self.lanes, group_auxiliary=self.group_auxiliary),
                "height": 160 + 26 * max(1, len(self.lanes))}

    def figure(self, title: Optional[str] = None) -> go.Figure:
        """A figure with one (possibly empty) trace per key, in :attr:`keys` order, showing the current state."""
        fig = go.Figure([bar_trace(k, a) for k, a in self.arrays().items()])
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
