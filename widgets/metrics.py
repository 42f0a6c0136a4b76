"""``MetricsPanel``: throughput, idle share per pool and borrow counts of one or more runs.

It shows the ``bidirl simulate --json`` summary (DESIGN.md, "Contracts others rely on"; computed by
:func:`bidirl.metrics.summary`): throughput as the paper defines it (§7.1), idle time per pool from the union
of busy intervals, and the scheduler's borrowing decisions (§5.2: admitted per direction, rejected). The
panel only lays the numbers out; it computes none of them.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import ipywidgets as ipw
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

#: (summary-row column, legend name, colour, subplot column) of each trace, in trace order
SERIES: tuple = (
    ("throughput", "throughput (tokens/s)", "#1f77b4", 1),
    ("idle_rollout_pool", "idle: rollout pool", "#6baed6", 2),
    ("idle_trainer_pool", "idle: trainer pool", "#fdae6b", 2),
    ("borrows_rollout_on_trainer_pool", "borrows: rollout on trainer pool", "#1f77b4", 3),
    ("borrows_trainer_on_rollout_pool", "borrows: trainer on rollout pool", "#ff7f0e", 3),
    ("borrows_rejected", "borrows rejected", "#969696", 3),
)
WIDTH = 1100          # px; a FigureWidget inside an ipywidgets box does not resize with it (plotly.py#4027)
TITLES: tuple = ("throughput (tokens/s)", "idle share of the measured window", "borrows (§5.2)")


def summary_table(summaries: Mapping[str, Mapping]) -> pd.DataFrame:
    """One row per run label with the panel's numbers (:func:`bidirl.metrics.summary_row`)."""
    from bidirl.metrics import SUMMARY_ROW, summary_row
    if not isinstance(summaries, Mapping):
        raise ValueError(f"summaries must be a dict {{label: summary dict}}, got {type(summaries).__name__}")
    rows = []
    for label, s in summaries.items():
        if not isinstance(s, Mapping):
            raise ValueError(f"summaries[{label!r}] must be a summary dict (RunResult.summary()), "
                             f"got {type(s).__name__}")
        rows.append({"label": str(label), **summary_row(s)})
    return pd.DataFrame(rows, columns=["label"] + [name for name, _ in SUMMARY_ROW])


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
    heads = ("run", "throughput (tok/s)", "idle rollout pool", "idle trainer pool", "utilization",
             "borrows R→T pool", "borrows T→R pool", "rejected", "step time (s)")
    kinds = (None, "number", "share", "share", "share", "count", "count", "count", "number")
    cols = ("label", "throughput", "idle_rollout_pool", "idle_trainer_pool", "utilization",
            "borrows_rollout_on_trainer_pool", "borrows_trainer_on_rollout_pool", "borrows_rejected", "step_time_s")
    out = ["<table style='border-collapse:collapse'><tr>"]
    out += [f"<th style='padding:2px 8px;text-align:right'>{h}</th>" for h in heads]
    out.append("</tr>")
    for _, row in table.iterrows():
        out.append("<tr>")
        for col, kind in zip(cols, kinds):
            text = html.escape(str(row[col])) if kind is None else _fmt(float(row[col]), kind)
            out.append(f"<td style='padding:2px 8px;text-align:right'>{text}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


@dataclass
class MetricsPanel:
    """Bars of throughput, idle share per pool and borrows per run label, plus a table of the numbers.

    Call :meth:`update` with ``{label: summary}`` (``SimResult.summary()`` / ``RunResult.summary()``);
    labels accumulate across calls (a label given again replaces its numbers).
    """
    title: Optional[str] = None
    figure: Any = field(init=False, repr=False)
    table: Any = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    summaries: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        fig = make_subplots(rows=1, cols=3, subplot_titles=TITLES, horizontal_spacing=0.08)
        for name, legend, colour, col in SERIES:
            fig.add_trace(go.Bar(name=legend, x=[], y=[], marker_color=colour, meta=name,
                                 showlegend=col != 1,
                                 hovertemplate="%{x}: %{y}<extra>" + legend + "</extra>"), row=1, col=col)
        fig.update_yaxes(tickformat=".0%", rangemode="tozero", row=1, col=2)
        fig.update_yaxes(rangemode="tozero")
        fig.update_layout(title=self.title, barmode="group", height=360, width=WIDTH,
                          margin={"l": 60, "r": 20, "t": 70, "b": 90}, legend={"orientation": "h", "y": -0.25})
        self.figure = go.FigureWidget(fig)
        self.table = ipw.HTML(value="")
        self.widget = ipw.VBox([self.figure, self.table])

    def update(self, summaries: Mapping[str, Mapping]) -> pd.DataFrame:
        """Show these runs' numbers (added to those shown before); returns the table shown."""
        summary_table(summaries)                  # validate before changing anything
        self.summaries.update({str(k): dict(v) for k, v in summaries.items()})
        table = summary_table(self.summaries)
        labels = table["label"].to_numpy(dtype=object)
        with self.figure.batch_update():
            for trace, (name, *_rest) in zip(self.figure.data, SERIES):
                trace.x = labels
                trace.y = table[name].to_numpy(dtype=np.float64)
        self.table.value = table_html(table)
        return table

    def clear(self) -> None:
        """Forget every run (the traces stay; they become empty)."""
        self.summaries.clear()
        with self.figure.batch_update():
            for trace in self.figure.data:
                trace.x, trace.y = [], []
        self.table.value = ""

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
