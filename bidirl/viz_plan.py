"""Plotly figure of the planner's partition sweep (paper §4, Algorithm 1; §6.4 Fig. eval-static a/b).

``sweep_figure(plan)`` draws, for every candidate partition in sweep order, the predicted pipeline rate
λ_pipe = min(λ_r, λ_t) as bars and the rollout rate λ_r and trainer rate λ_t as lines. Hot-switch incompatible
candidates are grey; the envelope is highlighted (orange bar, shaded column named ``"choice"`` and an
annotation). The figure always has the same three traces, in this order — pipeline, rollout, trainer — with
one point per sweep row, so a live widget can copy a new sweep into existing traces and map a clicked point
back to its sweep row.

The x axis is linear, with the partitions at positions 0 … n−1 and their labels as tick text: plotly.js
re-guesses a category axis' type whenever a trace is restyled, and labels such as ``10-6`` then read as
dates, so numeric positions keep every live update on a linear axis.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

COMPATIBLE = "#4C78A8"
INCOMPATIBLE = "#C8C8C8"
CHOSEN = "#F58518"
ROLLOUT = "#54A24B"
TRAINER = "#B279A2"
TRACE_NAMES = ("pipeline rate λ_pipe", "rollout rate λ_r", "trainer rate λ_t")


def _finite(values) -> list:
    arr = np.asarray(values, dtype=float)
    return [float(v) if np.isfinite(v) else None for v in arr]


def sweep_figure(plan) -> go.Figure:
    """The sweep of ``plan`` (a :class:`bidirl.planner.Plan`) as a figure (module doc)."""
    sweep = plan.sweep.reset_index(drop=True)
    env = plan.envelope
    cfg = plan.config
    labels = [f"{int(a)}-{int(b)}" for a, b in zip(sweep["rollout_gpus"], sweep["trainer_gpus"])]
    x = np.arange(len(labels), dtype=np.float64)
    ok = sweep["compatible"].to_numpy(dtype=bool)
    chosen = sweep["chosen"].to_numpy(dtype=bool)
    bar_colors = np.where(chosen, CHOSEN, np.where(ok, COMPATIBLE, INCOMPATIBLE)).tolist()
    custom = np.stack([sweep["label"].astype(str), np.where(ok, "compatible", "incompatible"),
                       sweep["rollout_time"].map(lambda v: f"{v:.3g} s"),
                       sweep["trainer_time"].map(lambda v: f"{v:.3g} s")], axis=1)
    hover = ("%{customdata[0]} (%{customdata[1]})<br>%{fullData.name}: %{y:.4g} groups/s"
             "<br>M_r = %{customdata[2]}, M_t = %{customdata[3]}<extra></extra>")
    fig = go.Figure()
    fig.add_trace(go.Bar(name=TRACE_NAMES[0], x=x, y=_finite(sweep["pipeline_rate"]), customdata=custom,
                         marker={"color": bar_colors}, hovertemplate=hover))
    for name, col, color in ((TRACE_NAMES[1], "rollout_rate", ROLLOUT), (TRACE_NAMES[2], "trainer_rate", TRAINER)):
        fig.add_trace(go.Scatter(name=name, x=x, y=_finite(sweep[col]), customdata=custom, mode="lines+markers",
                                 line={"color": color, "width": 1.5},
                                 marker={"color": np.where(ok, color, INCOMPATIBLE).tolist(), "size": 6},
                                 hovertemplate=hover))
    i = int(np.nonzero(chosen)[0][0]) if chosen.any() else None
    shapes, notes = [], []
    if i is not None:
        shapes.append(go.layout.Shape(type="rect", xref="x", yref="paper", x0=i - 0.5, x1=i + 0.5, y0=0, y1=1,
                                      fillcolor="rgba(245, 133, 24, 0.12)", line={"width": 0}, layer="below",
                                      name="choice"))
        how = "fixed by cluster.partition" if plan.fixed else "planner's choice"
        notes.append(go.layout.Annotation(x=float(i), y=1.0, xref="x", yref="paper", yanchor="bottom", showarrow=False,
                                          text=f"{how}: {env.label}<br>λ_pipe = {env.pipeline_rate:.3g} groups/s"))
    fig.update_layout(
        title=(f"Partition sweep: {cfg.model} on {cfg.cluster.gpus} × {cfg.hardware} ({cfg.cluster.placement}), "
               f"{cfg.workload.prompts_per_step} prompts × {cfg.workload.group_size}, "
               f"max response {cfg.workload.max_response_len}"),
        xaxis={"title": "partition (rollout GPUs - trainer GPUs)", "type": "linear", "tickmode": "array",
               "tickvals": list(range(len(labels))), "ticktext": labels, "range": [-0.5, len(labels) - 0.5],
               "zeroline": False},
        yaxis={"title": "predicted rate (prompt groups / s)", "rangemode": "tozero"},
        barmode="overlay", shapes=shapes, annotations=notes, template="plotly_white",
        legend={"orientation": "h", "y": -0.2}, margin={"t": 90},
    )
    return fig
