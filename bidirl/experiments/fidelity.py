"""Does the planner agree with its own simulator? Per-step stage times, predicted and simulated (paper §4, §7.4).

The planner ranks partitions with the stage-time models M_r and M_t (appendix); the simulator executes the
same job with the replica model and the chunk queue. For one configuration this module runs the simulator at
``s = 0`` under ``no-borrow`` with jitter off (so every measured duration is the models' own), takes each
step's batch from the protocol (``StartStep``), asks the planner's models for that batch's rollout and trainer
stage times on the envelope's replicas, and puts them side by side with what the simulator measured:

* rollout — the longest busy period of a primary rollout replica during the step (at ``s = 0`` the step's groups
  are all generated from scratch after the previous sync), plus the step's weight sync, during which no rollout
  replica generates;
* trainer — the primary trainer's chunk time during the step, its optimizer spans (one per mini-batch) and the
  step's weight sync: M_t holds the step's end as the simulator charges it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod


def _batch_lengths(groups) -> tuple:
    p = np.array([g.prompt_len for g in groups for _ in g.generated], dtype=np.int64)
    r = np.array([n for g in groups for n in g.generated], dtype=np.int64)
    return p, r


def planner_vs_simulator(config, *, steps: int = 8, seed: Optional[int] = None) -> pd.DataFrame:
    """One row per step: ``rollout_simulated`` (the busiest primary replica's generation and the weight sync),
    ``rollout_predicted``, ``trainer_simulated`` (the primary gang's chunks, optimizer spans and the weight sync),
    ``trainer_predicted`` (seconds) and their relative errors, plus the envelope's own predictions for its
    representative batch (``rollout_planned``, ``trainer_planned``) in ``DataFrame.attrs``."""
    from bidirl.job.planner import predict_stage_times
    from bidirl.sim.driver import SimDriver

    cfg = cfgmod.load(config).with_overrides({"rl.staleness": 0})
    driver = SimDriver(cfg, "no-borrow", steps=steps, seed=cfg.seed if seed is None else int(seed), jitter=0.0)
    result = driver.run()
    spans = result.log.spans_df()
    rows = []
    for cmd in driver.messages:
        if not isinstance(cmd, P.StartStep):
            continue
        k = cmd.step
        gen = spans[(spans["kind"] == "generate") & (spans["role"] == P.PRIMARY) & (spans["step"] == k)]
        chunks = spans[(spans["kind"] == "chunk") & (spans["worker"] == P.PRIMARY_TRAINER) & (spans["step"] == k)]
        # M_t holds every optimizer update of the step (the barriers between mini-batches and each local update's
        # last one) and the weight sync that ends it; the sync's span on the sending trainer's lane
        opt = spans[(spans["kind"] == "optimizer") & (spans["worker"] == P.PRIMARY_TRAINER) & (spans["step"] == k)]
        sync = spans[(spans["kind"] == "sync") & (spans["worker"] == P.PRIMARY_TRAINER) & (spans["step"] == k)]
        t_sync = float((sync["end"] - sync["start"]).sum())
        # the rollout replicas got the groups in group-id order; the trainer sees them in batch order
        by_id = sorted(range(len(cmd.groups)), key=lambda i: cmd.groups[i].group_id)
        p, r = _batch_lengths([cmd.groups[i] for i in by_id])
        g = cfg.workload.group_size
        sorted_pos = np.argsort(by_id)            # batch position -> position in group-id order
        consumed = (sorted_pos[:, None] * g + np.arange(g)[None, :]).reshape(-1)
        t_r, t_t = predict_stage_times(driver.plan, p, r, consumed)
        rows.append({"step": k, "rollout_simulated": float((gen["end"] - gen["start"]).max()) + t_sync,
                     "rollout_predicted": t_r,
                     "trainer_simulated": float((chunks["end"] - chunks["start"]).sum()
                                                + (opt["end"] - opt["start"]).sum()) + t_sync,
                     "trainer_predicted": t_t})
    df = pd.DataFrame(rows)
    for stage in ("rollout", "trainer"):
        df[f"{stage}_error"] = (df[f"{stage}_predicted"] - df[f"{stage}_simulated"]) / df[f"{stage}_simulated"]
    env = driver.plan.envelope
    df.attrs.update(partition=env.label, rollout_planned=env.rollout_time, trainer_planned=env.trainer_time)
    return df
