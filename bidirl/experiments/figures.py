"""Plotly figures of the reproduced panels (the paper's Fig. eval-main, eval-ablation and eval-static).

Bars show raw throughput per policy, as the paper's figures do; a point a baseline cannot run is marked ×
and a failed run "failed" (both excluded from speedups). Static-planning panels compare the simulated
throughput of each partition with the planner's prediction, both normalised to their maximum; stage-model
panels compare observed and predicted stage times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from bidirl.experiments.specs import PanelSpec

POLICY_COLORS = {"bidirl": "#d62728", "verl-colocated": "#7f7f7f", "verl-async": "#1f77b4", "areal": "#2ca02c",
                 "roll": "#9467bd", "no-borrow": "#8c564b", "rot-only": "#17becf", "tor-only": "#bcbd22",
                 "opportunistic": "#ff7f0e"}


def _range_text(values) -> str:
    v = [x for x in values if np.isfinite(x)]
    return f"{min(v):.2f}x–{max(v):.2f}x" if v else "n/a"


def panel_figure(spec: PanelSpec, results: pd.DataFrame, speedup_table: Optional[pd.DataFrame] = None) -> go.Figure:
    """Grouped throughput bars (one trace per policy) with × for unsupported and 'failed' for failed cells."""
    df = results[results["panel"] == spec.id]
    labels = [p.label for p in spec.points if p.label in set(df["point"])]
    fig = go.Figure()
    annotations = []
    for policy in spec.policies:
        sub = df[df["policy"] == policy].set_index("point")
        y = [float(sub.at[l, "throughput"]) if l in sub.index and sub.at[l, "status"] == "ok" else None
             for l in labels]
        fig.add_trace(go.Bar(name=policy, x=labels, y=y, marker_color=POLICY_COLORS.get(policy),
                             offsetgroup=policy, hovertemplate=f"{policy}<br>%{{x}}: %{{y:.0f}} tok/s<extra></extra>"))
        for l in labels:
            if l in sub.index and sub.at[l, "status"] != "ok":
                mark = "×" if sub.at[l, "status"] == "unsupported" else "failed"
                annotations.append((l, policy, mark, str(sub.at[l, "reason"])))
    title = spec.title
    if speedup_table is not None and len(speedup_table):
        sp = speedup_table[speedup_table["panel"] == spec.id]["speedup"].astype(float)
        title += f" — BiDiRL speedup {_range_text(sp)}"
    fig.update_layout(title=title, barmode="group", xaxis_title=spec.variable,
                      yaxis_title="throughput (tokens/s)" if spec.metric == "throughput"
                      else "total-run throughput (tokens/s)", legend_title="policy", template="plotly_white")
    # unsupported / failed marks: one invisible-marker scatter trace keeps hover text without per-cell traces
    if annotations:
        fig.add_trace(go.Scatter(x=[a[0] for a in annotations], y=[0] * len(annotations), mode="text",
                                 text=[a[2] for a in annotations], textposition="top center",
                                 hovertext=[f"{a[1]}: {a[3]}" for a in annotations], hoverinfo="text",
                                 name="× unsupported / failed"))
    return fig


def static_figure(spec: PanelSpec, results: pd.DataFrame, sweep: Optional[pd.DataFrame]) -> go.Figure:
    """Simulated vs planner-predicted throughput per partition, each normalised to its maximum."""
    fig = go.Figure()
    df = results[(results["panel"] == spec.id) & (results["status"] == "ok")]
    labels = [p.label for p in spec.points]
    if len(df):
        tp = df.groupby("point")["throughput"].max()
        y = [tp.get(l, np.nan) for l in labels]
        m = np.nanmax(y) if np.isfinite(y).any() else 1.0
        fig.add_trace(go.Bar(name="simulated (no-borrow)", x=labels, y=[v / m for v in y], marker_color="#1f77b4"))
    if sweep is not None and len(sweep):
        rate = {f"{int(r)}-{int(t)}": v for r, t, v in zip(sweep["rollout_gpus"], sweep["trainer_gpus"],
                                                          sweep["pipeline_rate"])}
        y = [rate.get(l, np.nan) for l in labels]
        m = np.nanmax(y) if np.isfinite(y).any() else 1.0
        fig.add_trace(go.Scatter(name="planner λ_pipe", x=labels, y=[v / m for v in y], mode="lines+markers",
                                 marker_color="#d62728"))
    fig.update_layout(title=spec.title, xaxis_title="partition (rollout-trainer GPUs)",
                      yaxis_title="relative throughput", template="plotly_white")
    return fig


def stage_figure(spec: PanelSpec, records: pd.DataFrame) -> go.Figure:
    """Observed and predicted stage time per x value, one pair of curves per max response length."""
    fig = go.Figure()
    if records is not None and len(records):
        for length, sub in records.groupby("max_response_len"):
            agg = sub.groupby("x")[["observed", "predicted"]].mean().sort_index()
            fig.add_trace(go.Scatter(name=f"observed {length // 1024}K", x=agg.index, y=agg["observed"],
                                     mode="markers"))
            fig.add_trace(go.Scatter(name=f"predicted {length // 1024}K", x=agg.index, y=agg["predicted"],
                                     mode="lines"))
    fig.update_layout(title=spec.title, xaxis_title=spec.variable, yaxis_title="stage time (s)",
                      template="plotly_white")
    return fig


def write_figures(figures: dict, out_dir: Path) -> tuple:
    """Write each figure as HTML (plotly.js once, beside them) and as PNG when kaleido and a browser work.

    Returns ``(paths, png_note)``: the files written and a sentence saying whether PNGs were made.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        path = out_dir / f"{name}.html"
        fig.write_html(path, include_plotlyjs="directory")
        paths.append(path)
    png_note = "no figures"
    if figures:
        png_note = _try_png(figures, out_dir, paths)
    return paths, png_note


def _try_png(figures: dict, out_dir: Path, paths: list) -> str:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return "PNG skipped: kaleido is not installed (HTML figures only)"
    written = []
    for name, fig in figures.items():
        path = out_dir / f"{name}.png"
        try:
            fig.write_image(path)
        except Exception as exc:  # noqa: BLE001 — no browser, a kaleido/Chrome mismatch, ...
            for p in written:
                p.unlink(missing_ok=True)
            return f"PNG skipped: kaleido could not render ({type(exc).__name__}: {str(exc)[:160]})"
        written.append(path)
    paths.extend(written)
    return f"PNG written for {len(written)} figures"


__all__ = ["panel_figure", "static_figure", "stage_figure", "write_figures"]
