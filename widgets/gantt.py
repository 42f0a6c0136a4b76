"""``LiveGantt``: a per-worker timeline that grows while simulations advance.

One row per run (e.g. two policies) on a shared time axis; in each row one horizontal ``go.Bar`` trace per
``(kind, role)`` of :data:`bidirl.viz.TRACE_KEYS` — colours by role and kind, borrowing windows (paper §5,
a pool lent to the other stage) shaded, step ends dotted. Every trace exists before the widget is displayed;
updates assign whole float64 arrays from :class:`bidirl.viz.GanttState` inside one ``fig.batch_update()``,
throttled to ``refresh_hz``, and are driven by a poll loop in the calling cell (DESIGN.md, "Lessons from the
anchors: Live widgets": output from background threads is unreliable under ipykernel 7).

The array building lives in :mod:`bidirl.viz`; this module only polls drivers and assigns arrays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ipywidgets as ipw
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.trace import EventLog
from bidirl.viz import TRACE_KEYS, GanttState, gantt_shapes

ROW_GAP = 0.08
WIDTH = 1100          # px; a FigureWidget inside an ipywidgets box does not resize with it (plotly.py#4027)
LANE_PX = 22          # px per worker lane


def _axis_ref(name: str) -> str:
    """``xaxis2`` -> ``x2`` (the reference shapes use)."""
    return name.replace("axis", "")


def _new_spans(log: EventLog, seen: int) -> EventLog:
    """The spans appended to ``log`` since the first ``seen`` (a view, no copy of the old records)."""
    return EventLog(spans=log.spans[seen:])


@dataclass
class LiveGantt:
    """A live Gantt of one or more runs, stacked on one time axis.

    ``labels`` names the rows (one per run, e.g. ``("bidirl", "no-borrow")``); ``lanes`` optionally fixes the
    worker order of a row (``{label: [worker, ...]}``). Display the object (or :attr:`widget`) in a cell, then
    call :meth:`run` with one driver per label, or :meth:`update` with event logs.
    """
    labels: Sequence[str] = ("run",)
    title: Optional[str] = None
    lanes: Optional[Mapping[str, Sequence[str]]] = None
    clock: Callable[[], float] = time.monotonic
    figure: Any = field(init=False, repr=False)
    status: Any = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    states: dict = field(init=False, repr=False)
    redraws: int = field(default=0, init=False)
    _seen: dict = field(default_factory=dict, init=False, repr=False)
    _steps: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.labels = tuple(str(x) for x in self.labels)
        if not self.labels:
            raise ValueError("LiveGantt needs at least one label (one row per run), e.g. labels=('bidirl',)")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"LiveGantt labels must be distinct, got {list(self.labels)}")
        lanes = dict(self.lanes or {})
        unknown = sorted(set(lanes) - set(self.labels))
        if unknown:
            raise ValueError(f"lanes given for unknown label(s) {unknown}; use labels from {list(self.labels)}")
        self.states = {label: GanttState(lanes=list(lanes.get(label, ()))) for label in self.labels}
        self._seen = {label: 0 for label in self.labels}
        self._steps = {label: None for label in self.labels}
        self.figure = go.FigureWidget(self._build())
        self.status = ipw.HTML(value="")
        self.widget = ipw.VBox([self.status, self.figure])

    # ------------------------------------------------------------------------------------------
    def _build(self) -> go.Figure:
        rows = len(self.labels)
        fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=ROW_GAP if rows > 1 else 0.0,
                            subplot_titles=list(self.labels) if rows > 1 else None)
        for row, label in enumerate(self.labels, start=1):
            for trace in self.states[label].figure().data:
                trace.showlegend = row == 1
                fig.add_trace(trace, row=row, col=1)
        fig.update_xaxes(type="linear")
        fig.update_xaxes(title_text="t (s, simulated)", row=rows, col=1)
        fig.update_layout(title=self.title, barmode="overlay", bargap=0.0, margin={"l": 180, "r": 20, "b": 40},
                          legend={"traceorder": "normal"}, width=WIDTH)
        self._refs = []
        for row in range(1, rows + 1):
            sub = fig.get_subplot(row, 1)
            self._refs.append((sub.xaxis.plotly_name, sub.yaxis.plotly_name))
        self._apply_layout(fig)
        return fig

    @property
    def traces_per_row(self) -> int:
        return len(TRACE_KEYS)

    def _domains(self, heights: list) -> list:
        """Vertical ``[bottom, top]`` paper fractions of each row, top row first, sized by its lane count."""
        rows = len(heights)
        usable = 1.0 - ROW_GAP * (rows - 1)
        total, top, out = float(sum(heights)), 1.0, []
        for h in heights:
            bottom = max(0.0, top - usable * h / total)
            out.append([bottom, top])
            top = bottom - ROW_GAP
        return out

    def _apply_layout(self, fig) -> None:
        shapes, heights = [], []
        for (xname, yname), label in zip(self._refs, self.labels):
            state = self.states[label]
            layout = state.layout(self._steps[label])
            fig.layout[yname].update(layout["yaxis"])
            shapes += gantt_shapes(state.spans_df(), self._steps[label], state.lanes,
                                   xref=_axis_ref(xname), yref=_axis_ref(yname))
            heights.append(max(1, len(state.lanes)))
        domains = self._domains(heights)
        titles = list(fig.layout.annotations)
        for row, ((_, yname), domain) in enumerate(zip(self._refs, domains)):
            fig.layout[yname].domain = domain
            if len(self.labels) > 1 and row < len(titles):
                titles[row].y = domain[1]           # the row's subplot title sits on its top edge
        fig.layout.shapes = shapes
        fig.layout.height = 150 + 60 * len(self.labels) + LANE_PX * sum(heights)

    def _redraw(self) -> None:
        """Assign every row's arrays and the layout in one batched message."""
        k = self.traces_per_row
        with self.figure.batch_update():
            for row, label in enumerate(self.labels):
                for j, arrays in enumerate(self.states[label].arrays().values()):
                    trace = self.figure.data[row * k + j]
                    trace.y, trace.base, trace.x = arrays["y"], arrays["base"], arrays["x"]
                    trace.customdata = arrays["customdata"]
            self._apply_layout(self.figure)
        self.redraws += 1

    # ------------------------------------------------------------------------------------------
    def _absorb(self, label: str, log: EventLog) -> int:
        if not isinstance(log, EventLog):
            raise ValueError(f"LiveGantt.update expects EventLog values, got {type(log).__name__} for {label!r}")
        seen = self._seen[label]
        if len(log.spans) < seen:
            raise ValueError(f"the log for {label!r} shrank from {seen} to {len(log.spans)} spans; "
                             "use a new LiveGantt (or reset()) for a new run")
        added = len(log.spans) - seen
        if added:
            self.states[label].add(_new_spans(log, seen))
            self._seen[label] = len(log.spans)
        self._steps[label] = log.steps_df() if log.steps else None
        return added

    def _check_labels(self, mapping: Mapping) -> None:
        unknown = sorted(set(map(str, mapping)) - set(self.labels))
        if unknown:
            raise ValueError(f"no row for label(s) {unknown}; this LiveGantt has rows {list(self.labels)}")

    def update(self, logs: Any) -> int:
        """Add the spans appended since the last call (``{label: EventLog}``, or one log for a one-row Gantt)
        and redraw once. Returns the number of spans added."""
        logs = self._as_mapping(logs, "logs")
        added = sum(self._absorb(str(label), log) for label, log in logs.items())
        self._redraw()
        return added

    def follow(self, log: EventLog, label: Optional[str] = None, refresh_hz: float = 4.0) -> Callable:
        """A callback that shows ``log`` live as it grows: pass it as a Ray driver's ``on_event``
        (``EngineDriver(..., on_event=gantt.follow(driver.log))``). It absorbs the new spans and redraws at most
        ``refresh_hz`` times per wall second; call :meth:`update` with the final log at the end."""
        label = self._as_mapping({label: log} if label is not None else log, "log")
        (label, log), = label.items()
        if not refresh_hz > 0:
            raise ValueError(f"refresh_hz must be > 0 (redraws per wall second), got {refresh_hz}")
        last = [None]

        def on_event(_event=None) -> None:
            now = self.clock()
            if last[0] is None or now - last[0] >= 1.0 / refresh_hz:
                self._absorb(label, log)
                self._redraw()
                last[0] = now
        return on_event

    def reset(self) -> None:
        """Forget every span (keeps the traces, so the displayed widget stays the same object)."""
        lanes = dict(self.lanes or {})
        self.states = {label: GanttState(lanes=list(lanes.get(label, ()))) for label in self.labels}
        self._seen = {label: 0 for label in self.labels}
        self._steps = {label: None for label in self.labels}
        self._redraw()

    def _as_mapping(self, value: Any, what: str) -> dict:
        if isinstance(value, Mapping):
            self._check_labels(value)
            return {str(k): v for k, v in value.items()}
        if len(self.labels) != 1:
            raise ValueError(f"this LiveGantt has rows {list(self.labels)}; pass {what} as a dict keyed by them")
        return {self.labels[0]: value}

    def _status(self, drivers: Mapping) -> str:
        parts = []
        for label, d in drivers.items():
            state = "done" if d.done else "running"
            parts.append(f"<b>{label}</b>: t = {d.now:,.1f} s, step {d.steps_done}/{d.steps} ({state})")
        return " &nbsp;|&nbsp; ".join(parts)

    def run(self, drivers: Any, slice_seconds: float = 5.0, refresh_hz: float = 4.0, *,
            metrics: Any = None, progress: bool = False) -> dict:
        """Advance the driver(s) in slices of ``slice_seconds`` simulated seconds, in lockstep
        (:func:`bidirl.sim.driver.advance_together`), redrawing at most ``refresh_hz`` times per wall second
        and once at the end.

        ``drivers`` is a :class:`bidirl.sim.SimDriver` (one-row Gantt) or ``{label: SimDriver}``.
        Returns ``{label: RunResult}``; with ``metrics`` (a :class:`MetricsPanel`) the results' summaries are
        shown there too.
        """
        from bidirl.execution import progress_bar
        from bidirl.sim.driver import advance_together

        drivers = self._as_mapping(drivers, "drivers")
        if not refresh_hz > 0:
            raise ValueError(f"refresh_hz must be > 0 (redraws per wall second), got {refresh_hz}")
        slices = advance_together(drivers, slice_seconds)
        interval, last = 1.0 / refresh_hz, None
        with progress_bar(sum(d.steps for d in drivers.values()), "simulate", progress) as tick:
            for steps_done in slices:
                for label, d in drivers.items():
                    self._absorb(label, d.log)
                now = self.clock()
                if last is None or now - last >= interval:
                    self.status.value = self._status(drivers)
                    self._redraw()
                    last = now
                tick(steps_done)
        results = {label: d.result() for label, d in drivers.items()}
        for label, r in results.items():
            self._absorb(label, r.log)
        self.status.value = self._status(drivers)
        self._redraw()
        if metrics is not None:
            metrics.update({label: r.summary() for label, r in results.items()})
        return results

    # ------------------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
