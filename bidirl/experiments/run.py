"""Run a panel's grid (policy × point) with the simulator and compute the paper's speedups (§7.1–§7.3).

Every (point, policy) cell becomes one :class:`Task`. A modelled baseline that cannot run a point
(:mod:`bidirl.sim.baselines`, ``supports``) is recorded as ``unsupported`` with its reason and never
simulated; a run that raises (an infeasible memory layout, a simulator error) is recorded as ``failed``.
Neither counts in a speedup, as the paper excludes "OOM, failed, and unsupported runs" (Fig. eval-main).

Speedup at a point (§7.2 / §7.3): BiDiRL's throughput divided by the strongest valid comparator's — the
external baselines for end-to-end panels, the ablated variants for ablation panels.

Cells run in a :class:`concurrent.futures.ProcessPoolExecutor` (two workers by default: the machine's two
cores), every panel's cells queued at once behind one tqdm bar; a run several panels share is simulated once,
and a :class:`~bidirl.experiments.cache.RunCache` answers the runs simulated before (same config, policy,
steps, seed and code). ``simulate_fn`` replaces :func:`bidirl.sim.simulate` (tests inject a fake; it is never
cached); with worker processes it must be a module-level function so it can be pickled.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import numpy as np
import pandas as pd

from bidirl.experiments.specs import PanelSpec
from bidirl.job import config as cfgmod

STATUS_OK, STATUS_UNSUPPORTED, STATUS_FAILED = "ok", "unsupported", "failed"

RESULT_COLUMNS = ("panel", "kind", "order", "point", "value", "policy", "status", "reason", "throughput",
                  "summary_throughput", "total_run_throughput", "utilization", "idle_rollout_pool",
                  "idle_trainer_pool", "borrows_rollout_on_trainer_pool", "borrows_trainer_on_rollout_pool",
                  "borrows_rejected", "samples_lost", "samples_duplicated", "steps", "seed", "wall_s")


@dataclass(frozen=True)
class Task:
    """One simulation: a panel's point under one policy."""
    panel: str
    kind: str
    order: int
    point: str
    value: Any
    policy: str
    config: dict
    steps: int
    seed: int
    metric: str


def tasks(spec: PanelSpec) -> list:
    """The panel's grid, point-major (every policy of a point before the next point)."""
    out = []
    for i, point in enumerate(spec.points):
        cfg = spec.config(point)
        for policy in spec.policies:
            out.append(Task(spec.id, spec.kind, i, point.label, point.value, policy, cfg.to_dict(),
                            cfg.workload.steps, cfg.seed, spec.metric))
    return out


def _row(task: Task, status: str, reason: str = "", **values) -> dict:
    row = {c: np.nan for c in RESULT_COLUMNS}
    row.update(panel=task.panel, kind=task.kind, order=task.order, point=task.point, value=task.value,
               policy=task.policy, status=status, reason=reason, steps=task.steps, seed=task.seed)
    row.update(values)
    return row


def unsupported_reason(task: Task, job: Optional[cfgmod.JobConfig] = None) -> Optional[str]:
    """Why a modelled baseline cannot run this task's job (``None`` for core policies and supported jobs).
    ``job`` is the task's config already built (else it is built from ``task.config``)."""
    from bidirl.sim.baselines import unsupported_reason as reason_of
    return reason_of(task.policy, job if job is not None else cfgmod.from_dict(task.config))


def total_run_throughput(steps_df: pd.DataFrame) -> float:
    """Tokens of every complete step divided by the time from the first step's start to the last one's end
    (the paper's ablation / static-split metric, §7.3: "total-run throughput over all complete metric steps")."""
    if steps_df is None or len(steps_df) == 0:
        return float("nan")
    span = float(steps_df["end"].max() - steps_df["start"].min())
    return float(steps_df["tokens"].sum()) / span if span > 0 else float("nan")


def _summary_values(result) -> dict:
    from bidirl.results.metrics import summary_row
    row = summary_row(result.summary())
    row["summary_throughput"] = row.pop("throughput")
    row.pop("step_time_s")
    log = getattr(result, "log", None)
    row["total_run_throughput"] = total_run_throughput(log.steps_df()) if log is not None else float("nan")
    return row


def simulate_cell(task: Task, simulate_fn: Optional[Callable] = None) -> dict:
    """Simulate one cell: ``{"status", "reason", "values", "wall_s"}`` (``values``: the run summary's, for the
    report). Never raises for a run's own failure: the status says ``failed`` (or ``unsupported``) and why."""
    if simulate_fn is None:
        from bidirl.sim import simulate as simulate_fn
    t0 = time.perf_counter()
    try:
        cfg = cfgmod.from_dict(task.config)
        result = simulate_fn(cfg, task.policy, steps=task.steps, seed=task.seed, progress=False)
        values = _summary_values(result)
    except Exception as exc:  # noqa: BLE001 — every failure becomes a recorded, excluded run
        status = STATUS_UNSUPPORTED if type(exc).__name__ == "UnsupportedSetting" else STATUS_FAILED
        return {"status": status, "reason": f"{type(exc).__name__}: {exc}", "values": {},
                "wall_s": time.perf_counter() - t0}
    return {"status": STATUS_OK, "reason": "", "values": values, "wall_s": time.perf_counter() - t0}


def cell_row(task: Task, outcome: dict) -> dict:
    """The results row of ``task`` from what its simulation produced (:func:`simulate_cell`)."""
    if outcome["status"] != STATUS_OK:
        return _row(task, outcome["status"], outcome["reason"], wall_s=outcome["wall_s"])
    values = outcome["values"]
    metric = values["total_run_throughput"] if task.metric == "total_run_throughput" else values["summary_throughput"]
    if not (isinstance(metric, float) and math.isfinite(metric) and metric > 0):
        return _row(task, STATUS_FAILED, f"no measurable {task.metric} ({metric!r})", wall_s=outcome["wall_s"],
                    **values)
    return _row(task, STATUS_OK, "", throughput=metric, wall_s=outcome["wall_s"], **values)


def run_task(task: Task, simulate_fn: Optional[Callable] = None) -> dict:
    """Simulate one cell; never raises for a run's own failure (the row says ``failed`` and why)."""
    return cell_row(task, simulate_cell(task, simulate_fn))


def _static_rows(cells: list) -> tuple:
    """Rows for the cells decided without simulating (a baseline that cannot run the point, a point that does
    not plan), and the cells left to simulate."""
    rows, pending = [], []
    jobs: dict = {}                  # the policies of a point share its config: built and validated once
    for task in cells:
        try:
            key = json.dumps(task.config, sort_keys=True, default=str)
            if key not in jobs:
                jobs[key] = cfgmod.from_dict(task.config)
            reason = unsupported_reason(task, jobs[key])
        except Exception as exc:  # noqa: BLE001 — e.g. the planner finds no feasible layout
            rows.append(_row(task, STATUS_FAILED, f"{type(exc).__name__}: {exc}"))
            continue
        if reason is not None:
            rows.append(_row(task, STATUS_UNSUPPORTED, reason))
        else:
            pending.append(task)
    return rows, pending


def _simulate_all(pending: list, *, simulate_fn, max_workers: int, executor, cache, bar) -> list:
    """Rows of the cells to simulate: from ``cache`` where it has them, else simulated — each distinct run
    once (panels share runs), in this process (``max_workers=0``) or on worker processes, one cell per task;
    new runs are stored in ``cache``."""
    keyed = {}                                     # run -> the cells it answers
    for task in pending:
        run = (json.dumps(task.config, sort_keys=True, default=str), task.policy, task.steps, task.seed)
        keyed.setdefault(run, []).append(task)
    outcomes, todo = {}, []
    for run, tasks_ in keyed.items():
        key = cache.key(tasks_[0].config, *run[1:]) if cache is not None else None
        hit = cache.get(key) if key is not None else None
        if hit is not None:
            outcomes[run] = hit
            bar.update(len(tasks_))
            cached = getattr(bar, "cached", 0) + len(tasks_)
            bar.cached = cached          # the bar's rate then counts look-ups, not simulations: say so
            bar.set_postfix_str(f"{cached} of {bar.total} from the run cache, not simulated now", refresh=False)
        else:
            todo.append((run, key))

    def done(run, key, outcome):
        outcomes[run] = outcome
        if key is not None and outcome["status"] != STATUS_FAILED:
            cache.put(key, outcome)
        bar.update(len(keyed[run]))

    if max_workers == 0 and executor is None:
        for run, key in todo:
            done(run, key, simulate_cell(keyed[run][0], simulate_fn))
    elif todo:
        own = executor is None
        pool = ProcessPoolExecutor(max_workers=max_workers) if own else executor
        try:
            futures = {pool.submit(simulate_cell, keyed[run][0], simulate_fn): (run, key) for run, key in todo}
            for fut in as_completed(futures):
                done(*futures[fut], fut.result())
        finally:
            if own:
                pool.shutdown()
    return [cell_row(task, outcomes[run]) for run, tasks_ in keyed.items() for task in tasks_]


def run_panel(spec: PanelSpec, *, simulate_fn: Optional[Callable] = None, max_workers: int = 2,
              progress: bool = True, executor=None, cache=None) -> pd.DataFrame:
    """Run every (point, policy) cell of ``spec``; one row per cell (columns :data:`RESULT_COLUMNS`).

    ``max_workers=0`` runs the cells in this process (no pickling). Pass ``executor`` to share a pool, and
    ``cache`` (a :class:`~bidirl.experiments.cache.RunCache`, real simulator only) to reuse runs.
    """
    if spec.kind == "stage-model":
        raise ValueError(f"panel {spec.id} is a stage-model panel: run it with "
                         "bidirl.experiments.stage_models.run_stage_panel")
    return run_specs([spec], simulate_fn=simulate_fn, max_workers=max_workers, progress=progress,
                     executor=executor, cache=cache, desc=spec.id)


def run_specs(specs: Iterable[PanelSpec], *, simulate_fn: Optional[Callable] = None, max_workers: int = 2,
              progress: bool = True, executor=None, cache=None, desc: str = "simulate") -> pd.DataFrame:
    """Run the cells of several simulation panels together (one pool, one progress bar); the rows of all.

    Every cell of every panel is queued at once, so both worker processes stay busy until the last cell;
    ``cache`` (real simulator only) answers the runs it holds and keeps the new ones."""
    from tqdm.auto import tqdm

    specs = [s for s in specs if s.kind != "stage-model"]
    cells = [task for s in specs for task in tasks(s)]
    rows, pending = _static_rows(cells)
    if simulate_fn is not None:
        cache = None                               # the code version does not cover an injected simulator
    with tqdm(total=len(cells), desc=desc, unit="run", disable=not progress, leave=True) as bar:
        bar.update(len(rows))
        rows += _simulate_all(pending, simulate_fn=simulate_fn, max_workers=max_workers, executor=executor,
                              cache=cache, bar=bar)
    return results_frame(rows)


def results_frame(rows: list) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
    if len(df):
        df = df.sort_values(["panel", "order", "policy"], kind="stable").reset_index(drop=True)
    return df


# --------------------------------------------------------------------------------------------------
# Speedups
# --------------------------------------------------------------------------------------------------

def _valid(results: pd.DataFrame) -> pd.DataFrame:
    ok = results[(results["status"] == STATUS_OK)]
    return ok[np.isfinite(ok["throughput"].astype(float)) & (ok["throughput"].astype(float) > 0)]


def rebalance_bound(spec, point) -> float:
    """The most any borrowing policy can gain over no-borrow in a steady step at ``point`` under the stage-time
    models: the planner's stage times T_r, T_t on the point's split (g_r, g_t GPUs) give the slower pool's step time
    ``max(T_r, T_t)``, while perfectly shared work with free switches would take ``(g_r·T_r + g_t·T_t) / G``.
    A whole run's ratio can exceed it: its first step, where the trainer pool waits for the first batch, is not a
    steady step. NaN where the point has no fixed split or does not plan."""
    from bidirl.job.planner import plan
    try:
        cfg = spec.config(point)
        if cfg.cluster.partition is None:
            return float("nan")
        env = plan(cfg).envelope
    except Exception:  # noqa: BLE001 — a point that does not plan has no bound; its runs report why
        return float("nan")
    g_r, g_t = env.rollout_gpus, env.trainer_gpus
    shared = (g_r * env.rollout_time + g_t * env.trainer_time) / (g_r + g_t)
    return float(max(env.rollout_time, env.trainer_time) / shared) if shared > 0 else float("nan")


def speedups(results: pd.DataFrame, specs: Optional[dict] = None) -> pd.DataFrame:
    """One row per (panel, point): BiDiRL's throughput, the strongest valid comparator and the speedup over it,
    plus BiDiRL's ratio over every individual comparator (``over:<policy>``, NaN where that one is invalid) and
    the models' :func:`rebalance_bound` at the point.

    The comparators of a panel are its spec's non-BiDiRL policies (``specs`` maps panel id → spec; without it,
    every other policy present in the results). A point where BiDiRL itself failed has a NaN speedup.
    """
    if specs is None:
        from bidirl.experiments.specs import SPECS as specs
    rows = []
    columns = ["panel", "order", "point", "value", "bidirl", "best", "best_throughput", "speedup",
               "valid_comparators"]
    if results is None or len(results) == 0:
        return pd.DataFrame(columns=columns)
    valid = _valid(results)
    for (panel, order), cell in results.groupby(["panel", "order"], sort=True):
        point = cell["point"].iloc[0]
        spec = specs.get(panel)
        if spec is not None and "bidirl" not in spec.policies:
            continue                                  # static-split sweeps compare partitions, not policies
        comparators = spec.comparators if spec is not None else tuple(p for p in cell["policy"].unique()
                                                                      if p != "bidirl")
        v = valid[(valid["panel"] == panel) & (valid["order"] == order)]
        tp = dict(zip(v["policy"], v["throughput"].astype(float)))
        bidirl = tp.get("bidirl", float("nan"))
        comp = {p: tp[p] for p in comparators if p in tp}
        best = max(comp, key=comp.get) if comp else None
        best_tp = comp[best] if best else float("nan")
        row = {"panel": panel, "order": int(order), "point": point, "value": cell["value"].iloc[0],
               "bidirl": bidirl, "best": best, "best_throughput": best_tp,
               "speedup": bidirl / best_tp if best else float("nan"),
               "valid_comparators": len(comp)}
        for p in comparators:
            row[f"over:{p}"] = bidirl / comp[p] if p in comp else float("nan")
        row["rebalance_bound"] = rebalance_bound(spec, point) if spec is not None else float("nan")
        rows.append(row)
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=columns)


__all__ = ["Task", "tasks", "run_task", "simulate_cell", "cell_row", "run_panel", "run_specs", "results_frame",
           "speedups", "total_run_throughput", "rebalance_bound", "RESULT_COLUMNS", "STATUS_OK", "STATUS_UNSUPPORTED",
           "STATUS_FAILED"]
