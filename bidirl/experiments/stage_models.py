"""Stage-time model validation (paper §7.4, Fig. eval-static c/d): calibrate M_r and M_t, report their errors.

The paper profiles real rollout and trainer work, fits the appendix's stage-time models and reports median
/ p90 relative errors of 3.12 % / 5.77 % (rollout) and 2.92 % / 4.68 % (trainer). Without GPUs the
"measurements" come from a seeded generator that plays the part of the hardware:

* a hidden ground truth — the model's preset-derived parameters, each positive coefficient scaled by a
  seeded log-normal factor (σ = ``truth_sigma``), so calibration has something to find;
* per-measurement noise — a log-normal factor with σ = ``noise`` (0.03: the simulator's own duration
  jitter, :mod:`bidirl.sim.driver`);
* workloads drawn from the dataset preset by :func:`bidirl.perf.workload.sample_lengths`, at the panel's
  x values (prompts per GPU for rollout, chunks per GPU for training) and max response lengths.

Calibration (:mod:`bidirl.perf.calibrate`) starts from the preset-derived parameters and sees half of the
repetitions; errors are measured on the other half (held out). What this checks is that the calibration
recovers the model under simulator-sized noise — not that the model matches real hardware; the report says so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from bidirl.experiments.specs import PanelSpec

NOISE = 0.03          # σ of the log-normal measurement noise (the simulator's jitter)
TRUTH_SIGMA = 0.15    # σ of the log-normal scaling of each ground-truth coefficient
REPEATS = 8           # repetitions per x value (half fit, half held out)
QUICK_REPEATS = 4
NON_SCALED = {"r"}    # shape exponents of the p-norm overlap stay as derived


def perturb(params: Any, rng: np.random.Generator, sigma: float) -> Any:
    """``params`` (a dataclass, mapping or number) with every positive coefficient scaled by exp(N(0, σ));
    fields named in :data:`NON_SCALED` and non-numbers are kept."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        changes = {}
        for f in dataclasses.fields(params):
            if f.name in NON_SCALED:
                continue
            changes[f.name] = perturb(getattr(params, f.name), rng, sigma)
        return dataclasses.replace(params, **changes)
    if isinstance(params, dict):
        return {k: (v if k in NON_SCALED else perturb(v, rng, sigma)) for k, v in params.items()}
    if isinstance(params, (tuple, list)):
        return type(params)(perturb(v, rng, sigma) for v in params)
    if isinstance(params, (int, float)) and not isinstance(params, bool) and params > 0:
        return float(params) * float(math.exp(rng.normal(0.0, sigma)))
    return params


def _models(cfg):
    from bidirl.perf.rollout import RolloutModel
    from bidirl.perf.trainer import TrainerModel
    return (RolloutModel(cfg.model_spec, cfg.hardware_spec, tp=1),
            TrainerModel(cfg.model_spec, cfg.hardware_spec, layout=1))


def rollout_records(spec: PanelSpec, truth, *, repeats: int, seed: int) -> pd.DataFrame:
    """One record per (point, repetition): a replica's batch of ``n`` prompts × group, its observed time."""
    from bidirl.perf.workload import sample_groups
    rows = []
    for i, point in enumerate(spec.points):
        cfg = spec.config(point)
        n_prompts, max_len = point.value
        for rep in range(repeats):
            rng = np.random.default_rng([seed, 11, i, rep])
            p, r = sample_groups(cfg.workload_stats, max_len, n_prompts, cfg.workload.group_size, rng)
            true_time = float(truth.replica_time(p, r))
            rows.append({"point": point.label, "x": n_prompts, "max_response_len": max_len, "rep": rep,
                         "prompt_lens": p, "response_lens": r, "d": 1, "group_size": cfg.workload.group_size,
                         "observed": true_time * float(np.exp(rng.normal(0.0, NOISE)))})
    return pd.DataFrame(rows)


def trainer_records(spec: PanelSpec, truth, *, repeats: int, seed: int) -> pd.DataFrame:
    """One record per chunk (one micro-batch on one GPU) — what the profiler sees; ``x`` chunks per GPU form
    one measured stage time of a repetition."""
    from bidirl.perf.workload import sample_lengths
    rows = []
    for i, point in enumerate(spec.points):
        cfg = spec.config(point)
        n_chunks, max_len = point.value
        mb = cfg.rl.micro_batch_per_device
        for rep in range(repeats):
            rng = np.random.default_rng([seed, 13, i, rep])
            for stage in cfg.rl.stages:
                for c in range(n_chunks):
                    p, r = sample_lengths(cfg.workload_stats, max_len, mb, rng)
                    true_time = float(truth.chunk_time(stage, p, r, 1))
                    rows.append({"point": point.label, "x": n_chunks, "max_response_len": max_len, "rep": rep,
                                 "stage": stage, "chunk": c, "prompt_lens": p, "response_lens": r, "d": 1,
                                 "observed": true_time * float(np.exp(rng.normal(0.0, NOISE)))})
    return pd.DataFrame(rows)


def _perf_fit(kind: str, records: pd.DataFrame, base_model) -> Any:
    """Fit ``kind`` ('rollout' / 'trainer') parameters with :mod:`bidirl.perf.calibrate`, starting from
    ``base_model``'s preset-derived parameters; returns the fitted parameters."""
    from bidirl.perf import calibrate
    if kind == "rollout":
        result = calibrate.calibrate_rollout(records[["prompt_lens", "response_lens", "d", "group_size", "observed"]],
                                             base_model)
    else:
        result = calibrate.calibrate_trainer(records[["stage", "prompt_lens", "response_lens", "d", "observed"]],
                                             base_model)
    return result.params


def _with_params(model, params):
    cls = type(model)
    if hasattr(model, "tp"):      # a RolloutModel: keep its KV budget and sequence cap
        return cls(model.model, model.hardware, tp=model.tp, params=params,
                   kv_budget_bytes=model.kv_budget_bytes, max_seqs=model.max_seqs)
    return cls(model.model, model.hardware, layout=model.layout, params=params)


def relative_errors(observed, predicted) -> np.ndarray:
    observed, predicted = np.asarray(observed, float), np.asarray(predicted, float)
    return np.abs(predicted - observed) / observed


def run_stage_panel(spec: PanelSpec, *, quick: bool = False, seed: int = 0,
                    fit_fn: Optional[Callable] = None, models: Optional[tuple] = None) -> dict:
    """Generate records, calibrate, and measure held-out errors for a ``stage-model`` panel.

    Returns ``{"median", "p90"}`` in percent, ``records`` (held-out measurements with ``observed`` and
    ``predicted``: one per rollout batch, or one per (repetition, stage, x) stage time for training),
    ``params`` (fitted), ``truth`` and a ``note``. ``fit_fn(kind, records, base_model) -> params`` and
    ``models`` (``(rollout_model, trainer_model)``) can be injected for tests.
    """
    if spec.kind != "stage-model":
        raise ValueError(f"panel {spec.id} is a {spec.kind} panel, not a stage-model panel")
    kind = "rollout" if spec.id.endswith("rollout") else "trainer"
    fit_fn = fit_fn or _perf_fit
    cfg = spec.config(spec.points[0])
    rollout_model, trainer_model = models or _models(cfg)
    base = rollout_model if kind == "rollout" else trainer_model
    truth = _with_params(base, perturb(base.params, np.random.default_rng([seed, 17]), TRUTH_SIGMA))
    repeats = QUICK_REPEATS if quick else REPEATS
    make = rollout_records if kind == "rollout" else trainer_records
    records = make(spec, truth, repeats=repeats, seed=seed)
    train = records[records["rep"] % 2 == 0]
    test = records[records["rep"] % 2 == 1].copy()
    params = fit_fn(kind, train.reset_index(drop=True), base)
    fitted = _with_params(base, params)
    if kind == "rollout":
        test["predicted"] = [float(fitted.replica_time(p, r)) for p, r in zip(test["prompt_lens"], test["response_lens"])]
        held = test[["point", "x", "max_response_len", "rep", "observed", "predicted"]]
    else:
        test["predicted"] = [float(fitted.chunk_time(s, p, r, 1)) for s, p, r in
                             zip(test["stage"], test["prompt_lens"], test["response_lens"])]
        held = (test.groupby(["point", "x", "max_response_len", "rep", "stage"], as_index=False)
                [["observed", "predicted"]].sum())
    err = relative_errors(held["observed"], held["predicted"])
    held = held.assign(rel_error=err)
    note = (f"{len(train)} fit / {len(held)} held-out measurements from a seeded generator (ground truth = "
            f"preset parameters x LogNormal(σ={TRUTH_SIGMA}), noise σ={NOISE}, the simulator's jitter); checks "
            "calibration under simulator noise, not the model against hardware")
    return {"median": 100 * float(np.median(err)), "p90": 100 * float(np.quantile(err, 0.9)),
            "records": held, "params": params, "truth": truth.params, "note": note, "error": None}


__all__ = ["run_stage_panel", "rollout_records", "trainer_records", "perturb", "relative_errors",
           "NOISE", "TRUTH_SIGMA", "REPEATS", "QUICK_REPEATS"]
