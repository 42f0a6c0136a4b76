"""The paper's evaluation (§7) as data, and ``bidirl reproduce``.

* :mod:`~bidirl.experiments.specs` — one declarative spec per figure panel;
* :mod:`~bidirl.experiments.run` — run a panel's (policy × point) grid with the simulator, speedups;
* :mod:`~bidirl.experiments.stage_models` — stage-time model calibration errors (§7.4);
* :mod:`~bidirl.experiments.claims` — the paper's numbers (``data/paper/claims.yaml``) and the tolerance rule;
* :mod:`~bidirl.experiments.report` — one row per claim, ``report.json`` / ``report.md``;
* :mod:`~bidirl.experiments.figures` — plotly figures per panel.

:func:`reproduce` ties them together; :func:`cli_reproduce` is the ``bidirl reproduce`` command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from bidirl.experiments.specs import SPECS, PanelSpec, get, select


def reproduce(out_dir="reproduce", only: Optional[Sequence[str]] = None, quick: bool = False, *,
              simulate_fn: Optional[Callable] = None, max_workers: int = 2, progress: bool = True,
              plan_fn: Optional[Callable] = None, fit_fn: Optional[Callable] = None,
              derive_fn: Optional[Callable] = None, cache: bool = True, cache_dir=None) -> dict:
    """Run the selected panels (all by default; ``only`` takes panel ids or id prefixes such as ``e2e-a6000``),
    check every claim of ``data/paper/claims.yaml`` and write ``out_dir``: ``report.json``, ``report.md``,
    ``results.csv`` (one row per simulated cell), ``speedups.csv`` and one HTML figure per panel.

    ``quick`` runs each panel's CI-sized variant. Simulated runs are cached (:mod:`bidirl.experiments.cache`:
    keyed by config, policy, steps, seed and the code version) under ``cache_dir`` (default ``$BIDIRL_CACHE`` or
    ``~/.cache/bidirl``), so a second reproduction only rebuilds the report, and a figure's PNG is copied from
    ``<cache>/png`` when the figure did not change; ``cache=False`` simulates every run
    again (and stores nothing). The other keyword-only arguments inject replacements for the simulator, the
    planner, the calibration and the switch-cost derivation (tests use them).

    Returns ``{"out_dir", "summary", "claims", "files", "png", "results", "speedups"}`` (the last two are
    pandas DataFrames).
    """
    from bidirl.experiments import figures as figs
    from bidirl.experiments import report as rep
    from bidirl.experiments.claims import load_claims
    from bidirl.experiments.run import run_specs, speedups
    from bidirl.experiments.stage_models import run_stage_panel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = select(only, quick=quick)
    sim_specs = [s for s in specs if s.kind in ("end-to-end", "ablation", "static")]
    from bidirl.experiments.cache import RunCache
    runs = RunCache.at(cache_dir) if cache and simulate_fn is None else None
    results = run_specs(sim_specs, simulate_fn=simulate_fn, max_workers=max_workers, progress=progress, cache=runs)
    by_id = {s.id: s for s in specs}
    sp = speedups(results, by_id)

    evidence = rep.Evidence(results=results, speedups=sp)
    for s in specs:
        if s.kind == "static":
            evidence.static[s.id] = rep.static_evidence(s, results, plan_fn=plan_fn)
        elif s.kind == "stage-model":
            try:
                evidence.stage[s.id] = run_stage_panel(s, quick=quick, fit_fn=fit_fn)
            except Exception as exc:  # noqa: BLE001 — reported in the claim rows, never fatal
                evidence.stage[s.id] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        evidence.switch_costs = rep.switch_cost_evidence(derive_fn)
    except Exception as exc:  # noqa: BLE001
        evidence.switch_costs = {"error": f"{type(exc).__name__}: {exc}"}

    rows = rep.evaluate(load_claims(), evidence)

    figures = {}
    for s in specs:
        if s.kind == "static":
            figures[s.id] = figs.static_figure(s, results, evidence.static[s.id].get("sweep"))
        elif s.kind == "stage-model":
            figures[s.id] = figs.stage_figure(s, evidence.stage[s.id].get("records"))
        else:
            figures[s.id] = figs.panel_figure(s, results, sp)
    fig_paths, png_note = figs.write_figures(figures, out / "figures",
                                             png_cache=runs.root / "png" if runs is not None else None)

    results.to_csv(out / "results.csv", index=False)
    sp.to_csv(out / "speedups.csv", index=False)
    files = rep.write_report(out, rows, png_note=png_note, panels=specs,
                             extra={"quick": quick, "only": list(only) if only else None})
    return {"out_dir": str(out), "summary": rep.counts(rows), "claims": rows,
            "files": [str(p) for p in (files["json"], files["markdown"], out / "results.csv",
                                       out / "speedups.csv", *fig_paths)],
            "png": png_note, "results": results, "speedups": sp}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bidirl reproduce`` options (for ``bidirl.cli``'s command table)."""
    p.add_argument("--out", default="reproduce", help="output folder (default: ./reproduce)")
    p.add_argument("--only", nargs="+", metavar="PANEL",
                   help="panel ids or id prefixes to run, e.g. e2e-a6000-response abl static "
                        f"(known: {', '.join(SPECS)})")
    p.add_argument("--quick", action="store_true", help="CI-sized variant: fewer points and steps")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--workers", type=int, default=2, help="simulation processes (default 2; 0 = in-process)")
    p.add_argument("--no-cache", action="store_true",
                   help="simulate every run again instead of reusing cached runs (and cache nothing)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where simulated runs are cached (default: $BIDIRL_CACHE or ~/.cache/bidirl)")


def run_args(args: argparse.Namespace) -> int:
    """Run ``bidirl reproduce`` from parsed arguments; returns the exit status (0 ran, 2 bad arguments).
    Mismatched claims are a finding, not an error: they do not change the status."""
    import json

    if args.only:
        try:
            select(args.only)
        except ValueError as exc:
            print(f"error: --only: {exc}", file=sys.stderr)
            return 2
    if args.workers < 0:
        print("error: --workers must be ≥ 0 (0 runs the simulations in this process)", file=sys.stderr)
        return 2
    res = reproduce(args.out, only=args.only, quick=args.quick, max_workers=args.workers,
                    progress=not args.json, cache=not args.no_cache, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps({"out_dir": res["out_dir"], "summary": res["summary"], "png": res["png"],
                          "report": str(Path(res["out_dir"]) / "report.json")}))
    else:
        print(f"report: {Path(res['out_dir']) / 'report.md'}")
        print("summary: " + ", ".join(f"{k} {v}" for k, v in res["summary"].items()))
        print(f"figures: {res['png']}")
    return 0


def cli_reproduce(argv: Optional[Sequence[str]] = None) -> int:
    """``bidirl reproduce [--out DIR] [--only PANEL ...] [--quick] [--json] [--workers N] [--no-cache]
    [--cache-dir DIR]``; the exit status."""
    p = argparse.ArgumentParser(prog="bidirl reproduce",
                                description="Reproduce the paper's evaluation (§7) in simulation and check "
                                            "every reported number.")
    add_arguments(p)
    return run_args(p.parse_args(list(argv) if argv is not None else None))


__all__ = ["reproduce", "cli_reproduce", "add_arguments", "run_args", "SPECS", "PanelSpec", "get", "select"]
