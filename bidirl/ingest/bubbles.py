"""Where a run's time went: idle per pool from interval unions, and a bubble breakdown of every training step.

**Idle per pool** is GPU-weighted: :func:`~bidirl.results.metrics.idle_gpu_seconds` over the pool's GPU-seconds, per
pool and overall (each worker's busy time the union of its intervals, never one start/stop pair per version — the
reason veRL's ``idle_ratio`` reads near 0 on a training-bound run, verl issue #6693). The pool-union figure
(:func:`bidirl.results.metrics.idle`: no GPU of the pool busy) is kept beside it in ``pool_union_*`` columns.

**Bubble breakdown** (the trainer's view of one step, ``[start, end]`` of its StepRecord): every instant of the
step is given to the first of these that holds, so the parts partition the step and sum to its time exactly:

==========================  ===============================================================================
``training``                a training span runs (chunk, optimizer step, gradient merge), on any pool
``weight sync``             a weight sync runs and no training
``hot switch``              a switch (offload / onload, sleep / wake-up) runs, nothing above
``waiting for the batch``   generation runs on every lane that generates in this step, nothing above
``long-tail generation``    generation runs on some of those lanes only: the batch waits for its longest
                            responses while the other generation lanes idle
``trainer waiting``         nothing the trace records runs: the driver, rewards, data movement, RPCs
==========================  ===============================================================================

The sweep cuts the step at every span start and end; within each elementary interval the state is constant, so
its midpoint classifies it.

In a **colocated** run every GPU generates and then trains, so "waiting for the batch" is every GPU generating —
no bubble: :func:`bubble_breakdown` names it :data:`COLOCATED_NAMES` ``generation (every GPU)``, and the
trainer's "waiting" ``idle (nothing the trace records runs)``. A colocated run's real bubbles are the long tail of
generation, the switches and what the trace does not record (driver CPU: rewards, advantages, data). A **step
log** has no spans to sweep: its per-step categories come from its keys (:mod:`bidirl.ingest.step_breakdown`,
``ImportedRun.breakdown``) and its idle from the categories in which no GPU works.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bidirl.core.protocol import POOLS, ROLLOUT_POOL
from bidirl.ingest.run import ImportedRun
from bidirl.results import metrics
from bidirl.results.metrics import union_intervals

#: the breakdown's parts, in priority order (module doc)
BUBBLES: tuple = ("training", "weight sync", "hot switch", "waiting for the batch", "long-tail generation",
                  "trainer waiting")
TRAINING_KINDS = ("chunk", "optimizer", "grad_merge")
#: the breakdown's names in a colocated run, where generation is every GPU's work (module doc)
COLOCATED_NAMES: dict = {"waiting for the batch": "generation (every GPU)",
                         "trainer waiting": "idle (nothing the trace records runs)"}
#: columns of a breakdown that are not parts
STEP_COLUMNS: tuple = ("step", "line", "start", "end", "step_s")


def parts(breakdown: pd.DataFrame) -> list:
    """The part columns of a breakdown (:func:`bubble_breakdown`), in order: every column but the step's own."""
    return [c for c in breakdown.columns if c not in STEP_COLUMNS]
SWITCH_KINDS = ("switch_in", "switch_out")


def run_window(run: ImportedRun) -> tuple:
    """``(t0, t1)``: from the first step's start to the last step's end, or the spans' extent without steps."""
    steps = run.log.steps_df()
    if len(steps):
        return float(steps["start"].min()), float(steps["end"].max())
    spans = run.log.spans_df()
    if not len(spans):
        return 0.0, 0.0
    return float(spans["start"].min()), float(spans["end"].max())


#: columns of :func:`pool_idle`
IDLE_COLUMNS = ("pool", "gpus", "window_s", "idle_gpu_s", "idle_fraction", "pool_union_idle_s",
                "pool_union_idle_fraction")


def pool_idle(run: ImportedRun, t0: float = None, t1: float = None) -> pd.DataFrame:
    """Idle per pool over ``[t0, t1]`` (default :func:`run_window`), one row per pool and a last row
    :data:`~bidirl.results.metrics.OVERALL` for all GPUs: ``gpus, window_s``, ``idle_gpu_s`` (idle GPU-seconds),
    ``idle_fraction`` (GPU-weighted: ``idle_gpu_s / (gpus · window_s)``), and the pool-union figures
    ``pool_union_idle_s`` / ``pool_union_idle_fraction`` (seconds no GPU of the pool was busy; NaN on the overall
    row). Pools with no GPUs and no spans are left out (module doc)."""
    a, b = run_window(run) if t0 is None or t1 is None else (float(t0), float(t1))
    if run.breakdown is not None:
        return _categories_idle(run, a, b)
    spans = run.log.spans_df()
    nan = float("nan")
    rows = []
    for pool in POOLS:
        gpus = float(run.pool_gpus.get(pool, 0.0))
        if gpus <= 0 and not (spans["pool"] == pool).any():
            continue
        union = metrics.idle(spans, pool, a, b)
        gpu_idle = metrics.idle_gpu_seconds(spans, pool, run.gpus_per_worker, gpus, a, b) if gpus > 0 else nan
        rows.append({"pool": pool, "gpus": gpus, "window_s": b - a, "idle_gpu_s": gpu_idle,
                     "idle_fraction": gpu_idle / (gpus * (b - a)) if b > a and gpus > 0 else nan,
                     "pool_union_idle_s": union,
                     "pool_union_idle_fraction": union / (b - a) if b > a else nan})
    gpus = sum(r["gpus"] for r in rows)
    if gpus > 0:
        idle_s = sum(r["idle_gpu_s"] for r in rows if r["gpus"] > 0)
        rows.append({"pool": metrics.OVERALL, "gpus": gpus, "window_s": b - a, "idle_gpu_s": idle_s,
                     "idle_fraction": idle_s / (gpus * (b - a)) if b > a else nan,
                     "pool_union_idle_s": nan, "pool_union_idle_fraction": nan})
    return pd.DataFrame(rows, columns=list(IDLE_COLUMNS))


def _categories_idle(run: ImportedRun, a: float, b: float) -> pd.DataFrame:
    """:func:`pool_idle` of a step log: the steps in ``[a, b]``, idle in ``run.gpu_idle_categories`` on every GPU
    (a colocated trainer's stages run on all its GPUs at once, so GPU-weighted and pool-union idle agree)."""
    table = run.breakdown
    inside = table[(table["start"] >= a - 1e-9) & (table["end"] <= b + 1e-9)]
    gpus = float(run.pool_gpus.get(ROLLOUT_POOL, 0.0))
    window = float(inside["step_s"].sum())
    idle_s = float(inside[list(run.gpu_idle_categories)].to_numpy().sum())
    share = idle_s / window if window > 0 else float("nan")
    rows = [{"pool": ROLLOUT_POOL, "gpus": gpus, "window_s": window, "idle_gpu_s": gpus * idle_s,
             "idle_fraction": share, "pool_union_idle_s": idle_s, "pool_union_idle_fraction": share},
            {"pool": metrics.OVERALL, "gpus": gpus, "window_s": window, "idle_gpu_s": gpus * idle_s,
             "idle_fraction": share, "pool_union_idle_s": float("nan"), "pool_union_idle_fraction": float("nan")}]
    return pd.DataFrame(rows, columns=list(IDLE_COLUMNS))


def _covered(starts: np.ndarray, ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Whether each time in ``t`` lies inside the union of ``[starts, ends]``."""
    us, ue = union_intervals(starts, ends)
    if not us.size:
        return np.zeros(t.size, dtype=bool)
    i = np.searchsorted(us, t, side="right") - 1
    return (i >= 0) & (t < ue[np.maximum(i, 0)])


def step_bubbles(spans: pd.DataFrame, a: float, b: float) -> dict:
    """Seconds of each of :data:`BUBBLES` in the window ``[a, b]`` (module doc); they sum to ``b − a``."""
    out = dict.fromkeys(BUBBLES, 0.0)
    if b <= a:
        return out
    s = spans[(spans["start"] < b) & (spans["end"] > a)]
    start = np.clip(s["start"].to_numpy(dtype=np.float64), a, b)
    end = np.clip(s["end"].to_numpy(dtype=np.float64), a, b)
    cuts = np.unique(np.concatenate([[a, b], start, end]))
    mid = (cuts[:-1] + cuts[1:]) / 2
    length = np.diff(cuts)
    kind = s["kind"].to_numpy(dtype=object)
    train = _covered(start[np.isin(kind, TRAINING_KINDS)], end[np.isin(kind, TRAINING_KINDS)], mid)
    sync = _covered(start[kind == "sync"], end[kind == "sync"], mid)
    switch = _covered(start[np.isin(kind, SWITCH_KINDS)], end[np.isin(kind, SWITCH_KINDS)], mid)
    gen = kind == "generate"
    lanes = s["worker"].to_numpy(dtype=object)[gen]
    busy = np.zeros(mid.size, dtype=np.int64)
    for lane in np.unique(lanes):
        us, ue = union_intervals(start[gen][lanes == lane], end[gen][lanes == lane])
        busy += np.searchsorted(us, mid, side="right") - np.searchsorted(ue, mid, side="right")
    width = len(np.unique(lanes))
    label = np.full(mid.size, BUBBLES.index("trainer waiting"))
    label[(busy > 0) & (busy < width)] = BUBBLES.index("long-tail generation")
    label[(busy >= width) & (width > 0)] = BUBBLES.index("waiting for the batch")
    label[switch] = BUBBLES.index("hot switch")
    label[sync] = BUBBLES.index("weight sync")
    label[train] = BUBBLES.index("training")
    sums = np.bincount(label, weights=length, minlength=len(BUBBLES))
    return {name: float(v) for name, v in zip(BUBBLES, sums)}


def bubble_breakdown(run: ImportedRun) -> pd.DataFrame:
    """One row per training step: ``step, start, end, step_s`` and the seconds of each part (they sum to
    ``step_s``): a step log's categories (``run.breakdown``), else :data:`BUBBLES` from the spans, named by
    :data:`COLOCATED_NAMES` in a colocated run (module doc). Empty when the run has no complete step."""
    if run.breakdown is not None:
        table = run.breakdown
        return table[["step", "line", "start", "end", "step_s", *parts(table)]].reset_index(drop=True)
    table = _span_breakdown(run)
    return table.rename(columns=COLOCATED_NAMES) if run.colocated else table


def _span_breakdown(run: ImportedRun) -> pd.DataFrame:
    spans = run.log.spans_df()
    steps = run.log.steps_df().sort_values("step", kind="stable")
    rows = []
    for r in steps.itertuples(index=False):
        parts = step_bubbles(spans, float(r.start), float(r.end))
        rows.append({"step": int(r.step), "start": float(r.start), "end": float(r.end),
                     "step_s": float(r.end - r.start), **parts})
    return pd.DataFrame(rows, columns=["step", "start", "end", "step_s", *BUBBLES])


def bubble_shares(breakdown: pd.DataFrame) -> pd.Series:
    """Each part's share of the total step time over all steps (sums to 1)."""
    total = float(breakdown["step_s"].sum())
    cols = parts(breakdown)
    return breakdown[cols].sum() / total if total > 0 else breakdown[cols].sum() * np.nan
