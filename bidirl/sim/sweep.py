"""Simulate every candidate split of a job: the static-partition sweep of paper §7.4 (Fig. eval-static a/b).

The planner (§4, Algorithm 1) predicts each split's pipeline rate λ_pipe = min(λ_r, λ_t) from the stage-time
models; :func:`simulate_partitions` runs the job on each split under a policy (``no-borrow`` by default, so
the split alone sets the rate, as in the paper's static sweep) and reports the simulated rate in the same unit,
prompt groups per second (:data:`bidirl.results.metrics.RATE_UNIT`), beside the prediction. The partition explorer
widget draws the two side by side.

The simulated rate of a split is the groups its measured steps consumed over their time — the §7.1 window
(:func:`bidirl.results.metrics.measured_window`): ``measured_steps × prompts_per_step / (t1 − t0)``. Its throughput
(tokens/s over the same window) is in the frame too. Every number is a simulation (model prediction plus
seeded noise), never a measurement; the frame's ``provenance`` column says so.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
import pandas as pd

from bidirl.job import config as cfgmod

#: the columns of :func:`simulate_partitions`' frame, in order
COLUMNS: tuple = ("label", "rollout_gpus", "trainer_gpus", "compatible", "predicted_rate", "policy", "steps", "seed",
                  "status", "reason", "rate", "throughput", "measured_steps", "provenance")
#: row statuses: simulated; not a hot-switch compatible split; the policy's system cannot run it; the run
#: raised; the run was too short for the §7.1 window
STATUSES: tuple = ("ok", "incompatible", "unsupported", "failed", "no-window")


def _progress(progress: Union[bool, Callable, None], total: int):
    """``(tick(done), close())``: a tqdm bar (``progress=True``), a callback ``progress(done, total)``, or nothing."""
    if callable(progress):
        return (lambda done: progress(done, total)), (lambda: None)
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="simulate splits", leave=False)

        def tick(done: int) -> None:
            bar.update(done - bar.n)
        return tick, bar.close
    return (lambda done: None), (lambda: None)


def _partitions(plan, partitions: Optional[Iterable]) -> list:
    sweep = plan.sweep
    if partitions is None:
        ok = sweep[sweep["compatible"].astype(bool)]
        return [(int(a), int(b)) for a, b in zip(ok["rollout_gpus"], ok["trainer_gpus"])]
    out = []
    for p in partitions:
        try:
            a, b = (int(v) for v in p)
        except (TypeError, ValueError):
            raise ValueError(f"a partition is a pair (rollout_gpus, trainer_gpus), got {p!r}") from None
        if plan.index_of((a, b)) is None:
            raise ValueError(f"{a}-{b} is not a candidate split of {plan.config.cluster.gpus} GPUs under "
                             f"{plan.config.cluster.placement} placement; candidates: {', '.join(sweep['label'])}")
        out.append((a, b))
    return out


def _row(plan, part: tuple, policy: str, steps: int, seed: int) -> dict:
    i = plan.index_of(part)
    cand = plan.sweep.iloc[i]
    return {"label": str(cand["label"]), "rollout_gpus": part[0], "trainer_gpus": part[1],
            "compatible": bool(cand["compatible"]), "predicted_rate": float(cand["pipeline_rate"]), "policy": policy,
            "steps": steps, "seed": seed, "status": "ok", "reason": "", "rate": np.nan, "throughput": np.nan,
            "measured_steps": 0, "provenance": "simulated"}


def simulate_one(cfg: cfgmod.JobConfig, row: dict) -> dict:
    """Simulate the split of ``row`` (a :func:`simulate_partitions` row) and fill in its results."""
    from bidirl.sim import UnsupportedSetting, simulate
    if not row["compatible"]:
        return dict(row, status="incompatible",
                    reason="each pool must hold whole replicas of both roles to lend it (§4.1)")
    job = cfg.with_overrides({"cluster.partition": [row["rollout_gpus"], row["trainer_gpus"]]})
    try:
        summary = simulate(job, row["policy"], steps=row["steps"], seed=row["seed"]).summary()
    except UnsupportedSetting as exc:
        return dict(row, status="unsupported", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 — one split failing must not hide the others; the row says why
        return dict(row, status="failed", reason=f"{type(exc).__name__}: {exc}")
    if summary.get("throughput") is None:
        return dict(row, status="no-window", reason=summary.get("throughput_note", "too few steps"))
    from bidirl.results.metrics import group_rate
    return dict(row, rate=group_rate(summary, job.workload.prompts_per_step), throughput=float(summary["throughput"]),
                measured_steps=int(summary["measured_steps"]), provenance=summary.get("provenance", "simulated"))


def _simulate_forked(cfg: cfgmod.JobConfig, todo: list, workers: int, tick: Callable) -> list:
    """:func:`simulate_one` of every row on ``workers`` forked processes; the rows in ``todo``'s order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    out: list = [None] * len(todo)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(simulate_one, cfg, row): i for i, row in enumerate(todo)}
        for done, fut in enumerate(as_completed(futures), start=1):
            out[futures[fut]] = fut.result()
            tick(done)
    return out


def simulate_partitions(config: Any, partitions: Optional[Iterable] = None, *, policy: str = "no-borrow",
                        steps: int = 20, seed: Optional[int] = None,
                        progress: Union[bool, Callable[[int, int], Any], None] = False,
                        workers: int = 1) -> pd.DataFrame:
    """Simulate ``config`` on each split and return one row per split (columns :data:`COLUMNS`).

    ``config`` is a config name, path or :class:`~bidirl.job.config.JobConfig`; its own ``cluster.partition`` is
    ignored. ``partitions`` are ``(rollout_gpus, trainer_gpus)`` pairs among the planner's candidates (default:
    every hot-switch compatible candidate, in sweep order); an incompatible one gets a row with status
    ``incompatible`` and is not simulated (a pool that cannot host both roles cannot run the scheduler).
    ``steps`` and ``seed`` (default: the config's) size each run; ``progress`` is ``True`` for a progress bar
    or a callable ``progress(done, total)`` called after each split. ``workers`` > 1 simulates the splits in that
    many forked processes (each split is one independent, seeded run, so the frame is the same); the default
    runs them one after the other in this process, which is as fast on a busy two-core machine.

    ``predicted_rate`` is the planner's λ_pipe, ``rate`` the simulated groups per second over the §7.1 window
    (both :data:`bidirl.results.metrics.RATE_UNIT`), ``throughput`` tokens/s over the same window. One seed, one frame.
    """
    from bidirl.job.planner import plan as make_plan
    cfg = cfgmod.load(config).with_overrides({"cluster.partition": None})
    steps = int(steps)
    if steps < 1:
        raise cfgmod.ConfigError("steps", f"must be ≥ 1, got {steps}", "simulate at least one step per split")
    if policy not in cfgmod.POLICIES:
        raise cfgmod.ConfigError("policy", f"unknown policy {policy!r}", f"use one of {', '.join(cfgmod.POLICIES)}")
    seed = cfg.seed if seed is None else int(seed)
    plan = make_plan(cfg)
    parts = _partitions(plan, partitions)
    workers = int(workers)
    if workers < 1:
        raise cfgmod.ConfigError("workers", f"must be ≥ 1, got {workers}", "use 1 to simulate in this process")
    tick, close = _progress(progress, len(parts))
    todo = [_row(plan, part, policy, steps, seed) for part in parts]
    rows = []
    try:
        if workers == 1 or len(todo) < 2:
            for row in todo:
                rows.append(simulate_one(cfg, row))
                tick(len(rows))
        else:
            rows = _simulate_forked(cfg, todo, min(workers, len(todo)), tick)
    finally:
        close()
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame.attrs.update(config=cfg.to_dict(), planner_choice=plan.envelope.label)
    return frame


__all__ = ["simulate_partitions", "simulate_one", "COLUMNS", "STATUSES"]
