"""``LiveGantt``: a per-worker timeline that grows while runs advance, with pace, pause and replay.

One row per run (e.g. two policies) on a shared time axis; in each row one horizontal ``go.Bar`` trace per
``(kind, role)`` of :data:`bidirl.viz.gantt.TRACE_KEYS` — colours by role and kind, borrowing windows (paper §5,
a pool lent to the other stage) shaded, step ends dotted, all with plain legend names. Every trace exists
before the widget is displayed; updates assign whole float64 arrays from :class:`bidirl.viz.live.GanttState`
inside one ``fig.batch_update()``, at most ``refresh_hz`` times per wall second, driven by a poll loop in the
calling cell (DESIGN.md, "Lessons from the anchors: Live widgets": output from background threads is
unreliable under ipykernel 7).

* **Pace.** :meth:`LiveGantt.run` advances simulations at ``pace`` simulated seconds per wall second (the
  *pace* control; ``math.inf`` runs flat out), so a run can be watched.
* **Pause and replay.** Once a run has finished (or between runs), the play button replays the event log from
  t = 0 at the chosen pace, the pause button stops it, and the time slider shows the state at any t —
  spans not yet started hidden, running ones cut at t. Replay reads the recorded log; nothing is re-run. The
  last frame of a replay is always the run's end (the Play widget would stop one step short of it, and its ▶
  then does nothing), so every span shows and ▶ starts over.
* **Bounded redraws.** At most ``refresh_hz`` redraws per wall second live and in replay (the play button
  ticks at that rate), and only what changed is sent.
* **Provenance.** The time axis and title say what the run is (simulated, emulated or measured), taken from the
  drivers (:meth:`run`, :meth:`follow` with a driver) or given as ``provenance``.

The array building lives in :mod:`bidirl.viz.gantt`; this module only polls drivers and assigns arrays.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ipywidgets as ipw
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.results.provenance import provenance_text
from bidirl.results.trace import EventLog
from bidirl.viz.gantt import (DIRECTIONS, TEMPLATE, TRACE_KEYS, gantt_shapes, legend_layout, legend_traces,
                              time_axis_title, titled)
from bidirl.viz.live import GanttState

ROW_GAP = 0.08
WIDTH = 1000          # px; a FigureWidget inside an ipywidgets box does not resize with it (plotly.py#4027)
LANE_PX = 22          # px per worker lane
#: pace choices: simulated seconds per wall second (inf: as fast as the machine goes)
PACES: tuple = (1.0, 5.0, 20.0, 50.0, 100.0, 200.0, 500.0, 2000.0, math.inf)
TICK_S = 0.1          # the replay slider's resolution, seconds of run time
LEGEND_EXTRAS = len(DIRECTIONS) + 1


def _axis_ref(name: str) -> str:
    """``xaxis2`` -> ``x2`` (the reference shapes use)."""
    return name.replace("axis", "")


def _new_spans(log: EventLog, seen: int) -> EventLog:
    """The spans appended to ``log`` since the first ``seen`` (a view, no copy of the old records)."""
    return EventLog(spans=log.spans[seen:])


def pace_title(provenance: Optional[str]) -> str:
    """The pace control's label: simulated seconds for a simulation, run seconds for an emulated or measured run
    (whose replay plays recorded time)."""
    return "pace (simulated s per wall s)" if provenance in (None, "simulated") else "replay pace (run s per wall s)"


def _pace_label(pace: float) -> str:
    return "as fast as possible" if math.isinf(pace) else f"{pace:g} s per s"


@dataclass
class LiveGantt:
    """A live Gantt of one or more runs, stacked on one time axis.

    ``labels`` names the rows (one per run, e.g. ``("bidirl", "no-borrow")``); ``lanes`` optionally fixes the
    lane order of a row (``{label: [lane, ...]}``). Display the object (or :attr:`widget`) in a cell, then call
    :meth:`run` with one simulation driver per label, :meth:`follow` for a Ray run, or :meth:`update` with event
    logs. ``pace`` (simulated seconds per wall second) and ``refresh_hz`` (redraws per wall second) bound what a
    browser has to draw; ``clock`` and ``sleep`` are the wall clock (tests replace them).
    """
    labels: Sequence[str] = ("run",)
    title: Optional[str] = None
    lanes: Optional[Mapping[str, Sequence[str]]] = None
    provenance: Optional[str] = None
    pace: float = 100.0
    refresh_hz: float = 2.0
    group_auxiliary: bool = True
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    figure: Any = field(init=False, repr=False)
    status: Any = field(init=False, repr=False)
    controls: dict = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    states: dict = field(init=False, repr=False)
    redraws: int = field(default=0, init=False)
    shown_until: Optional[float] = field(default=None, init=False)
    _seen: dict = field(default_factory=dict, init=False, repr=False)
    _steps: dict = field(default_factory=dict, init=False, repr=False)
    _live: bool = field(default=False, init=False, repr=False)

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
        self._check_rate(self.refresh_hz, "refresh_hz")
        self.pace = self._check_pace(self.pace)
        provenance_text(self.provenance)                       # validates
        self._new_states()
        self.figure = go.FigureWidget(self._build())
        self.status = ipw.HTML(value="")
        self.controls = self._build_controls()
        c = self.controls
        bar = ipw.HBox([c["play"], c["time"], c["clock"], c["pace"]], layout=ipw.Layout(align_items="center"))
        self.widget = ipw.VBox([self.status, bar, self.figure])

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_rate(value: float, name: str) -> None:
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number > 0 (redraws per wall second), got {value!r}")

    @staticmethod
    def _check_pace(pace: float) -> float:
        try:
            pace = float(pace)
        except (TypeError, ValueError):
            raise ValueError(f"pace must be simulated seconds per wall second (> 0, or math.inf), got {pace!r}") \
                from None
        if not pace > 0:
            raise ValueError(f"pace must be simulated seconds per wall second (> 0, or math.inf), got {pace!r}")
        return pace

    def _new_states(self) -> None:
        lanes = dict(self.lanes or {})
        self.states = {label: GanttState(lanes=list(lanes.get(label, ())), group_auxiliary=self.group_auxiliary)
                       for label in self.labels}
        self._seen = {label: 0 for label in self.labels}
        self._steps = {label: None for label in self.labels}
        self.shown_until = None

    def _build(self) -> go.Figure:
        rows = len(self.labels)
        fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=ROW_GAP if rows > 1 else 0.0,
                            subplot_titles=list(self.labels) if rows > 1 else None)
        for row, label in enumerate(self.labels, start=1):
            for trace in self.states[label].figure().data:
                trace.showlegend = False
                fig.add_trace(trace, row=row, col=1)
        for trace in legend_traces():
            trace.showlegend = False
            fig.add_trace(trace, row=1, col=1)
        fig.update_xaxes(type="linear")
        fig.update_xaxes(title_text=time_axis_title(self.provenance), row=rows, col=1)
        fig.update_layout(title=titled(self.title, self.provenance) or None, barmode="overlay", bargap=0.0,
                          width=WIDTH, margin={"l": 230, "r": 20, "t": 70}, template=TEMPLATE)
        self._refs = []
        for row in range(1, rows + 1):
            sub = fig.get_subplot(row, 1)
            self._refs.append((sub.xaxis.plotly_name, sub.yaxis.plotly_name))
        self._apply_layout(fig, None)
        return fig

    def _build_controls(self) -> dict:
        interval = int(round(1000.0 / self.refresh_hz))
        play = ipw.Play(value=0, min=0, max=0, step=self._play_step(self.pace), interval=interval,
                        description="replay", tooltip="replay the recorded run from the event log; pause stops it",
                        show_repeat=False)
        slider = ipw.IntSlider(value=0, min=0, max=0, readout=False, description="time",
                               continuous_update=True, layout=ipw.Layout(width="420px"))
        # linked here, not in the browser (jslink): after a replay the slider stays on the end while the Play widget
        # is back at 0, ready to start over (its own restart-from-the-end rule needs both to agree in the browser)
        play.observe(self._on_play_value, names="value")
        pace = ipw.Dropdown(options=[(_pace_label(p), p) for p in PACES], value=self._nearest_pace(self.pace),
                            description=pace_title(self.provenance), style={"description_width": "initial"},
                            layout=ipw.Layout(width="340px"))
        readout = ipw.HTML(value="t = 0.0 s", layout=ipw.Layout(min_width="210px", margin="0 28px 0 8px"))
        slider.observe(self._on_slider, names="value")
        play.observe(self._on_playing, names="playing")
        pace.observe(self._on_pace, names="value")
        return {"play": play, "time": slider, "clock": readout, "pace": pace}

    @staticmethod
    def _nearest_pace(pace: float) -> float:
        return pace if pace in PACES else min(PACES, key=lambda p: abs(math.log(p / pace)) if math.isfinite(p) else 1e9)

    def _play_step(self, pace: float) -> int:
        """Slider ticks per replay frame: ``pace`` simulated seconds per wall second at ``refresh_hz`` frames."""
        if math.isinf(pace):
            return max(1, int(self.controls["time"].max) // 20) if hasattr(self, "controls") else 1
        top = int(self.controls["time"].max) if hasattr(self, "controls") else 0
        # at most half the run per frame: a replay always shows a frame between its start and its end
        return max(1, min(int(round(pace / self.refresh_hz / TICK_S)), max(1, top // 2)))

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

    def _apply_layout(self, fig, until: Optional[float]) -> None:
        shapes, heights = [], []
        for (xname, yname), label in zip(self._refs, self.labels):
            state = self.states[label]
            layout = state.layout(self._steps[label], until)
            if fig.layout[yname].ticktext != tuple(layout["yaxis"]["ticktext"]) or \
                    fig.layout[yname].range != tuple(layout["yaxis"]["range"]):
                fig.layout[yname].update(layout["yaxis"])
            shapes += gantt_shapes(self._clipped_spans(label, until), self._clipped_steps(label, until), state.lanes,
                                   xref=_axis_ref(xname), yref=_axis_ref(yname), group_auxiliary=self.group_auxiliary)
            heights.append(max(1, len(state.lanes)))
        domains = self._domains(heights)
        titles = list(fig.layout.annotations)
        for row, ((_, yname), domain) in enumerate(zip(self._refs, domains)):
            fig.layout[yname].domain = domain
            if len(self.labels) > 1 and row < len(titles):
                titles[row].y = domain[1]           # the row's subplot title sits on its top edge
        if [s.to_plotly_json() for s in fig.layout.shapes] != [go.layout.Shape(s).to_plotly_json() for s in shapes]:
            fig.layout.shapes = shapes
        names = [t.name for t in fig.data if t.showlegend]
        legend, bottom = legend_layout(names or ["-"], WIDTH)
        fig.layout.legend = legend
        fig.layout.margin.b = bottom
        fig.layout.height = 110 + bottom + 60 * len(self.labels) + LANE_PX * sum(heights)

    def _clipped_spans(self, label: str, until: Optional[float]):
        from bidirl.viz.gantt import clip_spans
        spans = self.states[label].spans_df()
        return spans if until is None else clip_spans(spans, until)

    def _clipped_steps(self, label: str, until: Optional[float]):
        steps = self._steps[label]
        if steps is None or until is None or not len(steps):
            return steps
        return steps[steps["end"] <= until]

    def _redraw(self, until: Optional[float] = None) -> None:
        """Assign every row's arrays (as they stood at ``until`` when given), the legend and the layout in one
        batched message."""
        k = self.traces_per_row
        first_row = {}
        arrays = {label: self.states[label].arrays(until) for label in self.labels}
        for label in self.labels:
            for key, a in arrays[label].items():
                if len(a["x"]) and key not in first_row:
                    first_row[key] = label
        directions, steps = set(), False
        for label in self.labels:
            windows = self._clipped_spans(label, until)
            if len(windows):
                from bidirl.results.metrics import borrow_windows
                directions |= set(borrow_windows(windows)["direction"])
            clipped = self._clipped_steps(label, until)
            steps = steps or (clipped is not None and len(clipped) > 0)
        with self.figure.batch_update():
            for row, label in enumerate(self.labels):
                for j, (key, a) in enumerate(arrays[label].items()):
                    trace = self.figure.data[row * k + j]
                    trace.y, trace.base, trace.x = a["y"], a["base"], a["x"]
                    trace.customdata = a["customdata"]
                    trace.showlegend = first_row.get(key) == label
            extras = self.figure.data[len(self.labels) * k:]
            for trace, direction in zip(extras, DIRECTIONS):
                trace.showlegend = direction in directions
            extras[-1].showlegend = steps
            self._apply_layout(self.figure, until)
        self.redraws += 1
        self.shown_until = until

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
        """Add the spans appended since the last call (``{label: EventLog or RunResult}``, or one for a one-row
        Gantt), redraw once and make the whole run replayable. Returns the number of spans added."""
        logs = self._as_mapping(logs, "logs")
        added = 0
        for label, log in logs.items():
            self._set_provenance(getattr(log, "provenance", None))
            added += self._absorb(str(label), getattr(log, "log", log))
        self._finish()
        return added

    def follow(self, source: Any, label: Optional[str] = None, refresh_hz: Optional[float] = None) -> Callable:
        """A callback that shows a growing log live: pass it as a Ray driver's ``on_event``
        (``driver.on_event = gantt.follow(driver)``). ``source`` is the driver (its log and provenance label the
        row) or an ``EventLog``. It absorbs the new spans and redraws at most ``refresh_hz`` times per wall second;
        call :meth:`update` with the final result at the end."""
        log = getattr(source, "log", source)
        self._set_provenance(getattr(source, "provenance", None))
        mapping = self._as_mapping({label: log} if label is not None else log, "log")
        (label, log), = mapping.items()
        refresh_hz = self.refresh_hz if refresh_hz is None else refresh_hz
        self._check_rate(refresh_hz, "refresh_hz")
        last = [None]

        def on_event(_event=None) -> None:
            now = self.clock()
            if last[0] is None or now - last[0] >= 1.0 / refresh_hz:
                self._absorb(label, log)
                self._show_head()
                last[0] = now
        return on_event

    def reset(self) -> None:
        """Forget every span (keeps the traces, so the displayed widget stays the same object)."""
        self._new_states()
        self._redraw()
        self._set_slider(0.0, 0.0)

    def _as_mapping(self, value: Any, what: str) -> dict:
        if isinstance(value, Mapping):
            self._check_labels(value)
            return {str(k): v for k, v in value.items()}
        if len(self.labels) != 1:
            raise ValueError(f"this LiveGantt has rows {list(self.labels)}; pass {what} as a dict keyed by them")
        return {self.labels[0]: value}

    def _set_provenance(self, provenance: Optional[str]) -> None:
        """Label the figure with what the runs are; a second, different provenance is refused (one time axis)."""
        if provenance is None or provenance == self.provenance:
            return
        if self.provenance is not None and any(self._seen.values()):
            raise ValueError(f"this LiveGantt shows {self.provenance} runs; a {provenance} run needs its own")
        provenance_text(provenance)
        self.provenance = provenance
        with self.figure.batch_update():
            self.figure.layout.title = titled(self.title, provenance) or None
            self.figure.update_xaxes(title_text=time_axis_title(provenance), row=len(self.labels), col=1)
        self.controls["pace"].description = pace_title(provenance)

    # ------------------------------------------------------------------------------------------
    # live runs and replay
    # ------------------------------------------------------------------------------------------
    @property
    def end(self) -> float:
        """The latest span end of any row (the replay's last frame)."""
        return max((s.end for s in self.states.values()), default=0.0)

    @contextlib.contextmanager
    def _holding(self):
        """Slider changes made by the widget itself do not redraw (the caller already did)."""
        self._live = True
        try:
            yield
        finally:
            self._live = False

    def _set_slider(self, t: float, end: float) -> None:
        c = self.controls
        with self._holding():
            top = int(math.ceil(end / TICK_S - 1e-9))     # 687.5 s is 6875 ticks, not ceil(6875.000000000001)
            c["play"].max = c["time"].max = top          # both ends first, so no value is clamped to an old one
            # at the end both sit on the last tick (ceil): that is where ▶ starts over from, so the Play widget's
            # own value is set too, not left to the browser's link
            value = top if t >= end else min(int(round(t / TICK_S)), top)
            c["time"].value = value
            c["play"].value = 0 if value >= top else value
            c["play"].step = self._play_step(c["pace"].value)
            c["clock"].value = f"t = {t:,.1f} s of {end:,.1f} s"

    def _show_head(self, now: Optional[float] = None) -> None:
        """Draw everything so far; the readout says ``now`` (the drivers' clock in a live run, which the status
        line shows too) or else the latest span end."""
        self._redraw()
        t = self.end if now is None else max(float(now), self.end)
        self._set_slider(t, t)

    def _finish(self) -> None:
        """After a run: draw everything, fix the time axis on the whole run and arm the replay controls."""
        self._redraw()
        self._set_slider(self.end, self.end)

    def show(self, t: float) -> None:
        """Draw the runs as they stood at time ``t`` (seconds of run time): replay from the event log."""
        t = min(max(0.0, float(t)), self.end)
        self._redraw(until=t)
        self.controls["clock"].value = f"t = {t:,.1f} s of {self.end:,.1f} s"

    def _on_slider(self, change) -> None:
        if self._live:
            return
        play = self.controls["play"]
        new = change["new"]
        # The Play widget pauses when its next step would pass the end, short of it, and its ▶ then does nothing
        # (it starts over only from the end): shorten the last step so the last frame is the end.
        if play.playing and new < play.max and new + play.step > play.max:
            play.step = play.max - new
        elif new >= play.max:
            play.step = self._play_step(self.controls["pace"].value)
        if not play.playing:                   # dragged: ▶ goes on from here (from 0 at the end)
            with self._holding():
                play.value = 0 if new >= play.max else new
        self.show(new * TICK_S)

    def _on_play_value(self, change) -> None:
        if self._live:
            return
        self.controls["time"].value = change["new"]

    def _on_playing(self, change) -> None:
        """When a replay stops: the pace's step again, and, where ▶ was pressed within one step of the end (the
        widget then pauses at once without moving), the end shown, so the next ▶ starts over from 0."""
        play, slider = self.controls["play"], self.controls["time"]
        if change["new"]:
            return
        play.step = self._play_step(self.controls["pace"].value)
        if play.value < play.max and play.value + play.step > play.max:
            slider.value = slider.max
        if slider.value >= slider.max:
            with self._holding():
                play.value = 0                 # the end is shown; the next ▶ starts over from 0

    def _on_pace(self, change) -> None:
        self.pace = change["new"]
        self.controls["play"].step = self._play_step(self.pace)

    def _status(self, drivers: Mapping) -> str:
        parts = []
        for label, d in drivers.items():
            state = "done" if d.done else "running"
            parts.append(f"<b>{label}</b>: t = {d.now:,.1f} s, step {d.steps_done}/{d.steps} ({state})")
        pace = "" if math.isinf(self.pace) else f" &nbsp;·&nbsp; pace {self.pace:g} simulated s per wall s"
        return " &nbsp;|&nbsp; ".join(parts) + pace

    def run(self, drivers: Any, slice_seconds: Optional[float] = None, refresh_hz: Optional[float] = None, *,
            pace: Optional[float] = None, metrics: Any = None, progress: bool = False) -> dict:
        """Advance the simulation(s) in lockstep (:func:`bidirl.sim.driver.advance_together`) at ``pace``
        simulated seconds per wall second (default: the *pace* control; ``math.inf``: flat out), redrawing at
        most ``refresh_hz`` times per wall second and once at the end; then the replay controls cover the run.

        ``drivers`` is a :class:`bidirl.sim.SimDriver` (one-row Gantt) or ``{label: SimDriver}``;
        ``slice_seconds`` (simulated) defaults to one redraw's worth at the pace. Returns ``{label: RunResult}``;
        with ``metrics`` (a :class:`MetricsPanel`) the results are shown there too, labelled with their config.
        """
        from bidirl.runtime.driver import progress_bar
        from bidirl.sim.driver import advance_together

        drivers = self._as_mapping(drivers, "drivers")
        refresh_hz = self.refresh_hz if refresh_hz is None else refresh_hz
        self._check_rate(refresh_hz, "refresh_hz")
        pace = self._check_pace(self.controls["pace"].value if pace is None else pace)
        self.pace = pace
        if slice_seconds is None:
            slice_seconds = 10.0 if math.isinf(pace) else pace / refresh_hz
        slices = advance_together(drivers, slice_seconds)
        for d in drivers.values():
            self._set_provenance(getattr(d, "provenance", None))
        interval, last = 1.0 / refresh_hz, None
        began, sim0 = self.clock(), min(d.now for d in drivers.values())
        with progress_bar(sum(d.steps for d in drivers.values()), "simulate", progress) as tick:
            for steps_done in slices:
                for label, d in drivers.items():
                    self._absorb(label, d.log)
                if not math.isinf(pace):
                    ahead = (max(d.now for d in drivers.values()) - sim0) / pace - (self.clock() - began)
                    if ahead > 0:
                        self.sleep(ahead)
                now = self.clock()
                if last is None or now - last >= interval:
                    self.status.value = self._status(drivers)
                    self._show_head(max(d.now for d in drivers.values()))
                    last = now
                tick(steps_done)
        results = {label: d.result() for label, d in drivers.items()}
        for label, r in results.items():
            self._absorb(label, r.log)
        self.status.value = self._status(drivers)
        self._finish()
        if metrics is not None:
            metrics.add_runs(results.values())
        return results

    # ------------------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
