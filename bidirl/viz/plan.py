"""Plotly figure of the planner's partition sweep (paper §4, Algorithm 1; §7.4 Fig. eval-static a/b).

``sweep_figure(plan, simulated=None)`` draws, for every candidate split in sweep order, the predicted pipeline
rate λ_pipe = min(λ_r, λ_t) as bars and the rollout rate λ_r and trainer rate λ_t as lines, all in
:data:`bidirl.results.metrics.RATE_UNIT`. Bars are blue for hot-switch compatible splits, grey for the others
(they cannot lend a pool without resharding, §4.1) and orange for the planner's choice, whose column is
shaded; a split whose pool cannot hold one replica of a stage ("does not fit") gets a red × at zero instead of
a rate. With ``simulated`` (a :func:`bidirl.sim.sweep.simulate_partitions` frame) the simulated rate of each
split is drawn beside the prediction — the paper's static-sweep figure. Every colour and shading has a legend
entry.

The figure always has the same traces, in :data:`TRACE_NAMES` order, with one point per sweep row in the
first five (legend-only entries after them; the pipeline-rate bars have none, their colours do), so a live
widget can copy a new sweep into existing traces and map a clicked point back to its sweep row.

The x axis is linear, with the splits at positions 0 … n−1 and their labels as tick text: plotly.js
re-guesses a category axis' type whenever a trace is restyled, and labels such as ``10-6`` then read as
dates, so numeric positions keep every live update on a linear axis.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from bidirl.results.figure_text import title_height, wrapped_title
from bidirl.results.metrics import RATE_UNIT

COMPATIBLE = "#4C78A8"
INCOMPATIBLE = "#C8C8C8"
CHOSEN = "#F58518"
ROLLOUT = "#54A24B"
TRAINER = "#B279A2"
SIMULATED = "#222222"
NO_FIT = "#B00020"
CHOICE_FILL = "rgba(245, 133, 24, 0.12)"
SELECTED_FILL = "rgba(255, 215, 0, 0.22)"
SPLIT_AXIS = "split (rollout GPUs-trainer GPUs)"
#: the traces every sweep figure has, in this order
TRACE_NAMES = ("predicted pipeline rate λ_pipe", "predicted rollout rate λ_r", "predicted trainer rate λ_t",
               "simulated rate", "a stage does not fit its pool (no rate)",
               "bar: compatible split", "bar: not hot-switch compatible", "bar / column: planner's choice",
               "column: split selected to simulate")
WIDTH = 1000


def _finite(values) -> list:
    arr = np.asarray(values, dtype=float)
    return [float(v) if np.isfinite(v) and v > 0 else None for v in arr]


def _legend_only(name: str, color: str, symbol: str = "square") -> go.Scatter:
    return go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                      marker={"symbol": symbol, "size": 14, "color": color}, meta="legend")


def no_fit_text(plan, row) -> Optional[str]:
    """Why a sweep row has no rate (a pool smaller than one replica of its stage), or ``None``."""
    env = plan.envelope
    if int(row["rollout_replicas"]) == 0:
        return (f"rollout does not fit: {int(row['rollout_gpus'])} GPUs hold no rollout replica of "
                f"{env.rollout_layout} GPUs")
    if int(row["trainer_replicas"]) == 0:
        return (f"trainer does not fit: {int(row['trainer_gpus'])} GPUs hold no trainer replica of "
                f"{env.trainer_layout} GPUs")
    return None


def simulated_rates(sweep: pd.DataFrame, simulated: Optional[pd.DataFrame]) -> tuple:
    """``(rates, notes)`` aligned with the sweep rows: the simulated rate (None where not simulated or not ok)
    and a hover note per row."""
    n = len(sweep)
    rates, notes = [None] * n, [""] * n
    if simulated is None or not len(simulated):
        return rates, notes
    by_label = {str(r["label"]): r for _, r in simulated.iterrows()}
    for i, label in enumerate(sweep["label"].astype(str)):
        r = by_label.get(label)
        if r is None:
            continue
        if r["status"] == "ok" and np.isfinite(float(r["rate"])):
            rates[i] = float(r["rate"])
            notes[i] = (f"simulated ({r['policy']}, {int(r['steps'])} steps): {float(r['rate']):.4g} {RATE_UNIT}, "
                        f"{float(r['throughput']):,.0f} tokens/s")
        else:
            notes[i] = f"simulated ({r['policy']}): {r['status']} — {r['reason']}"
    return rates, notes


def simulated_note(simulated: Optional[pd.DataFrame]) -> str:
    """The title's note on the simulated rates drawn, if any."""
    if simulated is None or not len(simulated):
        return ""
    first = simulated.iloc[0]
    return f", beside the simulated rate ({first['policy']}, {int(first['steps'])} steps per split)"


def sweep_figure(plan, simulated: Optional[pd.DataFrame] = None, selected: Optional[int] = None) -> go.Figure:
    """The sweep of ``plan`` (a :class:`bidirl.job.planner.Plan`) as a figure (module doc); ``simulated`` adds the
    simulated rate per split, ``selected`` (a sweep row index) shades the split selected to simulate. The legend
    lists only what the chart shows (:func:`legend_shown`)."""
    sweep = plan.sweep.reset_index(drop=True)
    env = plan.envelope
    cfg = plan.config
    labels = sweep["label"].astype(str).tolist()
    x = np.arange(len(labels), dtype=np.float64)
    ok = sweep["compatible"].to_numpy(dtype=bool)
    chosen = sweep["chosen"].to_numpy(dtype=bool)
    bar_colors = np.where(chosen, CHOSEN, np.where(ok, COMPATIBLE, INCOMPATIBLE)).tolist()
    no_fit = [no_fit_text(plan, row) for _, row in sweep.iterrows()]
    sim_rates, sim_notes = simulated_rates(sweep, simulated)
    custom = np.stack([sweep["label"].astype(str),
                       np.where(ok, "hot-switch compatible", "not hot-switch compatible"),
                       sweep["rollout_time"].map(lambda v: f"{v:.3g} s" if np.isfinite(v) else "—"),
                       sweep["trainer_time"].map(lambda v: f"{v:.3g} s" if np.isfinite(v) else "—"),
                       [t or "" for t in no_fit], sim_notes], axis=1)
    hover = (f"%{{customdata[0]}} ({SPLIT_AXIS}), %{{customdata[1]}}<br>%{{fullData.name}}: %{{y:.4g}} {RATE_UNIT}"
             "<br>predicted stage times: M_r = %{customdata[2]}, M_t = %{customdata[3]}"
             "<br>%{customdata[4]}%{customdata[5]}<extra></extra>")
    fig = go.Figure()
    fig.add_trace(go.Bar(name=TRACE_NAMES[0], x=x, y=_finite(sweep["pipeline_rate"]), customdata=custom,
                         marker={"color": bar_colors}, hovertemplate=hover, showlegend=False))
    for name, col, color in ((TRACE_NAMES[1], "rollout_rate", ROLLOUT), (TRACE_NAMES[2], "trainer_rate", TRAINER)):
        fig.add_trace(go.Scatter(name=name, x=x, y=_finite(sweep[col]), customdata=custom, mode="lines+markers",
                                 line={"color": color, "width": 1.5},
                                 marker={"color": np.where(ok, color, INCOMPATIBLE).tolist(), "size": 6},
                                 hovertemplate=hover))
    fig.add_trace(go.Scatter(name=TRACE_NAMES[3], x=x, y=sim_rates, customdata=custom, mode="markers",
                             marker={"symbol": "diamond", "size": 11, "color": SIMULATED,
                                     "line": {"color": "white", "width": 1}},
                             hovertemplate=hover))
    fit_y = [0.0 if t else None for t in no_fit]
    fig.add_trace(go.Scatter(name=TRACE_NAMES[4], x=x, y=fit_y, customdata=custom, mode="markers",
                             marker={"symbol": "x", "size": 12, "color": NO_FIT},
                             hovertemplate="%{customdata[0]}: %{customdata[4]}<extra></extra>"))
    fig.add_trace(_legend_only(TRACE_NAMES[5], COMPATIBLE))
    fig.add_trace(_legend_only(TRACE_NAMES[6], INCOMPATIBLE))
    fig.add_trace(_legend_only(TRACE_NAMES[7], CHOSEN))
    fig.add_trace(_legend_only(TRACE_NAMES[8], SELECTED_FILL.replace("0.22", "0.6")))
    shown = legend_shown(ok, chosen, sim_rates, no_fit, selected)
    for trace, show in zip(fig.data, shown):
        if show is not None:
            trace.showlegend = show
    i = int(np.nonzero(chosen)[0][0]) if chosen.any() else None
    shapes, notes = [], []
    if i is not None:
        shapes.append(go.layout.Shape(type="rect", xref="x", yref="paper", x0=i - 0.5, x1=i + 0.5, y0=0, y1=1,
                                      fillcolor=CHOICE_FILL, line={"width": 0}, layer="below", name="choice"))
        how = "fixed by cluster.partition" if plan.fixed else "planner's choice"
        notes.append(go.layout.Annotation(x=float(i), y=1.0, xref="x", yref="paper", yanchor="bottom", showarrow=False,
                                          text=f"{how}: {env.label}<br>λ_pipe = {env.pipeline_rate:.3g} {RATE_UNIT}"))
    title = wrapped_title(f"Partition sweep, predicted by the stage-time models{simulated_note(simulated)}",
                          f"{cfg.model} on {cfg.cluster.gpus} × {cfg.hardware} ({cfg.cluster.placement} placement), "
                          f"{cfg.workload.prompts_per_step} prompts × {cfg.workload.group_size} per step, "
                          f"max response {cfg.workload.max_response_len} tokens", width_px=WIDTH)
    fig.update_layout(
        title=title,
        xaxis={"title": SPLIT_AXIS, "type": "linear", "tickmode": "array",
               "tickvals": list(range(len(labels))), "ticktext": labels, "range": [-0.5, len(labels) - 0.5],
               "zeroline": False},
        yaxis={"title": f"rate ({RATE_UNIT})", "rangemode": "tozero"},
        barmode="overlay", shapes=shapes, annotations=notes, template="plotly_white", width=WIDTH, height=520,
        legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom", "x": 0.0, "xanchor": "left"},
        margin={"t": max(100, title_height(title) + 40), "b": 130, "l": 70, "r": 20},   # + the choice's note
    )
    fig.layout.shapes = list(fig.layout.shapes) + selected_shape(selected)
    return fig


def legend_shown(compatible, chosen, sim_rates, no_fit, selected: Optional[int]) -> list:
    """Per trace of :data:`TRACE_NAMES`: whether its legend entry shows (``None``: the trace has none, the
    λ_pipe bars), true only where the chart has what it names — a simulated rate, a split that does not fit,
    bars of each colour, a selected split."""
    compatible, chosen = np.asarray(compatible, bool), np.asarray(chosen, bool)
    return [None, True, True, any(v is not None and np.isfinite(v) for v in sim_rates), any(no_fit),
            bool((compatible & ~chosen).any()), bool((~compatible).any()), bool(chosen.any()), selected is not None]


def selected_shape(index: Optional[int]) -> list:
    """The shading of the split selected for simulation (a widget adds it to the figure's shapes)."""
    if index is None:
        return []
    return [go.layout.Shape(type="rect", xref="x", yref="paper", x0=index - 0.5, x1=index + 0.5, y0=0, y1=1,
                            fillcolor=SELECTED_FILL, line={"width": 0}, layer="below", name="selected")]
