"""Decision regret of the admission gates (§3.2 Eq. 3, §5.2 Algorithm 2), measured by counterfactuals.

For every gate decision of a simulated BiDiRL run, the run is simulated again with the same seed and that one
decision taken the other way (``Settings.flipped_decisions``); everything before it is the same run. A flip that
raises the run's total-run throughput marks a wrong decision, and its log ratio is what the wrong decision cost.
The two runs also give the waits each decision predicted, one realized by the run and the other by its flip:

* Rollouter-on-TrainerPool: the time from the decision to the start of consuming its step's batch without the
  window (T_no) and with it (C_in + T_joint + C_out);
* Trainer-on-RolloutPool: the time from the decision until the step's workload U (what the gate timed:
  :meth:`~bidirl.core.chunks.TrainerStep.remaining_work`) is done and its optimizer step can start, without the
  window (T_no) and with it (T_borrow): realized, the end of the optimizer step that follows U — or of the
  window's switch back, when that ends later — less that optimizer step's duration (the window's tail,
  :func:`bidirl.core.gates.window_tail`, excludes the optimizer step, paid with or without borrowing). U ends
  with the step's first optimizer mini-batch unless the auxiliary gang is refreshed between mini-batches
  (:attr:`~bidirl.core.chunks.TrainerStep.aux_last_segment`), so the optimizer step is the first of the step
  after the decision, or its last.

Simulated, not measured: it measures the gates against the simulator that runs their decisions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import numpy as np
import pandas as pd

from bidirl.core import protocol as P
from bidirl.experiments.run import total_run_throughput

COLUMNS = ("panel", "point", "decision", "direction", "t", "step", "admitted", "predicted_gain", "cost",
           "flip_ratio", "t_no", "wait_with", "realized_no", "realized_with")


def _driver(cfg, flip: Optional[int]):
    """The simulation of ``cfg``'s BiDiRL run, decision ``flip`` (if any) taken the other way; not run yet."""
    from bidirl.sim import SimDriver
    driver = SimDriver(cfg, "bidirl", cfg.workload.steps, cfg.seed)
    if flip is not None:
        settings = driver.coordinator.settings
        driver.coordinator.settings = dataclasses.replace(settings, flipped_decisions=frozenset({int(flip)}))
    return driver


def _simulate(cfg, flip: Optional[int]):
    return _driver(cfg, flip).run()


def _workload_done(spans: pd.DataFrame, step: int, t: float, last: bool) -> float:
    """When the Trainer-on-RolloutPool workload of step ``step`` timed at ``t`` was done, as the gate times it
    (module doc), from a run's ``spans`` (``EventLog.spans_df``): the end of the optimizer step that follows it
    (the step's first after ``t``, or its ``last``) or of a Trainer-on-RolloutPool switch back of the step after
    ``t`` if later, less that optimizer step's duration; NaN if no optimizer step follows."""
    mine = spans[(spans["step"] == step) & (spans["start"] >= t)]
    opt = mine[mine["kind"] == "optimizer"].sort_values("start", kind="stable")
    if not len(opt):
        return math.nan
    o = opt.iloc[-1] if last else opt.iloc[0]
    back = mine[(mine["kind"] == "switch_out")
                & mine["detail"].map(lambda d: d.get("direction") == P.TRAINER_ON_ROLLOUT_POOL)]
    end = max(float(o["end"]), float(back["end"].min()) if len(back) else -math.inf)
    return end - float(o["end"] - o["start"])


def _consume_start(result, step: int) -> float:
    """When the run started consuming step ``step``'s batch (its start plus its wait), NaN if it never did."""
    steps = result.log.steps_df()
    row = steps[steps["step"] == step]
    return float(row["start"].iloc[0] + row["wait"].iloc[0]) if len(row) else math.nan


def run_regret(cfg, panel: str = "", point: str = "") -> list:
    """One row per gate decision of ``cfg``'s BiDiRL run (:data:`COLUMNS`): the decision, the flipped run's
    total-run throughput over the run's (``flip_ratio``), and the predicted and realized waits (module doc)."""
    driver = _driver(cfg, None)
    refreshed = driver.coordinator.settings.aux_refresh_seconds is not None    # U ends with the step's last update
    base = driver.run()
    base_spans = base.log.spans_df()
    base_throughput = total_run_throughput(base.log.steps_df())
    rows = []
    for k, d in enumerate(base.log.decisions):
        flipped = _simulate(cfg, k)
        row = {"panel": panel, "point": point, "decision": k, "direction": d.direction, "t": d.t,
               "step": d.detail.get("step", math.nan), "admitted": d.admitted, "predicted_gain": d.predicted_gain,
               "cost": d.cost, "flip_ratio": total_run_throughput(flipped.log.steps_df()) / base_throughput,
               "t_no": math.nan, "wait_with": math.nan, "realized_no": math.nan, "realized_with": math.nan}
        step = int(d.detail["step"])
        if d.direction == P.ROLLOUT_ON_TRAINER_POOL:
            here, there = _consume_start(base, step) - d.t, _consume_start(flipped, step) - d.t
            predicted_with = d.detail["t_joint"] + d.cost
        else:
            here = _workload_done(base_spans, step, d.t, refreshed) - d.t
            there = _workload_done(flipped.log.spans_df(), step, d.t, refreshed) - d.t
            predicted_with = d.detail["t_borrow"]
        row.update(t_no=d.detail["t_no"], wait_with=predicted_with,
                   realized_no=there if d.admitted else here, realized_with=here if d.admitted else there)
        rows.append(row)
    return rows


def reproduce_points(quick: bool = False) -> list:
    """``(panel, point label, config)`` of every BiDiRL run ``bidirl reproduce`` simulates (``quick``: the
    ablation panels' quick points only)."""
    from bidirl.experiments.specs import all_specs
    out = []
    for panel, spec in all_specs().items():
        if "bidirl" not in spec.policies or (quick and spec.kind != "ablation"):
            continue
        for point in spec.points:
            if quick and spec.quick_labels and point.label not in spec.quick_labels:
                continue
            out.append((panel, point.label, spec.config(point)))
    return out


def regret_frame(points: Iterable, progress: bool = False) -> pd.DataFrame:
    """:func:`run_regret` over ``points`` (``(panel, label, config)``), one frame."""
    from tqdm.auto import tqdm
    points = list(points)
    rows = []
    for panel, label, cfg in tqdm(points, desc="gate regret", unit="run", disable=not progress):
        rows += run_regret(cfg, panel, label)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def summarize(frame: pd.DataFrame) -> dict:
    """Per direction: decisions, admitted, wrong ones (a flip that raises the run's throughput), those of them that
    were refusals, their summed log gain and the largest; the median and 90th percentile |error| and the mean
    signed error of the predicted waits with the window (``wait_with``) and without it (``t_no``)."""
    out = {}
    for direction in P.DIRECTIONS:
        part = frame[frame["direction"] == direction]
        wrong = part[part["flip_ratio"] > 1.0]
        entry = {"decisions": int(len(part)), "admitted": int(part["admitted"].sum()), "wrong": int(len(wrong)),
                 "wrong_refusals": int((~wrong["admitted"].astype(bool)).sum()),
                 "regret_log_sum": float(np.log(wrong["flip_ratio"]).sum()),
                 "regret_max": float(part["flip_ratio"].max()) if len(part) else math.nan}
        if len(part) and "wait_with" in part:
            for name, pred, real in (("wait_with", "wait_with", "realized_with"), ("t_no", "t_no", "realized_no")):
                err = (part[pred] - part[real]).dropna().to_numpy()
                entry[f"{name}_abs_median_s"] = float(np.median(np.abs(err))) if err.size else math.nan
                entry[f"{name}_abs_p90_s"] = float(np.percentile(np.abs(err), 90)) if err.size else math.nan
                entry[f"{name}_mean_s"] = float(err.mean()) if err.size else math.nan
        out[direction] = entry
    return out
