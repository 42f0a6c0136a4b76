"""Policies side by side on one job: the measured throughput ratio, the gate's windows and the switch costs.

What ``make demo``'s real run and the ``longtail_cpu`` benchmark report (paper §7.1 for the throughput, §5.2 for
the windows): run the same config, seed and steps under each policy back to back (:func:`run_policies`), then

* :func:`windows_table` — every borrowing window the gate evaluated: the step, the direction, the predicted time
  saved against the switch cost it charges, and whether it was admitted;
* :func:`window_counts` — per direction, the windows admitted and evaluated;
* :func:`measured_steps` / :func:`step_throughputs` — tokens and seconds of each measured step (the §7.1 window's
  steps, each over the time since the step before ended) and their tokens per second, whose median is robust to
  one step slowed by other work on a shared machine;
* :func:`throughput_ratio` — a policy's throughput over a baseline's, both by §7.1's measured window and by the
  medians of their per-step throughputs.

A run's provenance travels with it: a ratio of engine runs is measured, of simulator runs simulated; the
callers label it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import pandas as pd

from bidirl.core.protocol import DIRECTIONS
from bidirl.results.metrics import dropped_steps, ordered_steps

#: the columns of :func:`windows_table`
WINDOW_COLUMNS = ("step", "t", "direction", "predicted_gain", "cost", "admitted")


@dataclass(frozen=True)
class Ratio:
    """``policy`` over ``baseline``: by §7.1's window throughput and by median per-step throughput."""
    policy: str
    baseline: str
    window: float
    median_step: float
    provenance: str


def run_policies(config, policies: Iterable[str], steps: int, seed: Optional[int] = None, *,
                 simulate: bool = False, progress: bool = False) -> dict:
    """``{policy: RunResult}``: the job under each policy, one after the other, on real engines on an embedded
    local Ray (``simulate=True``: the discrete-event simulator instead). Same config, seed and steps for all; the
    engine runs share their workers (:class:`~bidirl.cluster.kept_workers.KeptWorkers`), each reset to a fresh engine's
    state, so the engines start once."""
    from bidirl.job import config as cfgmod
    cfg = cfgmod.load(config)
    seed = cfg.seed if seed is None else int(seed)
    out = {}
    if simulate:
        from bidirl.sim import simulate as sim
        for policy in policies:
            out[policy] = sim(cfg, policy, steps=steps, seed=seed, progress=progress)
        return out
    from bidirl.cluster.kept_workers import KeptWorkers
    from bidirl.cluster.run import run
    with KeptWorkers() as kept:          # the policies' runs share one start of the engines, each reset for its run
        for policy in policies:
            out[policy] = run(cfg, policy, steps=steps, seed=seed, progress=progress, kept_workers=kept)
    return out


def windows_table(result) -> pd.DataFrame:
    """The gate's decisions of a run (:data:`WINDOW_COLUMNS`), in time order: one row per window evaluated."""
    d = result.log.decisions_df()
    steps = [detail.get("step") if isinstance(detail, dict) else None for detail in d["detail"]]
    table = pd.DataFrame({"step": pd.array(steps, dtype="Int64"), "t": d["t"].astype(float),
                          "direction": d["direction"].astype(str), "predicted_gain": d["predicted_gain"].astype(float),
                          "cost": d["cost"].astype(float), "admitted": d["admitted"].astype(bool)},
                         columns=list(WINDOW_COLUMNS))
    return table.sort_values("t", kind="stable").reset_index(drop=True)


def window_counts(result) -> dict:
    """``{direction: {"admitted": n, "evaluated": n}}`` for both directions (zeros when none was evaluated)."""
    table = windows_table(result)
    out = {}
    for direction in DIRECTIONS:
        rows = table[table["direction"] == direction]
        out[direction] = {"admitted": int(rows["admitted"].sum()), "evaluated": int(len(rows))}
    return out


def measured_steps(result) -> tuple:
    """``(tokens, seconds)`` of each step of §7.1's measured window: its tokens and ``end − end of the step
    before`` (the first ``max(1, ⌈s⌉)`` and last ``⌈s⌉`` steps are dropped, as for the throughput)."""
    df = ordered_steps(result.log.steps_df())
    head, tail = dropped_steps(result.config.rl.staleness)
    if len(df) < head + tail + 1:
        raise ValueError(f"per-step figures need at least {head + tail + 1} steps at staleness "
                         f"{result.config.rl.staleness:g}, the run has {len(df)}; run more steps")
    end = df["end"].to_numpy(dtype=np.float64)
    tokens = df["tokens"].to_numpy(dtype=np.float64)
    kept = np.arange(head, len(df) - tail)
    return tokens[kept], end[kept] - end[kept - 1]


def step_throughputs(result) -> np.ndarray:
    """Tokens per second of each step of §7.1's measured window (:func:`measured_steps`)."""
    tokens, seconds = measured_steps(result)
    return tokens / seconds


def throughput_ratio(results: dict, policy: str = "bidirl", baseline: str = "no-borrow") -> Ratio:
    """``results[policy]`` over ``results[baseline]`` (:class:`Ratio`); both runs must share their provenance."""
    for name in (policy, baseline):
        if name not in results:
            raise ValueError(f"no run of policy {name!r}; got {sorted(results)}")
    a, b = results[policy], results[baseline]
    if a.provenance != b.provenance:
        raise ValueError(f"cannot compare a {a.provenance} run of {policy} with a {b.provenance} run of {baseline}")
    window = a.summary()["throughput"] / b.summary()["throughput"]
    median_step = float(np.median(step_throughputs(a)) / np.median(step_throughputs(b)))
    return Ratio(policy, baseline, float(window), median_step, a.provenance)


def measured_costs(result) -> dict:
    """``{"<direction>.<c_in|c_out|c_grad>": seconds}``: the switch costs an engine run measured (medians over
    its switches; directions that never switched are absent)."""
    costs = result.summary().get("costs", {})
    return {f"{direction}.{which}": float(seconds) for direction in DIRECTIONS
            for which, seconds in sorted(costs.get(direction, {}).items())}


def format_windows(table: pd.DataFrame) -> list:
    """The windows as aligned text lines: step, direction, predicted gain vs switch cost (ms), decision."""
    lines = [f"  {'step':>4}  {'direction':<24}  {'predicted gain':>14}  {'switch cost':>11}  decision"]
    for row in table.itertuples(index=False):
        step = "" if pd.isna(row.step) else str(int(row.step))
        verdict = "admitted" if row.admitted else "rejected"
        lines.append(f"  {step:>4}  {row.direction:<24}  {row.predicted_gain * 1e3:>11.0f} ms  "
                     f"{row.cost * 1e3:>8.0f} ms  {verdict}")
    return lines
