"""Plotly figure of how the planner's split and the borrowing gain move from dense models to an MoE model
(docs/architecture.md, "MoE"): :func:`dense_moe_figure` draws a
:func:`bidirl.experiments.moe_split.dense_vs_moe` frame.

Three panels, one group of bars per model (dense models first, in the frame's order):

* **split** — the planner's rollout and trainer GPUs, stacked, each labelled with its replica layout (GPUs per
  replica) and, for an MoE model, the trainer's EP degree;
* **idle without borrowing** — each pool's GPU-weighted idle under ``no-borrow``: what borrowing could fill;
* **borrowing gain** — bidirl's simulated throughput over no-borrow's, with the gate's median predicted time saved
  against the switch cost of the windows it weighed: a window is admitted only when the first exceeds the second.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.results.figure_text import title_height, wrapped_title

ROLLOUT = "#54A24B"
TRAINER = "#B279A2"
GAIN = "#4C78A8"
WIDTH = 1000            # px, as the other notebook figures (bidirl.viz.plan, bidirl.viz.gantt)


def _name(row) -> str:
    if row.kind == "MoE":
        return f"{row.model}<br>MoE, {row.params_active_b:.1f} B<br>of {row.params_total_b:.1f} B active"
    return f"{row.model}<br>dense, {row.params_total_b:.1f} B"


def dense_moe_figure(frame: pd.DataFrame, title: str = "") -> go.Figure:
    """The figure of a :func:`~bidirl.experiments.moe_split.dense_vs_moe` frame (module doc)."""
    names = [_name(row) for row in frame.itertuples(index=False)]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("planner's split (GPUs)", "idle without borrowing", "borrowing gain"))
    layouts = [f"{r.rollout_gpus}<br>ρ_r {r.rollout_layout}" for r in frame.itertuples(index=False)]
    trainer_text = [f"{r.trainer_gpus}<br>ρ_t {r.trainer_layout}" + (f"<br>EP {r.trainer_expert_parallel}"
                                                                     if r.trainer_expert_parallel > 1 else "")
                    for r in frame.itertuples(index=False)]
    # stacked by hand (base), so the idle panel's bars can stand side by side (barmode "group")
    fig.add_trace(go.Bar(x=names, y=frame["rollout_gpus"], name="rollout pool", marker_color=ROLLOUT,
                         text=layouts, textposition="inside", textangle=0, legendgroup="rollout", offsetgroup="split"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=frame["trainer_gpus"], base=frame["rollout_gpus"], name="trainer pool",
                         marker_color=TRAINER, text=trainer_text, textposition="inside", textangle=0, legendgroup="trainer",
                         offsetgroup="split"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=frame["rollout_idle"], name="rollout pool idle", marker_color=ROLLOUT,
                         legendgroup="rollout", showlegend=False), row=1, col=2)
    fig.add_trace(go.Bar(x=names, y=frame["trainer_idle"], name="trainer pool idle", marker_color=TRAINER,
                         legendgroup="trainer", showlegend=False), row=1, col=2)
    notes = [f"×{r.gain:.3f}<br>" + (f"{r.borrows} of {r.windows}<br>windows<br>gain {r.window_gain:.1f} s<br>"
                                     f"cost {r.window_cost:.1f} s" if r.windows else "no window")
             for r in frame.itertuples(index=False)]
    fig.add_trace(go.Bar(x=names, y=frame["gain"], name="bidirl / no-borrow throughput (windows admitted; their "
                         "median predicted gain and switch cost)", marker_color=GAIN, text=notes,
                         textposition="inside", insidetextanchor="middle"), row=1, col=3)
    title = title or "dense vs MoE: the planner's split and the borrowing gain (simulated: model predictions)"
    heading = wrapped_title(title, width_px=WIDTH)
    fig.update_layout(barmode="group", template="plotly_white", width=WIDTH, height=520, title=heading,
                      margin={"t": max(90, title_height(heading) + 40), "b": 150, "l": 60, "r": 20},
                      legend={"orientation": "h", "y": -0.3, "x": 0})
    fig.update_xaxes(tickangle=0)
    fig.update_yaxes(title_text="GPUs", row=1, col=1)
    fig.update_yaxes(title_text="GPU-weighted idle", tickformat=".0%", row=1, col=2)
    fig.update_yaxes(title_text="throughput ratio", rangemode="tozero", row=1, col=3)
    return fig
