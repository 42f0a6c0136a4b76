"""Compare reproduced results with every claim of ``data/paper/claims.yaml`` and write the report.

One row per claim: the paper's value or range, the reproduced value or range, the tolerance, ``match``
(computed by :func:`bidirl.experiments.claims.judge`, never written by hand), a status and a note.
Evidence comes from four places:

* simulation panels (§7.2, §7.3): :func:`bidirl.experiments.run.speedups` of the results table;
* static planning (§7.4, Fig. eval-static a/b): :func:`bidirl.job.planner.plan` on the displayed partitions,
  compared with the simulated (no-borrow) throughput of the same partitions;
* stage-time models (§7.4, Fig. eval-static c/d): :mod:`bidirl.experiments.stage_models` (calibration with
  :mod:`bidirl.perf.fit`);
* hot-switch costs (§7.3, Table hot-switch-cost): :func:`bidirl.perf.costs.derive_switch_costs`, a physical
  model independent of the measured values the simulator charges.

Training-convergence claims (§7.5) need real training; they are reported as "not reproducible in
simulation" with ``match = null``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from bidirl.experiments.claims import RANGE_RULE, Claim, judge

NOT_RUN, NO_VALID = "not run", "no valid runs"
NOT_SIMULABLE = "not reproducible in simulation"
UNAVAILABLE = "unavailable"


@dataclass
class Evidence:
    """Everything a claim can be checked against (any part may be empty when its panels were not run)."""
    results: pd.DataFrame = field(default_factory=pd.DataFrame)
    speedups: pd.DataFrame = field(default_factory=pd.DataFrame)
    static: dict = field(default_factory=dict)        # panel id -> static_evidence(...)
    stage: dict = field(default_factory=dict)         # panel id -> {"median", "p90", "records", "error"}
    switch_costs: Optional[dict] = None               # switch_cost_evidence(...)

    @property
    def panels_run(self) -> set:
        out = set(self.static) | set(self.stage)
        if len(self.results):
            out |= set(self.results["panel"])
        return out


# --------------------------------------------------------------------------------------------------
# Evidence that does not come from the simulation grid
# --------------------------------------------------------------------------------------------------

def static_evidence(spec, results: Optional[pd.DataFrame] = None, plan_fn: Optional[Callable] = None) -> dict:
    """The planner's view of a static-planning panel (§7.4): its sweep restricted to the displayed
    partitions, the predicted spread (max/min λ_pipe over compatible ones), its choice among them, its
    unrestricted envelope, and — when ``results`` hold the panel — the simulated best partition."""
    if plan_fn is None:
        from bidirl.job.planner import plan as plan_fn
    from bidirl.experiments.specs import SPECS
    full = SPECS.get(spec.id, spec)      # planning is cheap: judge the planner on every displayed partition
    cfg = full.config(full.points[0]).with_overrides({"cluster.partition": None})
    try:
        p = plan_fn(cfg)
    except Exception as exc:  # noqa: BLE001 — reported, never fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    sweep = p.sweep
    shown = {int(pt.value) for pt in full.points}
    disp = sweep[sweep["rollout_gpus"].astype(int).isin(shown)].copy()
    disp["label"] = [f"{int(r)}-{int(t)}" for r, t in zip(disp["rollout_gpus"], disp["trainer_gpus"])]
    comp = disp[disp["compatible"].astype(bool)]
    out = {"sweep": disp, "error": None,
           "envelope": f"{int(p.envelope.rollout_gpus)}-{int(p.envelope.trainer_gpus)}"}
    if len(comp):
        rates = comp["pipeline_rate"].astype(float).to_numpy()
        out["spread"] = float(rates.max() / rates.min()) if rates.min() > 0 else float("inf")
        out["choice"] = str(comp["label"].iloc[int(np.argmax(rates))])
    else:
        out.update(spread=None, choice=None, error="no displayed partition is hot-switch compatible")
    if results is not None and len(results):
        ok = results[(results["panel"] == spec.id) & (results["status"] == "ok")]
        if len(ok):
            tp = ok.groupby("point")["throughput"].max()
            out["measured_best"] = str(tp.idxmax())
            out["measured_spread"] = float(tp.max() / tp.min())
            out["measured_points"] = int(len(tp))
            out["displayed_points"] = len(full.points)
    return out


def switch_cost_evidence(derive_fn: Optional[Callable] = None, hardware: str = "a6000",
                         models=("qwen3-vl-2b", "qwen3-vl-4b")) -> dict:
    """Derived hot-switch costs for Table hot-switch-cost, shaped like the claim's value."""
    from bidirl.job import presets
    if derive_fn is None:
        try:
            from bidirl.perf.costs import derive_switch_costs as derive_fn
        except ImportError as exc:
            return {"error": f"bidirl.perf.costs is unavailable ({exc})"}
    hw = presets.hardware(hardware)
    out: dict = {"models": list(models), "hardware": hardware}
    for name in models:
        costs = derive_fn(hw, presets.model(name))
        for direction, c in costs.items():
            row = out.setdefault(direction, {})
            for key in ("c_in", "c_out", "c_grad"):
                row.setdefault(key, []).append(float(getattr(c, key)))
    return out


# --------------------------------------------------------------------------------------------------
# Metrics: claim + evidence -> Outcome
# --------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What a metric found: the reproduced value, a note, a status when nothing can be judged, and —
    when only part of a claim could be checked — the part of the paper's value to judge against."""
    reproduced: Any
    note: str = ""
    status: Optional[str] = None
    judged_paper: Any = None


def _points_filter(claim: Claim, df: pd.DataFrame) -> pd.DataFrame:
    chk = claim.check
    if chk.get("points"):
        df = df[df["point"].isin([str(p) for p in chk["points"]])]
    if chk.get("exclude_points"):
        df = df[~df["point"].isin([str(p) for p in chk["exclude_points"]])]
    return df


def _full_point_count(claim: Claim) -> Optional[int]:
    """How many points the claim covers in the full (non-quick) specs."""
    from bidirl.experiments.specs import SPECS
    if not all(p in SPECS for p in claim.panels):
        return None
    frame = pd.DataFrame([{"panel": p, "point": label} for p in claim.panels for label in SPECS[p].labels])
    return len(_points_filter(claim, frame))


def _m_speedup(claim: Claim, ev: Evidence) -> Outcome:
    sp = ev.speedups
    panels = [p for p in claim.panels if p in ev.panels_run]
    if not panels or sp is None or not len(sp):
        return Outcome(None, f"panels not run: {', '.join(claim.panels)}", NOT_RUN)
    sel = _points_filter(claim, sp[sp["panel"].isin(panels)])
    if not len(sel):
        return Outcome(None, f"the checked points of {', '.join(panels)} were not run", NOT_RUN)
    metric = claim.metric
    if metric == "speedup":
        values = sel["speedup"]
    elif metric == "speedup_over":
        col = f"over:{claim.check['policy']}"
        values = sel[col] if col in sel else pd.Series(dtype=float)
    else:  # speedup_over_best_of: over the stronger variant = the smaller ratio; every variant must be valid
        cols = [f"over:{p}" for p in claim.check["policies"]]
        values = sel[cols].min(axis=1, skipna=False) if all(c in sel for c in cols) else pd.Series(dtype=float)
    values = values.astype(float)
    values = values[np.isfinite(values)].to_numpy()
    missing = [p for p in claim.panels if p not in ev.panels_run]
    note = f"{len(values)} point(s) from {', '.join(panels)}"
    full = _full_point_count(claim)
    if full is not None and len(sel) < full:
        note += f" (partial run: {len(sel)} of the {full} points this claim covers)"
    if missing:
        note += f"; not run: {', '.join(missing)}"
    if not len(values):
        return Outcome(None, note + "; no point with valid BiDiRL and comparator runs", NO_VALID)
    lo, hi = round(float(values.min()), 4), round(float(values.max()), 4)
    bound = sel["rebalance_bound"].astype(float).to_numpy() if "rebalance_bound" in sel else np.array([])
    bound = bound[np.isfinite(bound)]
    if bound.size:
        note += (f"; in a steady step the models allow any borrowing at most {bound.min():.3g}–{bound.max():.3g}× "
                 "over no-borrow at these points (rebalance bound; a whole run's ratio can exceed it by the first "
                 "step's start-up window)")
    if claim.kind == "speedup_range":
        return Outcome([lo, hi], note)
    if claim.check.get("aggregate") == "max":
        return Outcome(hi, note)
    if len(values) == 1:
        return Outcome(lo, note)
    return Outcome([lo, hi], note + " (every value is judged)")


def _m_unsupported(claim: Claim, ev: Evidence) -> Outcome:
    res = ev.results
    panels = [p for p in claim.panels if p in ev.panels_run]
    if not panels or not len(res):
        return Outcome(None, "panels not run", NOT_RUN)
    policies = set(claim.check.get("policies", ()))
    sub = res[res["panel"].isin(panels) & res["policy"].isin(policies)]
    marks = sorted(f"{r.panel}@{r.point}:{r.policy}" for r in sub.itertuples() if r.status == "unsupported")
    cells = {f"{r.panel}@{r.point}" for r in sub.itertuples()}
    expected = [m for m in claim.value if m.split(":")[0] in cells]
    note = f"checked {len(cells)} settings of {len(panels)} panel(s) for {', '.join(sorted(policies))}"
    if len(expected) != len(claim.value):
        note += (f"; {len(claim.value) - len(expected)} setting(s) the paper marks were not run, so the marks are "
                 f"judged against {expected}")
    return Outcome(marks, note, judged_paper=expected)


def _m_static(claim: Claim, ev: Evidence) -> Outcome:
    panel = claim.panels[0]
    st = ev.static.get(panel)
    if st is None:
        return Outcome(None, f"panel {panel} not run", NOT_RUN)
    if st.get("choice") is None:
        return Outcome(None, st.get("error") or "planner produced no choice", UNAVAILABLE)
    note = f"planner envelope over all candidates: {st.get('envelope')}"
    if "measured_spread" in st:
        note += (f"; simulated no-borrow spread {st['measured_spread']:.2f}x, best {st['measured_best']} "
                 f"(over {st['measured_points']} of {st['displayed_points']} partitions)")
    if claim.metric == "planner_spread":
        return Outcome(round(float(st["spread"]), 4),
                       "predicted λ_pipe max/min over the displayed compatible partitions; " + note)
    return Outcome(st["choice"], "planner's choice among the displayed partitions; " + note)


def _m_measured_best(claim: Claim, ev: Evidence) -> Outcome:
    picks, notes = [], []
    for panel in claim.panels:
        st = ev.static.get(panel)
        if st is None or "measured_best" not in st or st.get("choice") is None:
            return Outcome(None, f"needs the simulated sweep and the planner for {panel}", NOT_RUN)
        if st["measured_points"] < st["displayed_points"]:
            return Outcome(None, f"{panel}: only {st['measured_points']} of {st['displayed_points']} partitions "
                           "were simulated (quick run); the measured best needs the whole sweep", NOT_RUN)
        picks.append(st["choice"] == st["measured_best"])
        notes.append(f"{panel}: planner {st['choice']}, simulated best {st['measured_best']}")
    return Outcome(all(picks), "; ".join(notes))


def _m_stage(claim: Claim, ev: Evidence) -> Outcome:
    panel = claim.panels[0]
    st = ev.stage.get(panel)
    if st is None:
        return Outcome(None, f"panel {panel} not run", NOT_RUN)
    if st.get("error"):
        return Outcome(None, st["error"], UNAVAILABLE)
    return Outcome(round(float(st[claim.check["stat"]]), 3), st.get("note", ""))


def _m_switch(claim: Claim, ev: Evidence):
    sc = ev.switch_costs
    if sc is None:
        return Outcome(None, "switch costs not derived", NOT_RUN)
    if "error" in sc:
        return Outcome(None, sc["error"], UNAVAILABLE)
    note = ("derived from state sizes and link bandwidths (bidirl.perf.costs); the simulator charges the "
            "measured values of the a6000 preset")
    rows = {d: row for d, row in sc.items() if isinstance(row, dict)}
    if claim.metric == "switch_costs_derived":
        which = [sc["models"].index(m) for m in claim.value.get("models", sc["models"]) if m in sc["models"]]
        shaped = {d: {k: [round(v[i], 3) for i in which] for k, v in row.items() if k in claim.value.get(d, {})}
                  for d, row in rows.items()}
        constants = "the switch model's constants fitted to the 2B row" if claim.role == "held-out" else \
            "this row fitted the switch model's constants"
        return Outcome(shaped, note + f"; {constants} (bidirl.experiments.paper_fit)")
    # every cell a direction charges (non-zero for both models) must cost more for 4B than for 2B
    cells = [v[1] > v[0] for row in rows.values() for v in row.values() if v[0] > 0 and v[1] > 0]
    return Outcome(bool(cells) and all(cells), note + f"; {sum(cells)}/{len(cells)} charged cells have 4B > 2B")


def _m_not_simulable(claim: Claim, ev: Evidence) -> Outcome:
    return Outcome(None, "reward curves need real GRPO training; a simulation moves no weights and computes no "
                   "reward (check with `bidirl run` on real engines)", NOT_SIMULABLE)


METRICS: dict = {
    "speedup": _m_speedup, "speedup_over": _m_speedup, "speedup_over_best_of": _m_speedup,
    "unsupported_marks": _m_unsupported,
    "planner_spread": _m_static, "planner_choice": _m_static, "planner_picks_measured_best": _m_measured_best,
    "stage_error": _m_stage,
    "switch_costs_derived": _m_switch, "switch_costs_order": _m_switch,
    "not_simulable": _m_not_simulable,
}


def explain(rows: list, limits: list) -> list:
    """``rows`` with ``limits`` (ids) on every mismatch: the stated model limits that name its claim."""
    for r in rows:
        r["limits"] = [lim.id for lim in limits if r["id"] in lim.claims] if r["status"] == "mismatch" else []
    return rows


def evaluate(claims: list, evidence: Evidence) -> list:
    """One report row per claim (dicts with id, section, kind, role, compares, paper, reproduced, tolerance,
    match, status, note, check); ``match`` comes from :func:`bidirl.experiments.claims.judge`."""
    rows = []
    for claim in claims:
        fn = METRICS.get(claim.metric)
        if fn is None:
            raise ValueError(f"claim {claim.id}: unknown check metric {claim.metric!r}; known: {sorted(METRICS)}")
        out = fn(claim, evidence)
        paper = claim.value if out.judged_paper is None else out.judged_paper
        match = judge(claim.kind, paper, out.reproduced, claim.tolerance) if out.status is None else None
        status = out.status or ("match" if match else "mismatch")
        rows.append({"id": claim.id, "section": claim.section, "kind": claim.kind, "role": claim.role,
                     "compares": claim.compares,
                     "paper": claim.value, "reproduced": out.reproduced, "tolerance": claim.tolerance_text(),
                     "match": match, "status": status, "note": out.note, "check": dict(claim.check)})
    return rows


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return f"{value[0]:.3g}–{value[1]:.3g}"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_fmt(v)}" for k, v in value.items() if k not in ("models", "hardware"))
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def counts(rows: list) -> dict:
    """Status counts, plus the match rate over the checked claims of each role: a ``fit`` claim calibrated
    a model (bidirl.experiments.paper_fit), so only the ``held-out`` rate says how well the models predict."""
    out: dict = {"claims": len(rows)}
    for r in rows:
        out[r["status"]] = out.get(r["status"], 0) + 1
    for role in ("held-out", "fit"):
        checked = [r for r in rows if r.get("role", "held-out") == role and r["match"] is not None]
        if checked:
            hits = sum(bool(r["match"]) for r in checked)
            out[f"{role} matched"] = f"{hits}/{len(checked)}"
    if any("limits" in r for r in rows):
        out["misses without a stated limit"] = sum(1 for r in rows if r["status"] == "mismatch" and not r["limits"])
    return out


def judged_text(rows: list) -> str:
    """:func:`counts` in plain words: how many claims were judged and matched, and how many of the claims no model
    was fitted to ("held out" from the fit) matched — the rate that says how well the models predict — and how
    many misses no stated limit of the models explains."""
    judged = [r for r in rows if r["match"] is not None]
    hits = sum(bool(r["match"]) for r in judged)
    text = f"{len(judged)} claim{'' if len(judged) == 1 else 's'} judged: {hits} match, {len(judged) - hits} miss."
    held = [r for r in judged if r.get("role", "held-out") == "held-out"]
    fit = len(judged) - len(held)
    if held:
        text += (f" Of the {len(held)} that no model was fitted to, {sum(bool(r['match']) for r in held)} match"
                 + (f"; the other {fit} calibrated a model (role: fit in data/paper/claims.yaml), so "
                    f"{'its' if fit == 1 else 'their'} result does not test the models." if fit else "."))
    misses = [r for r in judged if not r["match"]]
    if misses and any("limits" in r for r in misses):
        bare = sum(1 for r in misses if not r.get("limits"))
        text += (" Every miss is explained by a stated limit of the models (data/paper/limits.yaml)." if not bare
                 else f" {bare} of the {len(misses)} misses have no stated limit of the models explaining them.")
    return text


def misses_text(rows: list, limits: Optional[list] = None) -> str:
    """Each missed claim in words: the paper's value against the reproduced one, and the title of every stated
    limit (:func:`bidirl.experiments.claims.load_limits`) that names it; one line per miss."""
    from bidirl.experiments.claims import load_limits
    titles = {lim.id: lim.title for lim in (limits if limits is not None else load_limits())}
    lines = []
    for r in rows:
        if r["match"] is None or r["match"]:
            continue
        why = "; ".join(f"{titles.get(i, i)} ({i})" for i in r.get("limits") or ()) or "no stated limit"
        lines.append(f"{r['id']}: paper {_fmt(r['paper'])}, reproduced {_fmt(r['reproduced'])} — {why}")
    return "\n".join(lines) if lines else "no judged claim was missed"


def coverage(rows: list, panels: list) -> dict:
    """Which claims a run of ``panels`` (specs) judges, and why the others are not judged: ``own`` (every panel
    of the claim was run), ``shared`` (claim id → the panels it also needs, not run: judged on the points run
    only), ``independent`` (no panel: derived, judged in every run), ``not_run``, ``not_simulable``,
    ``unavailable`` (claim ids)."""
    run = {s.id for s in panels}
    out: dict = {"own": [], "shared": {}, "independent": [], "not_run": [], "not_simulable": [], "unavailable": []}
    for r in rows:
        needed = list(r.get("check", {}).get("panels", ()))
        if r["status"] == NOT_SIMULABLE:
            out["not_simulable"].append(r["id"])
        elif r["status"] == NOT_RUN:
            out["not_run"].append(r["id"])
        elif r["status"] in (UNAVAILABLE, NO_VALID):
            out["unavailable"].append(r["id"])
        elif not needed:
            out["independent"].append(r["id"])
        elif set(needed) <= run:
            out["own"].append(r["id"])
        else:
            out["shared"][r["id"]] = [p for p in needed if p not in run]
    return out


def coverage_text(rows: list, panels: list) -> str:
    """:func:`coverage` in words: what this run judges, how fully, and why the rest is not judged."""
    from bidirl.experiments.figures import variant_text
    cov = coverage(rows, panels)
    names = "; ".join(f"{s.id}" + (f" — {variant_text(s)}" if variant_text(s) else "") for s in panels)
    parts = [f"This run covers {names}. Of the paper's {len(rows)} claims:"]
    if cov["own"]:
        parts.append(f"{len(cov['own'])} {'is' if len(cov['own']) == 1 else 'are'} this run's own "
                     f"({', '.join(cov['own'])}), judged on the points run;")
    if cov["shared"]:
        others = sorted({p for v in cov["shared"].values() for p in v})
        parts.append(f"{len(cov['shared'])} pool this run's panels with {', '.join(others)}, not run, and are "
                     "judged on this run's points alone — a partial check: under the range rule the points run "
                     "can break a range claim but cannot confirm it for the points not run;")
    if cov["independent"]:
        parts.append(f"{len(cov['independent'])} need no panel ({', '.join(cov['independent'])}: derived from "
                     "state sizes and link bandwidths) and are judged in every run;")
    if cov["unavailable"]:
        parts.append(f"{len(cov['unavailable'])} could not be computed ({', '.join(cov['unavailable'])});")
    if cov["not_run"]:
        parts.append(f"{len(cov['not_run'])} are not judged because their panels were not run;")
    if cov["not_simulable"]:
        parts.append(f"{len(cov['not_simulable'])} are about training quality (reward curves), which a simulation "
                     "cannot produce.")
    text = " ".join(parts)
    return text[:-1] + "." if text.endswith(";") else text


def claims_table(rows: list, ids: Optional[list] = None) -> pd.DataFrame:
    """The rows ``ids`` (default: every judged row) as a narrow table for a notebook: claim, paper, reproduced,
    tolerance, match, and the note (points used, rebalance bound, limits)."""
    keep = [r for r in rows if (ids is None and r["match"] is not None) or (ids is not None and r["id"] in ids)]
    return pd.DataFrame([{"claim": r["id"], "paper": _fmt(r["paper"]), "reproduced": _fmt(r["reproduced"]),
                          "tolerance": r["tolerance"], "match": "—" if r["match"] is None else
                          ("yes" if r["match"] else "no"), "note": r["note"]
                          + (f" — limits: {', '.join(r['limits'])}" if r.get("limits") else "")} for r in keep],
                        columns=["claim", "paper", "reproduced", "tolerance", "match", "note"])


def speedup_table(speedups: pd.DataFrame, panel: Optional[str] = None) -> pd.DataFrame:
    """The speedups of ``panel`` (default: all) as a narrow table: point, BiDiRL and the strongest comparator in
    tokens/s (whole numbers), the speedup and the rebalance bound (three decimals)."""
    sp = speedups if panel is None else speedups[speedups["panel"] == panel]
    out = pd.DataFrame({"point": sp["point"], "BiDiRL (tokens/s)": sp["bidirl"].round().astype("Int64"),
                        "strongest other": sp["best"],
                        "its tokens/s": sp["best_throughput"].round().astype("Int64"),
                        "speedup (×)": sp["speedup"].round(3)})
    if "rebalance_bound" in sp:
        out["rebalance bound (×)"] = sp["rebalance_bound"].round(3)
    return out.reset_index(drop=True)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if not math.isfinite(float(value)) else float(value)
    return value


def to_markdown(rows: list, *, png_note: str = "", panels: Optional[list] = None,
                baselines: Optional[list] = None, limits: Optional[list] = None) -> str:
    c = counts(rows)
    lines = ["# BiDiRL reproduction report", "",
             "Each row is one number the paper reports (data/paper/claims.yaml). `match` is computed from the "
             "values under the stated tolerance; convergence claims cannot be checked in simulation.", "",
             f"Range rule: {RANGE_RULE}", "",
             "Summary: " + ", ".join(f"{k}: {v}" for k, v in c.items()), ""]
    if png_note:
        lines += [f"Figures: HTML for every panel; {png_note}.", ""]
    lines += ["A claim's role is `fit` when its number calibrated a model (bidirl.experiments.paper_fit: the 2B "
              "switch-cost row and the 4B static sweep); every other claim is `held-out`, a prediction.", "",
              "| claim | section | role | paper | reproduced | tolerance | match | status | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        match = "—" if r["match"] is None else ("yes" if r["match"] else "no")
        note = str(r["note"]).replace("|", "/")
        if r.get("limits"):
            note += f" — limits: {', '.join(r['limits'])}"
        lines.append(f"| {r['id']} | {r['section']} | {r.get('role', 'held-out')} | {_fmt(r['paper'])} | "
                     f"{_fmt(r['reproduced'])} | {r['tolerance']} | {match} | {r['status']} | {note} |")
    if limits:
        lines += ["", "## Model limits behind the misses", "",
                  "Each mismatch above lists the limits that bear on it (data/paper/limits.yaml); a miss with none "
                  "is counted in the summary as without a stated limit.", ""]
        for lim in limits:
            missed = [r["id"] for r in rows if lim.id in r.get("limits", ())]
            lines += [f"### {lim.id}: {lim.title}", "", lim.text, "",
                      f"Misses it bears on in this run: {', '.join(missed) if missed else 'none'}.", ""]
    if baselines:
        lines += ["", "## Modelled baselines", "",
                  "Each baseline is a policy built from the mechanisms its framework's code shows "
                  "(bidirl.sim.baselines); what it does not model is listed beside what it does.", ""]
        for b in baselines:
            lines += [f"### {b['name']}", ""]
            lines += [f"- {rule}" for rule in b["rules"]]
            lines += [f"- not modelled: {gap}" for gap in b["not_modelled"]]
            lines.append("")
    if panels:
        lines += ["", "## Panels and their assumptions", ""]
        for spec in panels:
            lines += [f"### {spec.id}", "", "```", spec.doc, "```", ""]
    return "\n".join(lines) + "\n"


def baseline_rules() -> list:
    """What each modelled baseline does and does not model, for the report (bidirl.sim.baselines)."""
    from bidirl.sim.baselines import BASELINES
    return [{"name": f"{b.name} ({b.version})", "rules": list(b.rules), "not_modelled": list(b.not_modelled)}
            for b in BASELINES.values()]


def write_report(out_dir, rows: list, *, png_note: str = "", panels: Optional[list] = None,
                 extra: Optional[dict] = None) -> dict:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from bidirl.experiments.claims import load_limits
    baselines, limits = baseline_rules(), load_limits()
    rows = explain(rows, limits)
    payload = {"summary": counts(rows), "range_rule": RANGE_RULE, "figures_png": png_note,
               "panels": [s.id for s in panels] if panels else [], "baselines": baselines,
               "limits": [{"id": lim.id, "title": lim.title, "text": lim.text, "claims": list(lim.claims)}
                          for lim in limits], "claims": rows}
    if extra:
        payload.update(extra)
    (out / "report.json").write_text(json.dumps(_plain(payload), indent=2, ensure_ascii=False))
    (out / "report.md").write_text(to_markdown(rows, png_note=png_note, panels=panels, baselines=baselines,
                                               limits=limits))
    return {"json": out / "report.json", "markdown": out / "report.md"}


__all__ = ["Evidence", "Outcome", "evaluate", "explain", "static_evidence", "switch_cost_evidence", "write_report", "to_markdown",
           "counts", "coverage", "coverage_text", "claims_table", "speedup_table", "baseline_rules", "METRICS", "NOT_RUN", "NO_VALID", "NOT_SIMULABLE", "UNAVAILABLE"]
