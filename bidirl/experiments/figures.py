"""Plotly figures of the reproduced panels (the paper's Fig. eval-main, eval-ablation and eval-static).

Every figure says what it shows and sets it beside what the paper reports (``data/paper/claims.yaml``):

* **end-to-end and ablation panels** — throughput bars per policy (raw tokens/s, as the paper's figures; the
  panel's metric, §7.1) above the BiDiRL speedup per point, where the paper's reported range is a shaded band
  and its per-point numbers are stars. Modelled external systems are named as such, with the mechanisms the
  model gives them (:data:`bidirl.sim.baselines.BASELINES`) in the legend's hover; a point a system cannot run
  is marked × ("unsupported", as the paper marks it) and a run that failed ⚠ — two different markers, neither
  counted in a speedup;
* **static-planning panels** — simulated throughput (no-borrow) and the planner's predicted λ_pipe per split,
  each relative to its maximum, with the paper's measured best split and its spread;
* **stage-model panels** — observed and predicted stage time per x value, with the held-out errors beside the
  paper's.

Axis titles are words with units (:data:`VARIABLE_TITLES`), never config keys. Simulated numbers are labelled
simulated (model prediction); the stage-model panels say where their records come from (measured on this CPU
with the tiny model in ``reproduce``; synthetic in the calibration notebook), read from the records' tag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from bidirl.experiments.specs import PanelSpec
from bidirl.results.figure_text import title_height, wrapped_title

POLICY_COLORS = {"bidirl": "#d62728", "verl-colocated": "#7f7f7f", "verl-async": "#1f77b4", "areal": "#2ca02c",
                 "roll": "#9467bd", "no-borrow": "#8c564b", "rot-only": "#17becf", "tor-only": "#bcbd22",
                 "opportunistic": "#ff7f0e"}
#: the paper's names of the ablated variants (§7.3)
ABLATION_NAMES = {"no-borrow": "no-borrow (static split)", "rot-only": "w/o T-on-R (rollout borrows only)",
                  "tor-only": "w/o R-on-T (trainer borrows only)", "opportunistic": "opportunistic (no cost model)"}
#: x-axis titles in words, by the spec's ``variable``
VARIABLE_TITLES = {
    "workload.max_response_len": "maximum response length (tokens)",
    "rl.staleness": "staleness bound s (actor versions a sample may lag)",
    "cluster.gpus": "GPU budget (GPUs)",
    "cluster.partition": "split (rollout GPUs-trainer GPUs)",
    "model/dataset": "model / dataset",
    "cluster.gpus & workload.prompts_per_step": "GPU budget / prompts per step",
    "prompts per GPU": "prompt groups per GPU",
    "chunks per GPU": "trainer chunks per GPU (one micro-batch per device each)",
}
METRIC_TITLES = {"throughput": "throughput (tokens/s, §7.1 window)",
                 "total_run_throughput": "total-run throughput (tokens/s, all complete steps)"}
SIMULATED = "simulated (model prediction)"
PAPER_BAND = "rgba(44, 160, 44, 0.15)"
PAPER_COLOR = "#2ca02c"
#: status -> (legend name, mark, colour) of a cell without a bar
MARKS = {"unsupported": ("× unsupported by the system (as the paper marks it)", "×", "#555555"),
         "failed": ("⚠ run failed (see results.csv)", "⚠", "#b00020")}


def variable_title(spec: PanelSpec) -> str:
    """The panel's x-axis title in words and units."""
    return VARIABLE_TITLES.get(spec.variable, spec.variable)


def _range_text(values) -> str:
    v = [x for x in values if np.isfinite(x)]
    return f"{min(v):.2f}x–{max(v):.2f}x" if v else "n/a"


def variant_text(spec: PanelSpec) -> str:
    """'quick variant: 2 of the 5 points (s=0, s=1)' for a reduced panel, '' for the full one."""
    from bidirl.experiments.specs import SPECS
    full = SPECS.get(spec.id)
    if full is None or len(spec.points) >= len(full.points):
        return ""
    return (f"quick variant: {len(spec.points)} of the {len(full.points)} points "
            f"({', '.join(p.label for p in spec.points)})")


def speedup_range(values, pad: float = 0.25, least: float = 0.1) -> tuple:
    """A speedup axis range that shows every value and 1× with room around them: the span of the finite
    ``values`` and 1.0, widened by ``pad`` of itself on each side and to at least ``least`` in all (a band
    of the paper's range is then never on a clipped edge)."""
    v = [float(x) for x in values if x is not None and np.isfinite(x)] + [1.0]
    lo, hi = min(v), max(v)
    margin = max(pad * (hi - lo), (least - (hi - lo)) / 2, 0.0) + 1e-9
    return lo - margin, hi + margin


def paper_values(spec: PanelSpec, claims: Optional[Sequence] = None) -> dict:
    """What the paper reports for this panel alone: ``{"range": (lo, hi) or None, "points": {label: value},
    "spread": value or None, "choice": label or None, "median": %, "p90": %}`` (claims whose only panel is
    this one)."""
    if claims is None:
        from bidirl.experiments.claims import load_claims
        claims = load_claims()
    out: dict = {"range": None, "points": {}, "spread": None, "choice": None, "median": None, "p90": None}
    for c in claims:
        if tuple(c.panels) != (spec.id,):
            continue
        points = c.check.get("points")
        if c.kind == "speedup_range" and c.metric == "speedup":
            out["range"] = (float(c.value[0]), float(c.value[1]))
        elif c.kind == "ratio" and c.metric == "speedup" and points and len(points) == 1:
            out["points"][str(points[0])] = float(c.value)
        elif c.kind == "ratio" and c.metric == "planner_spread":
            out["spread"] = float(c.value)
        elif c.kind == "choice" and c.metric == "planner_choice":
            out["choice"] = str(c.value)
        elif c.kind == "error":
            out[c.check.get("stat", "median")] = float(c.value)
    return out


def mechanisms(policy: str, spec: PanelSpec) -> list:
    """What the model of an external system does, in short phrases taken from its modelled policy and settings
    (:mod:`bidirl.sim.baselines`; the cited rules are in the report). Empty for BiDiRL and the ablations."""
    from bidirl.core.buffer import BATCH_RULES
    from bidirl.job.planner import min_feasible_layouts
    from bidirl.sim.baselines import BASELINES
    base = BASELINES.get(policy)
    if base is None:
        return []
    if base.colocated:
        return ["one time-shared pool of all GPUs (hybrid engine)", "synchronous (s = 0)",
                "reshards between rollout and training every step", "no partial rollout"]
    cfg = None
    for point in spec.points:
        candidate = spec.config(point)
        if base.supports(candidate) is None:
            cfg = base.adapt(candidate)
            break
    if cfg is None:
        return ["cannot run any point of this panel"]
    pol = base.policy_for(cfg)
    out = ["fixed disaggregated pools, no borrowing", "batches: " + BATCH_RULES[pol.batch_rule].split(" (")[0]]
    out.append("staleness bound enforced at admission" + ("" if pol.enforce_staleness else " only"))
    if pol.max_in_flight:
        out.append(f"at most {pol.max_in_flight} groups generating at once")
    if pol.drop_stale:
        out.append("drops groups too stale for any future batch at a sync")
    if cfg.rl.partial_rollout:
        out.append("partial rollout: interrupted generations resume with their prefix")
    # the adapted sync (ROLL's offload/reload folded into scheduler.weight_sync) against the job's own, each to
    # rollout replicas of its planned layout ρ_r
    sync = lambda c: c.weight_sync_time(rollout_layout=min_feasible_layouts(c)[0])
    if sync(cfg) > sync(candidate) * 1.0001:
        out.append("trainer offload/reload on every weight sync")
    return out


def policy_name(policy: str) -> str:
    """The legend name of a policy: modelled systems say so, ablations use the paper's names."""
    from bidirl.sim.baselines import BASELINES
    if policy in BASELINES:
        return f"{policy} (modelled {BASELINES[policy].version})"
    if policy == "bidirl":
        return "BiDiRL"
    return ABLATION_NAMES.get(policy, policy)


def _marks(fig, df: pd.DataFrame, labels: list, policies: Sequence[str]) -> None:
    """× for unsupported and ⚠ for failed cells, in their policy's bar slot (a thin, labelled bar sharing the
    policy's ``offsetgroup``, so the mark sits where the missing bar would be)."""
    ok = pd.to_numeric(df.loc[df["status"] == "ok", "throughput"], errors="coerce")
    stub = 0.03 * float(ok.max()) if len(ok) and np.isfinite(ok.max()) else 1.0
    shown = set()
    for policy in policies:
        sub = df[df["policy"] == policy].set_index("point")
        for status, (name, text, color) in MARKS.items():
            cells = [lbl for lbl in labels if lbl in sub.index and sub.at[lbl, "status"] == status]
            if not cells:
                continue
            fig.add_trace(go.Bar(
                x=cells, y=[stub] * len(cells), name=name, legendgroup=status, showlegend=status not in shown,
                offsetgroup=policy, text=[text] * len(cells), textposition="outside", cliponaxis=False,
                textfont={"color": color, "size": 16}, marker={"color": color, "opacity": 0.35},
                hovertext=[f"{policy_name(policy)} at {c}: {status} — {sub.at[c, 'reason']}" for c in cells],
                hoverinfo="text"), row=1, col=1)
            shown.add(status)


def panel_figure(spec: PanelSpec, results: pd.DataFrame, speedup_table: Optional[pd.DataFrame] = None,
                 claims: Optional[Sequence] = None) -> go.Figure:
    """Grouped throughput bars (one trace per policy) over the BiDiRL speedup per point beside the paper's."""
    df = results[results["panel"] == spec.id]
    labels = [p.label for p in spec.points if p.label in set(df["point"])]
    paper = paper_values(spec, claims)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.62, 0.38], vertical_spacing=0.1)
    for policy in spec.policies:
        sub = df[df["policy"] == policy].set_index("point")
        # the bars: the §7.1 window throughput, as every other page and `simulate` report it (the speedups below
        # keep the claim's own metric, which for the ablations is the paper's total-run throughput)
        column = "summary_throughput" if "summary_throughput" in sub else "throughput"
        y = [float(sub.at[lbl, column]) if lbl in sub.index and sub.at[lbl, "status"] == "ok" else None
             for lbl in labels]
        how = mechanisms(policy, spec)
        note = ("<br>modelled: " + "<br>  · ".join([""] + how)) if how else ""
        fig.add_trace(go.Bar(name=policy_name(policy), x=labels, y=y, marker_color=POLICY_COLORS.get(policy),
                             offsetgroup=policy, marker_pattern_shape="/" if how else "",
                             hovertemplate=f"{policy_name(policy)}<br>%{{x}}: %{{y:,.0f}} tokens/s{note}"
                                           "<extra></extra>"), row=1, col=1)
    _marks(fig, df, labels, spec.policies)

    sp = (speedup_table[speedup_table["panel"] == spec.id] if speedup_table is not None and len(speedup_table)
          else pd.DataFrame(columns=["point", "speedup"]))
    got = {str(p): float(v) for p, v in zip(sp["point"], sp["speedup"])}
    fig.add_trace(go.Scatter(name="BiDiRL speedup, reproduced", x=labels, y=[got.get(lbl) for lbl in labels],
                             mode="lines+markers", marker={"symbol": "diamond", "size": 10, "color": "#d62728"},
                             line={"color": "#d62728"}, hovertemplate="%{x}: %{y:.2f}x (reproduced)<extra></extra>"),
                  row=2, col=1)
    shapes = []
    if paper["range"]:
        lo, hi = paper["range"]
        shapes.append({"type": "rect", "xref": "x2 domain", "yref": "y2", "x0": 0, "x1": 1, "y0": lo, "y1": hi,
                       "fillcolor": PAPER_BAND, "line": {"width": 0}, "layer": "below", "name": "paper_range"})
        fig.add_trace(go.Scatter(name=f"paper's reported range {lo:.2f}x–{hi:.2f}x", x=[None], y=[None],
                                 mode="markers", marker={"symbol": "square", "size": 14, "color": PAPER_BAND},
                                 hoverinfo="skip"), row=2, col=1)
    if paper["points"]:
        pts = [lbl for lbl in labels if lbl in paper["points"]]
        fig.add_trace(go.Scatter(name="paper's number at this point", x=pts, y=[paper["points"][p] for p in pts],
                                 mode="markers", marker={"symbol": "star", "size": 13, "color": PAPER_COLOR},
                                 hovertemplate="%{x}: %{y:.2f}x (paper)<extra></extra>"), row=2, col=1)
    compared = "external baselines" if spec.kind == "end-to-end" else "ablated variants"
    title = f"{spec.title} ({spec.figure}) — {SIMULATED}"
    variant = variant_text(spec)
    if variant:
        title += f" — {variant}"
    sub = f"BiDiRL speedup over the strongest of the {compared}: reproduced {_range_text(got.values())}"
    if paper["range"]:
        sub += f"; paper {paper['range'][0]:.2f}x–{paper['range'][1]:.2f}x"
    heading = wrapped_title(title, sub, width_px=1000)
    fig.update_layout(title=heading, barmode="group",
                      template="plotly_white", legend_title="", shapes=shapes, height=590 + title_height(heading),
                      width=1000, legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom"},
                      margin={"t": title_height(heading) + 20, "b": 170, "l": 90})
    fig.update_yaxes(title_text=METRIC_TITLES["throughput"].replace(" (", "<br>(", 1), rangemode="tozero",
                     row=1, col=1)
    speedup_of = "" if spec.metric == "throughput" else "<br>(" + METRIC_TITLES.get(spec.metric, spec.metric) + ")"
    fig.update_yaxes(title_text=f"BiDiRL speedup (×){speedup_of}", range=list(speedup_range(
        list(got.values()) + list(paper["points"].values()) + list(paper["range"] or ()))), row=2, col=1)
    fig.update_xaxes(type="category")                  # a split such as "8-24" must not read as a date
    fig.update_xaxes(title_text=variable_title(spec), row=2, col=1)
    return fig


def static_figure(spec: PanelSpec, results: pd.DataFrame, sweep: Optional[pd.DataFrame],
                  claims: Optional[Sequence] = None) -> go.Figure:
    """Simulated vs planner-predicted throughput per split, each relative to its maximum, with the paper's
    measured best split and spread."""
    fig = go.Figure()
    df = results[(results["panel"] == spec.id) & (results["status"] == "ok")]
    labels = [p.label for p in spec.points]
    paper = paper_values(spec, claims)
    spreads = []
    if len(df):
        tp = df.groupby("point")["throughput"].max()
        y = np.array([tp.get(lbl, np.nan) for lbl in labels], dtype=float)
        m = np.nanmax(y) if np.isfinite(y).any() else 1.0
        fig.add_trace(go.Bar(name="simulated total-run throughput, no-borrow (relative)", x=labels, y=y / m,
                             marker_color="#1f77b4",
                             hovertemplate="%{x}: %{y:.3f} of the best (simulated)<extra></extra>"))
        if np.isfinite(y).sum() > 1:
            spreads.append(f"simulated {np.nanmax(y) / np.nanmin(y):.2f}x")
    if sweep is not None and len(sweep):
        rate = {f"{int(r)}-{int(t)}": v for r, t, v in zip(sweep["rollout_gpus"], sweep["trainer_gpus"],
                                                          sweep["pipeline_rate"])}
        y = np.array([rate.get(lbl, np.nan) for lbl in labels], dtype=float)
        m = np.nanmax(y) if np.isfinite(y).any() else 1.0
        fig.add_trace(go.Scatter(name="planner's predicted λ_pipe (relative)", x=labels, y=y / m,
                                 mode="lines+markers", marker_color="#d62728",
                                 hovertemplate="%{x}: %{y:.3f} of the best (predicted)<extra></extra>"))
        if np.isfinite(y).sum() > 1:
            spreads.append(f"predicted {np.nanmax(y) / np.nanmin(y):.2f}x")
    if paper["choice"]:
        fig.add_trace(go.Scatter(name=f"paper's measured best split ({paper['choice']})", x=[paper["choice"]],
                                 y=[1.0], mode="markers", marker={"symbol": "star", "size": 16, "color": PAPER_COLOR},
                                 hovertemplate="paper: %{x} measured best<extra></extra>"))
    if paper["spread"]:
        spreads.append(f"paper {paper['spread']:.2f}x")
    sub = "max/min across the displayed splits: " + (", ".join(spreads) if spreads else "n/a")
    heading = wrapped_title(f"{spec.title} ({spec.figure}) — {SIMULATED}", sub, width_px=1000)
    fig.update_layout(title=heading,
                      xaxis={"title": variable_title(spec), "type": "category"},     # "8-24" is no date
                      yaxis_title="throughput relative to the best split",
                      template="plotly_white", width=1000, height=430 + title_height(heading),
                      margin={"t": title_height(heading) + 20, "b": 120},
                      legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom"})
    return fig


def stage_figure(spec: PanelSpec, records: Optional[pd.DataFrame], claims: Optional[Sequence] = None) -> go.Figure:
    """Observed and predicted stage time per x value, one pair of curves per max response length, with the
    held-out errors; titled with where the records come from (their tag,
    :func:`bidirl.results.provenance.records_label`; untagged records are refused). Measured records are set
    beside the paper's errors; synthetic ones beside the generator's noise floor, which is what their error
    measures."""
    from bidirl.experiments.stage_models import NOISE, noise_floor_pct
    from bidirl.results.provenance import records_label
    fig = go.Figure()
    paper = paper_values(spec, claims)
    errors = ""
    label = "no records (the panel failed: see the report)"
    source = None
    if records is not None:
        label, source = records_label(records), records.attrs["source"]
    if records is not None and len(records):
        palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
        for i, (length, sub) in enumerate(records.groupby("max_response_len")):
            agg = sub.groupby("x")[["observed", "predicted"]].mean().sort_index()
            spread = sub.groupby("x")["observed"].agg(["min", "max", "count"]).sort_index()
            reps = int(spread["count"].min())
            color = palette[i % len(palette)]
            what = (f"mean of {reps} repetitions, bars min–max" if reps > 1 else "one repetition")
            fig.add_trace(go.Scatter(name=f"{source}, responses of {length} tokens ({what})", x=agg.index,
                                     y=agg["observed"], mode="markers", marker={"color": color, "size": 8},
                                     error_y={"type": "data", "symmetric": False, "visible": reps > 1,
                                              "array": spread["max"] - agg["observed"],
                                              "arrayminus": agg["observed"] - spread["min"]},
                                     legendgroup=str(length)))
            fig.add_trace(go.Scatter(name=f"predicted (fitted model), responses of {length} tokens", x=agg.index,
                                     y=agg["predicted"], mode="lines", line={"color": color},
                                     legendgroup=str(length)))
        if {"observed", "predicted"} <= set(records.columns):
            rel = (records["predicted"] - records["observed"]).abs() / records["observed"]
            errors = f"held-out error: median {100 * rel.median():.2f} %, p90 {100 * rel.quantile(0.9):.2f} %"
    if source == "synthetic":
        errors += (f"{'; ' if errors else ''}floor set by the injected {100 * NOISE:g} % noise: median "
                   f"{noise_floor_pct():.2f} % (not comparable with the paper's errors on real GPUs)")
    elif paper["median"] is not None:
        errors += (f"{'; ' if errors else ''}paper: median {paper['median']:.2f} %"
                   + (f", p90 {paper['p90']:.2f} %" if paper["p90"] is not None else "")
                   + " (Qwen3-VL on A6000)")
    title = wrapped_title(f"{spec.title} ({spec.figure}) — {label}", errors, width_px=1000)
    fig.update_layout(title=title, margin={"t": title_height(title) + 20},
                      xaxis_title=variable_title(spec), yaxis_title="stage time (s)", template="plotly_white",
                      width=1000, height=420 + title_height(title))
    return fig


def write_figures(figures: dict, out_dir: Path, png_cache: Optional[Path] = None) -> tuple:
    """Write each figure as HTML (plotly.js once, beside them) and as PNG when kaleido and a browser work;
    ``png_cache`` keeps rendered PNGs by figure content (:func:`bidirl.viz.export.write_pngs`).

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
        png_note = _try_png(figures, out_dir, paths, png_cache)
    return paths, png_note


def _try_png(figures: dict, out_dir: Path, paths: list, png_cache: Optional[Path]) -> str:
    from bidirl.viz.export import write_pngs
    targets = {out_dir / f"{name}.png": fig for name, fig in figures.items()}
    why = write_pngs(targets, cache_dir=png_cache)
    if why is not None:
        return f"PNG skipped: {why} (HTML figures only)"
    paths.extend(targets)
    return f"PNG written for {len(targets)} figures"


__all__ = ["variant_text", "speedup_range", "panel_figure", "static_figure", "stage_figure", "write_figures", "paper_values", "mechanisms",
           "variable_title", "policy_name"]
