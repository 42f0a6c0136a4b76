"""Figures of an imported run (:mod:`bidirl.ingest`) and the folder ``bidirl trace import --out`` writes.

The Gantt is :func:`bidirl.viz.gantt.gantt_figure` on the run's event log — thinned for drawing above
:data:`bidirl.viz.aggregate.MAX_BARS` spans or :data:`~bidirl.viz.aggregate.MAX_LANES` lanes (the figure says
so) — with the import's notes (a step log's coarse timeline, unmapped spans) under its title. Idle per pool and
the bubble breakdown are bars of :func:`bidirl.ingest.bubbles.pool_idle` and
:func:`~bidirl.ingest.bubbles.bubble_breakdown`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import plotly.graph_objects as go

from bidirl.ingest.bubbles import bubble_breakdown, parts, pool_idle
from bidirl.ingest.run import ImportedRun
from bidirl.results.trace import EventLog, Span
from bidirl.viz.aggregate import thin
from bidirl.viz.export import export_figure
from bidirl.viz.gantt import TEMPLATE, WIDTH, gantt_figure

#: the time axis of an imported run: the trace's own clock, not bidirl's
TIME_AXIS = "time (s, on the imported file's clock; 0 at its origin)"
#: colour of each bubble part (training as the Gantt's chunks; waits in greys and warm tones)
BUBBLE_COLORS = {"training": "#ff7f0e", "weight sync": "#2ca02c", "hot switch": "#636363",
                 "waiting for the batch": "#1f77b4", "long-tail generation": "#9ecae1",
                 "trainer waiting": "#d62728", "generation (every GPU)": "#1f77b4",
                 "idle (nothing the trace records runs)": "#d62728",
                 # a step log's categories (bidirl.ingest.step_breakdown)
                 "colocated switch": "#636363", "generation": "#1f77b4", "rest of gen (untimed)": "#9ecae1",
                 "old log-probs": "#fdae6b", "reference log-probs": "#fdd0a2", "critic values": "#e6550d",
                 "critic update": "#a63603", "actor update": "#ff7f0e", "validation": "#6a51a3",
                 "checkpointing": "#9e9ac8", "other logged stages": "#bdbdbd", "driver CPU": "#fb6a4a",
                 "idle (no stage logged)": "#d62728"}


def _title(run: ImportedRun, title: Optional[str]) -> str:
    """The figure's title, always ending in what the numbers are: ``imported from FILE`` (the importer cannot know
    how the file was made, so never "measured")."""
    head = title or f"{Path(run.source).name} ({run.format}, map {run.map_name})"
    return f"{head} — {run.provenance_text.replace(run.source, Path(run.source).name)}, policy {run.policy}"


def imported_gantt(run: ImportedRun, title: Optional[str] = None) -> go.Figure:
    """Per-worker Gantt of an imported run, lanes grouped by pool; thinned when large (module doc)."""
    spans = run.log.spans_df()
    drawn = thin(spans)
    if drawn.spans is spans:
        log = run.log
    else:
        log = EventLog(spans=[Span(**row) for row in drawn.spans.to_dict("records")], steps=run.log.steps)
    fig = gantt_figure(log, _title(run, title), lanes=drawn.lanes, provenance=None, group_auxiliary=False)
    fig.update_yaxes(ticktext=drawn.labels)
    fig.update_xaxes(title_text=TIME_AXIS)
    notes = [n for n in [drawn.note, *run.notes] if n]
    if run.coarse or notes:
        fig.add_annotation(text="<br>".join(notes), xref="paper", yref="paper", x=0, y=1.0, yanchor="bottom",
                           showarrow=False, align="left", font={"size": 11, "color": "#555"})
        fig.update_layout(margin={"t": 70 + 16 * len(notes)})
    return fig


def idle_figure(run: ImportedRun, title: Optional[str] = None) -> go.Figure:
    """GPU-weighted idle share of each pool and of all GPUs over the run's steps (:func:`pool_idle`), with the
    pool-union figure beside it, labelled as such."""
    idle = pool_idle(run)
    fig = go.Figure([
        go.Bar(name="idle (GPU-weighted)", x=idle["pool"], y=100 * idle["idle_fraction"],
               text=[f"{100 * f:.1f} % ({s:,.1f} GPU-s)" for f, s in zip(idle["idle_fraction"], idle["idle_gpu_s"])],
               textposition="outside", marker_color="#1f77b4",
               hovertemplate="%{x}: %{y:.1f} % idle (GPU-weighted)<extra></extra>"),
        go.Bar(name="pool-union idle (no GPU of the pool busy)", x=idle["pool"], y=100 * idle["pool_union_idle_fraction"],
               marker_color="#c7c7c7",
               hovertemplate="%{x}: %{y:.1f} % pool-union idle<extra></extra>")])
    fig.update_layout(title=f"idle per pool — {_title(run, title)}", template=TEMPLATE, width=WIDTH // 2, height=380,
                      barmode="group", legend={"orientation": "h", "y": -0.2},
                      yaxis={"title": "idle (% of GPU-seconds over the steps)", "range": [0, 110]})
    return fig


def bubble_figure(run: ImportedRun, title: Optional[str] = None) -> go.Figure:
    """Stacked bars per step: where each step's time went (the parts sum to the step's time)."""
    b = bubble_breakdown(run)
    fig = go.Figure([go.Bar(name=part, x=b["step"], y=b[part], marker_color=BUBBLE_COLORS.get(part, "#7f7f7f"),
                            hovertemplate=f"step %{{x}}: %{{y:.3f}} s {part}<extra></extra>") for part in parts(b)])
    fig.update_layout(barmode="stack", template=TEMPLATE, width=WIDTH, height=420,
                      title=f"where each step's time went — {_title(run, title)}",
                      xaxis={"title": "training step", "dtick": 1 if len(b) <= 40 else None},
                      yaxis={"title": "seconds (as the imported file records them)"},
                      legend={"orientation": "h", "y": -0.25})
    return fig


def what_if_figure(outcome: dict, title: Optional[str] = None) -> go.Figure:
    """Simulated throughput of the job as it ran and under BiDiRL (``bidirl.ingest.whatif.imported_what_if``)."""
    tp = outcome["what_if"]["throughput"]
    names = list(tp)
    fig = go.Figure(go.Bar(x=names, y=[tp[n] for n in names], marker_color="#7f7f7f",
                           text=[f"×{outcome['what_if']['gain'][n]:.2f}" for n in names], textposition="outside",
                           name="simulated with the fitted preset"))
    measured = outcome["measured"].get("throughput")
    if measured:
        fig.add_hline(y=measured, line_dash="dot", annotation_text=f"as imported: {measured:.0f} tokens/s")
    fig.update_layout(title=title or "what if: the job simulated with a preset fitted to the imported run",
                      template=TEMPLATE, width=WIDTH, height=420, yaxis={"title": "tokens/s (simulated)"})
    return fig


def write_import(run: ImportedRun, out_dir, png: bool = False) -> dict:
    """Write an import's outputs to ``out_dir``: ``events.parquet`` (the event log), ``trace.json`` (Chrome /
    Perfetto), ``idle.csv``, ``bubbles.csv``, ``unmapped.csv``, ``ignored.csv``, ``workers.csv``,
    ``summary.json`` and the figures as HTML (``gantt``, ``idle``, ``bubbles``). Returns ``{name: path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"events": run.log.save(out / "events.parquet"), "trace": run.log.save(out / "trace.json")}
    idle, bubbles = pool_idle(run), bubble_breakdown(run)
    for name, frame in (("idle", idle), ("bubbles", bubbles), ("unmapped", run.unmapped), ("ignored", run.ignored),
                        ("workers", run.workers)):
        frame.to_csv(out / f"{name}.csv", index=False)
        paths[name] = out / f"{name}.csv"
    for name, fig in (("gantt", imported_gantt(run)), ("idle_figure", idle_figure(run)),
                      ("bubbles_figure", bubble_figure(run))):
        export_figure(fig, out / f"{name}.html", png=png)
        paths[name] = out / f"{name}.html"
    summary = {**run.summary(), "idle": idle.to_dict(orient="records"),
               "bubbles_total_s": {p: float(bubbles[p].sum()) for p in parts(bubbles)},
               "gpu_idle_categories": list(run.gpu_idle_categories),
               "step_s_total": float(bubbles["step_s"].sum()) if len(bubbles) else 0.0}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    paths["summary"] = out / "summary.json"
    return {k: str(v) for k, v in paths.items()}
