"""``MetricsPanel``: throughput, idle share per pool and borrow counts of every run shown, with export.

It shows the ``bidirl simulate --json`` summary (DESIGN.md, "Contracts others rely on"; computed by
:func:`bidirl.results.metrics.summary`): throughput as the paper defines it (§7.1, over the throughput window that
drops warm-up and tail steps), the whole run's time beside it, the GPU-weighted idle share per pool and overall
(GPU-seconds idle over GPU-seconds available; each worker's busy time is the union of its busy intervals), and the
scheduler's borrowing decisions (§5.2: admitted per direction, rejected). Every row says
what the run is — simulated, emulated or measured — from the summary's ``provenance``. Runs accumulate: a label
seen before gets a number rather than replacing the earlier run. *clear* forgets them, *export CSV* writes the
table, *export figure* writes the chart as HTML (and PNG where kaleido renders). The panel only lays the
numbers out; it computes none of them.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import ipywidgets as ipw
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.results.metrics import THROUGHPUT_UNIT

#: (summary-row column, legend name, colour, subplot column) of each trace, in trace order
SERIES: tuple = (
    ("throughput", f"throughput ({THROUGHPUT_UNIT})", "#1f77b4", 1),
    ("idle_rollout_pool", "idle (GPU-weighted): rollout pool", "#6baed6", 2),
    ("idle_trainer_pool", "idle (GPU-weighted): trainer pool", "#fdae6b", 2),
    ("idle_overall", "idle (GPU-weighted): all GPUs", "#969696", 2),
    ("borrows_rollout_on_trainer_pool", "borrows: rollout on trainer pool", "#1f77b4", 3),
    ("borrows_trainer_on_rollout_pool", "borrows: trainer on rollout pool", "#ff7f0e", 3),
    ("borrows_rejected", "borrows rejected", "#969696", 3),
)
WIDTH = 1000          # px; a FigureWidget inside an ipywidgets box does not resize with it (plotly.py#4027)
TITLES: tuple = (f"throughput ({THROUGHPUT_UNIT}, §7.1 window)", "idle (GPU-weighted) in the §7.1 window",
                 "borrowing decisions (§5.2)")
#: (column, heading, kind) of the HTML table, in order
TABLE: tuple = (
    ("run", "#", None), ("label", "run (policy · split · model · GPUs · batch · max response · staleness)", None),
    ("provenance", "what", None), ("throughput", f"throughput ({THROUGHPUT_UNIT}, §7.1 window)", "number"),
    ("run_time_s", "whole run (s)", "number"), ("idle_rollout_pool", "idle rollout pool (GPU-weighted)", "share"),
    ("idle_trainer_pool", "idle trainer pool (GPU-weighted)", "share"),
    ("idle_overall", "idle all GPUs (GPU-weighted)", "share"), ("utilization", "GPU utilisation", "share"),
    ("borrows_rollout_on_trainer_pool", "borrows rollout → trainer pool", "count"),
    ("borrows_trainer_on_rollout_pool", "borrows trainer → rollout pool", "count"),
    ("borrows_rejected", "rejected", "count"), ("step_time_s", "median step (s)", "number"),
)


def summary_table(summaries: Mapping[str, Mapping]) -> pd.DataFrame:
    """One row per run label with the panel's numbers (:func:`bidirl.results.metrics.summary_row`), what the run is
    (``provenance``) and the whole run's time (``run_time_s``)."""
    from bidirl.results.metrics import SUMMARY_ROW, run_time, summary_row
    if not isinstance(summaries, Mapping):
        raise ValueError(f"summaries must be a dict {{label: summary dict}}, got {type(summaries).__name__}")
    rows = []
    for i, (label, s) in enumerate(summaries.items(), start=1):
        if not isinstance(s, Mapping):
            raise ValueError(f"summaries[{label!r}] must be a summary dict (RunResult.summary()), "
                             f"got {type(s).__name__}")
        rows.append({"run": i, "label": str(label), "provenance": s.get("provenance") or "not given",
                     **summary_row(s), "run_time_s": run_time(s)})
    return pd.DataFrame(rows, columns=["run", "label", "provenance"] + [name for name, _ in SUMMARY_ROW]
                        + ["run_time_s"])


def _fmt(value: float, kind: str) -> str:
    if not np.isfinite(value):
        return "–"
    if kind == "share":
        return f"{100 * value:.1f} %"
    if kind == "count":
        return f"{int(value)}"
    return f"{value:,.1f}"


def table_html(table: pd.DataFrame) -> str:
    """A small HTML table of :func:`summary_table`'s frame."""
    cell = "padding:2px 8px;text-align:right;vertical-align:top"
    out = ["<table style='border-collapse:collapse;font-size:12px'><tr>"]
    out += [f"<th style='{cell}'>{html.escape(h)}</th>" for _, h, _ in TABLE]
    out.append("</tr>")
    for _, row in table.iterrows():
        out.append("<tr>")
        for col, _, kind in TABLE:
            text = html.escape(str(row[col])) if kind is None else _fmt(float(row[col]), kind)
            align = "text-align:left" if col == "label" else ""
            out.append(f"<td style='{cell};{align}'>{text}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _tick(number: int, label: str) -> str:
    """The chart's short name of a run: its number, policy and split, the first two parts of a
    :func:`bidirl.results.metrics.run_label` (the table has the full label)."""
    return f"{number}: {' · '.join(label.split(' · ')[:2])}"


@dataclass
class MetricsPanel:
    """Bars of throughput, idle share per pool and borrows per run, plus a table of the numbers.

    Call :meth:`add_runs` with ``RunResult`` objects (labelled with their config,
    :func:`bidirl.results.metrics.run_label`) or :meth:`update` with ``{label: summary}``. Runs accumulate;
    ``export_dir`` is where the export buttons write (created on first use).
    """
    title: Optional[str] = None
    export_dir: Any = Path("results") / "exports"
    figure: Any = field(init=False, repr=False)
    table: Any = field(init=False, repr=False)
    status: Any = field(init=False, repr=False)
    buttons: dict = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    summaries: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        fig = make_subplots(rows=1, cols=3, subplot_titles=TITLES, horizontal_spacing=0.08)
        for name, legend, colour, col in SERIES:
            fig.add_trace(go.Bar(name=legend, x=[], y=[], marker_color=colour, meta=name, customdata=[],
                                 showlegend=col != 1,
                                 hovertemplate="%{customdata}<br>" + legend + ": %{y}<extra></extra>"),
                          row=1, col=col)
        fig.update_yaxes(tickformat=".0%", rangemode="tozero", row=1, col=2)
        fig.update_yaxes(rangemode="tozero")
        fig.update_layout(title=self.title, barmode="group", height=380, width=WIDTH,
                          margin={"l": 60, "r": 20, "t": 70, "b": 110},
                          legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom"})
        self.figure = go.FigureWidget(fig)
        self.table = ipw.HTML(value="")
        self.status = ipw.HTML(value="")
        self.buttons = {"clear": ipw.Button(description="clear runs", icon="trash"),
                        "csv": ipw.Button(description="export CSV", icon="download"),
                        "figure": ipw.Button(description="export figure", icon="image",
                                             tooltip="HTML, and PNG where kaleido renders")}
        self.buttons["clear"].on_click(lambda _b: self.clear())
        self.buttons["csv"].on_click(lambda _b: self._report(self.to_csv()))
        self.buttons["figure"].on_click(lambda _b: self._report(self.export_figure()))
        self.widget = ipw.VBox([self.figure, ipw.HBox(list(self.buttons.values()) + [self.status]), self.table])

    # ------------------------------------------------------------------------------------------
    def _fresh_label(self, label: str) -> str:
        """``label``, or ``label (2)``, ``label (3)`` … when a run of that label is already shown."""
        if label not in self.summaries:
            return label
        n = 2
        while f"{label} ({n})" in self.summaries:
            n += 1
        return f"{label} ({n})"

    def update(self, summaries: Mapping[str, Mapping]) -> pd.DataFrame:
        """Show these runs' numbers beside those shown before (a repeated label is numbered, never replaced);
        returns the table shown."""
        summary_table(summaries)                  # validate before changing anything
        for label, s in summaries.items():
            self.summaries[self._fresh_label(str(label))] = dict(s)
        return self._show()

    def add_runs(self, runs: Iterable[Any]) -> pd.DataFrame:
        """Show ``RunResult`` objects, each labelled with its policy and config
        (:func:`bidirl.results.metrics.run_label`)."""
        from bidirl.results.metrics import run_label
        batch: dict = {}
        for r in runs:
            label = run_label(r.config, r.policy)
            n = 2
            base = label
            while label in batch:
                label, n = f"{base} ({n})", n + 1
            batch[label] = r.summary()
        return self.update(batch)

    def _show(self) -> pd.DataFrame:
        table = summary_table(self.summaries)
        ticks = np.array([_tick(n, lbl) for n, lbl in zip(table["run"], table["label"])], dtype=object)
        full = table["label"].to_numpy(dtype=object)
        with self.figure.batch_update():
            for trace, (name, *_rest) in zip(self.figure.data, SERIES):
                trace.x = ticks
                trace.y = table[name].to_numpy(dtype=np.float64)
                trace.customdata = full
        self.table.value = table_html(table)
        return table

    def clear(self) -> None:
        """Forget every run (the traces stay; they become empty)."""
        self.summaries.clear()
        with self.figure.batch_update():
            for trace in self.figure.data:
                trace.x, trace.y, trace.customdata = [], [], []
        self.table.value = ""
        self.status.value = "cleared"

    # ------------------------------------------------------------------------------------------
    def table_frame(self) -> pd.DataFrame:
        """The runs shown, one row each (:func:`summary_table`)."""
        return summary_table(self.summaries)

    def to_csv(self, path: Any = None) -> Path:
        """Write the runs' table as CSV (default ``<export_dir>/runs.csv``); returns the path."""
        path = Path(path) if path is not None else Path(self.export_dir) / "runs.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.table_frame().to_csv(path, index=False)
        return path

    def export_figure(self, path: Any = None) -> dict:
        """Write the chart as HTML (and PNG where kaleido renders), default ``<export_dir>/runs.html``
        (:func:`bidirl.viz.export.export_figure`)."""
        from bidirl.viz.export import export_figure
        return export_figure(go.Figure(self.figure), Path(path) if path is not None
                             else Path(self.export_dir) / "runs.html")

    def _report(self, written: Any) -> None:
        if isinstance(written, dict):
            files = [p for p in (written["html"], written["png"]) if p is not None]
            text = ", ".join(str(p) for p in files) + f" ({written['note']})"
        else:
            text = str(written)
        self.status.value = f"wrote {html.escape(text)}"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
