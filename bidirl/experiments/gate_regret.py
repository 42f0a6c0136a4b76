"""Decision regret of the admission gates (§3.2 Eq. 3, §5.2 Algorithm 2), measured by counterfactuals.

For every gate decision of a simulated BiDiRL run, the run is simulated again with the same seed and that one
decision taken the other way (``Settings.flipped_decisions``); everything before it is the same run. A flip that
raises the run's total-run throughput marks a wrong decision, and its log ratio is what the wrong decision cost.
For a Rollouter-on-TrainerPool decision the two runs also give the wait it predicted: the time from the decision
to the start of consuming its step's batch without the window (T_no) and with it (C_in + T_joint + C_out), one of
them realized by the run and the other by its flip. Simulated, not measured: it measures the gates against the
simulator that runs their decisions.
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


def _simulate(cfg, flip: Optional[int]):
    from bidirl.sim import SimDriver
    driver = SimDriver(cfg, "bidirl", cfg.workload.steps, cfg.seed)
    if flip is not None:
        settings = driver.coordinator.settings
        driver.coordinator.settings = dataclasses.replace(settings, flipped_decisions=frozenset({int(flip)}))
    return driver.run()


def _consume_start(result, step: int) -> float:
    """When the run started consuming step ``step``'s batch (its start plus its wait), NaN if it never did."""
    steps = result.log.steps_df()
    row = steps[steps["step"] == step]
    return float(row["start"].iloc[0] + row["wait"].iloc[0]) if len(row) else math.nan


def run_regret(cfg, panel: str = "", point: str = "") -> list:
    """One row per gate decision of ``cfg``'s BiDiRL run (:data:`COLUMNS`): the decision, the flipped run's
    total-run throughput over the run's (``flip_ratio``), and for Rollouter-on-TrainerPool decisions the predicted
    and realized waits."""
    base = _simulate(cfg, None)
    base_throughput = total_run_throughput(base.log.steps_df())
    rows = []
    for k, d in enumerate(base.log.decisions):
        flipped = _simulate(cfg, k)
        row = {"panel": panel, "point": point, "decision": k, "direction": d.direction, "t": d.t,
               "step": d.detail.get("step", math.nan), "admitted": d.admitted, "predicted_gain": d.predicted_gain,
               "cost": d.cost, "flip_ratio": total_run_throughput(flipped.log.steps_df()) / base_throughput,
               "t_no": math.nan, "wait_with": math.nan, "realized_no": math.nan, "realized_with": math.nan}
        if d.direction == P.ROLLOUT_ON_TRAINER_POOL:
            step = int(d.detail["step"])
            here, there = _consume_start(base, step) - d.t, _consume_start(flipped, step) - d.t
            row.update(t_no=d.detail["t_no"], wait_with=d.detail["t_joint"] + d.cost,
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
    were refusals, their summed log gain and the largest; for Rollouter-on-TrainerPool the median and 90th
    percentile |error| and the mean signed error of the predicted waits."""
    out = {}
    for direction in P.DIRECTIONS:
        part = frame[frame["direction"] == direction]
        wrong = part[part["flip_ratio"] > 1.0]
        entry = {"decisions": int(len(part)), "admitted": int(part["admitted"].sum()), "wrong": int(len(wrong)),
                 "wrong_refusals": int((~wrong["admitted"].astype(bool)).sum()),
                 "regret_log_sum": float(np.log(wrong["flip_ratio"]).sum()),
                 "regret_max": float(part["flip_ratio"].max()) if len(part) else math.nan}
        if direction == P.ROLLOUT_ON_TRAINER_POOL and len(part):
            for name, pred, real in (("wait_with", "wait_with", "realized_with"), ("t_no", "t_no", "realized_no")):
                err = (part[pred] - part[real]).dropna().to_numpy()
                entry[f"{name}_abs_median_s"] = float(np.median(np.abs(err))) if err.size else math.nan
                entry[f"{name}_abs_p90_s"] = float(np.percentile(np.abs(err), 90)) if err.size else math.nan
                entry[f"{name}_mean_s"] = float(err.mean()) if err.size else math.nan
        out[direction] = entry
    return out
