"""Stage-time model validation (paper §7.4, Fig. eval-static c/d) on measured stage times.

The paper profiles real rollout and trainer work, fits the appendix's stage-time models ("Stage-Time Models")
and reports median / p90 relative errors of 3.12 % / 5.77 % (rollout) and 2.92 % / 4.68 % (trainer). This
panel does the same with **real measurements shipped with the package**: ``data/profiles/cpu-tiny``, the
built-in tiny model on a two-core CPU (vLLM rollout, torch trainer, one replica each), written by
``bidirl profile tiny-cpu --grid full`` (:mod:`bidirl.calibrate.profile`). :func:`run_stage_panel` calibrates with
:func:`bidirl.calibrate.from_records.calibrate_profile` — hardware knobs and the tiny model's own parameters fitted on a
seeded 75 % of the grid points — and reports the errors on the held-out 25 %: one rollout batch per point,
one trainer chunk per (point, stage). The report and figures label these "measured on CPU, tiny model": the
setting is not the paper's (Qwen3-VL on A6000), so the comparison with the paper's numbers is one of model
fidelity on the hardware at hand.

:func:`perturb`, :func:`rollout_records` and :func:`trainer_records` are a seeded synthetic generator (a
perturbed ground truth plus simulator-sized noise) that checks the calibration's ability to recover known
parameters; the tutorial notebook on calibration uses them. The panel no longer does. Every table of records
says where it comes from (:func:`bidirl.results.provenance.mark_records`: ``measured`` or ``synthetic``), and
:func:`bidirl.experiments.figures.stage_figure` titles a figure from that tag, never from a constant, so
generated records cannot be drawn as measurements. The error of a fit to synthetic records is bounded below by
the injected noise (:func:`noise_floor_pct`), not by the paper's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from bidirl.experiments.specs import PanelSpec
from bidirl.results.provenance import mark_records

#: the shipped profile the panel is measured on (``data/profiles/<name>``) and how its results are labelled
PROFILE = "cpu-tiny"
LABEL = "measured on CPU, tiny model"
HOLDOUT = 0.25        # share of the grid points held out of the fit


def shipped_profile(name: str = PROFILE):
    """The profile ``data/profiles/<name>`` shipped with the package (:func:`bidirl.calibrate.records.load_profile`)."""
    from bidirl.calibrate.records import load_profile
    from bidirl.job.presets import data_dir
    return load_profile(data_dir() / "profiles" / name)


def _with_params(model, params):
    cls = type(model)
    if hasattr(model, "tp"):      # a RolloutModel: keep its KV budget and sequence cap
        return cls(model.model, model.hardware, tp=model.tp, params=params,
                   kv_budget_bytes=model.kv_budget_bytes, max_seqs=model.max_seqs,
                   image_tokens_per_prompt=model.image_tokens_per_prompt)
    return cls(model.model, model.hardware, layout=model.layout, params=params,
               image_tokens_per_prompt=model.image_tokens_per_prompt)


def relative_errors(observed, predicted) -> np.ndarray:
    observed, predicted = np.asarray(observed, float), np.asarray(predicted, float)
    return np.abs(predicted - observed) / observed


def _predict(model, kind: str, table: pd.DataFrame) -> np.ndarray:
    if kind == "rollout":
        return np.array([model.stage_time(p, r, int(d), int(g)) for p, r, d, g in
                         zip(table["prompt_lens"], table["response_lens"], table["d"], table["group_size"])])
    return np.array([model.chunk_time(s, p, r, int(d)) for s, p, r, d in
                     zip(table["stage"], table["prompt_lens"], table["response_lens"], table["d"])])


def run_stage_panel(spec: PanelSpec, *, quick: bool = False, seed: int = 0, fit_fn: Optional[Callable] = None,
                    models: Optional[tuple] = None, profile=None) -> dict:
    """Calibrate on the fit points of the shipped profile and measure errors on the held-out points.

    Returns ``{"median", "p90"}`` in percent (held out), ``fit_errors`` (the same on the fit points),
    ``records`` (held-out points with ``x`` = prompt groups per replica, ``max_response_len`` = the forced
    response length, ``observed``, ``predicted``, ``rel_error``), ``params`` (fitted), ``label``, ``note``.
    ``quick`` changes nothing (the fit takes a second). ``fit_fn(kind, fit_records, base_model) -> params``
    replaces the calibration and ``models`` (``(rollout_model, trainer_model)``) the base models it starts
    from (tests); ``profile`` replaces the shipped profile.
    """
    from bidirl.calibrate.from_records import calibrate_profile, records_label
    from bidirl.perf.rollout import RolloutModel
    from bidirl.perf.trainer import TrainerModel
    if spec.kind != "stage-model":
        raise ValueError(f"panel {spec.id} is a {spec.kind} panel, not a stage-model panel")
    kind = "rollout" if spec.id.endswith("rollout") else "trainer"
    prof = shipped_profile() if profile is None else profile
    cal = calibrate_profile(prof, holdout=HOLDOUT, seed=seed)
    table = cal.table[cal.table["kind"] == kind].reset_index(drop=True)
    if fit_fn is None:
        predicted = table["calibrated"].to_numpy(dtype=float)
        fitted = (RolloutModel(cal.model, cal.hardware) if kind == "rollout" else TrainerModel(cal.model, cal.hardware))
        params = fitted.params
    else:
        rollout_model, trainer_model = models or (RolloutModel(cal.model, cal.base), TrainerModel(cal.model, cal.base))
        base = rollout_model if kind == "rollout" else trainer_model
        fit_records = table[table["split"] == "fit"].reset_index(drop=True)
        params = fit_fn(kind, fit_records, base)
        predicted = _predict(_with_params(base, params), kind, table)
    table = table.assign(predicted=predicted, rel_error=relative_errors(table["observed"], predicted),
                         x=table["batch"], max_response_len=table["response_len"])
    cols = ["point", "x", "prompt_len", "max_response_len"] + (["stage"] if kind == "trainer" else []) + \
        ["observed", "predicted", "rel_error"]
    held = table[table["split"] == "held-out"][cols].reset_index(drop=True)
    fit = table[table["split"] == "fit"]
    meta = prof.meta
    unit = "rollout batch" if kind == "rollout" else "trainer chunk per stage"
    note = (f"{LABEL}: {fit['point'].nunique()} fit / {held['point'].nunique()} held-out grid points (one {unit}, "
            f"the {cal.statistic} of {meta['grid'].get('repeats')} repetitions) of {records_label(prof)} (measured "
            f"{meta['date'][:10]}, {meta['machine'].get('usable_cpus')} CPUs); knobs and tiny-model parameters "
            "fitted by bidirl calibrate; the paper's numbers are for Qwen3-VL on A6000")
    mark_records(held, "measured", LABEL)
    err = held["rel_error"]
    return {"median": 100 * float(np.median(err)), "p90": 100 * float(np.quantile(err, 0.9)),
            "fit_errors": {"median": 100 * float(fit["rel_error"].median()),
                           "p90": 100 * float(fit["rel_error"].quantile(0.9))},
            "records": held, "params": params, "label": LABEL, "note": note, "error": None}


# --------------------------------------------------------------------------------------------------
# the synthetic generator (calibration recovers known parameters; used by the calibration notebook)
# --------------------------------------------------------------------------------------------------

NOISE = 0.03          # σ of the log-normal measurement noise (the simulator's jitter)
TRUTH_SIGMA = 0.15    # σ of the log-normal scaling of each ground-truth coefficient
REPEATS = 8           # repetitions per x value (half fit, half held out)
QUICK_REPEATS = 4
NON_SCALED = {"r"}    # shape exponents of the p-norm overlap stay as derived


def noise_floor_pct(sigma: float = NOISE) -> float:
    """The median relative error (%) a perfect model makes on the generator's records: the median m of
    |exp(ε) − 1| with ε ~ N(0, σ²), i.e. Φ(ln(1 + m)/σ) − Φ(ln(1 − m)/σ) = 1/2, solved by bisection.
    About σ·Φ⁻¹(0.75): 2.02 % at σ = 3 %."""
    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(100):
        m = 0.5 * (lo + hi)
        lo, hi = (m, hi) if phi(math.log1p(m) / sigma) - phi(math.log1p(-m) / sigma) < 0.5 else (lo, m)
    return 100 * 0.5 * (lo + hi)


def synthetic_label(spec: PanelSpec) -> str:
    """How figures name the generator's records of ``spec``: synthetic, from which model and hardware, how noisy."""
    cfg = spec.config(spec.points[0])
    return (f"synthetic: a perturbed {cfg.model} / {cfg.hardware} model plus {100 * NOISE:g} % noise "
            "(seeded generator, not a measurement)")


def with_predictions(records: pd.DataFrame, predict: Callable) -> pd.DataFrame:
    """``records`` with ``predicted = predict(row)`` and ``rel_error`` = |predicted − observed| / observed (the
    records' source tag is kept)."""
    out = records.copy()
    out["predicted"] = [float(predict(row)) for _, row in records.iterrows()]
    out["rel_error"] = relative_errors(out["observed"], out["predicted"])
    return out


def stage_times(chunk_records: pd.DataFrame) -> pd.DataFrame:
    """Per-chunk trainer records summed into one stage time per (point, repetition, stage) — what a GPU spends
    on a stage is the sum of its chunks — with ``rel_error`` recomputed; the source tag is kept."""
    keys = ["point", "x", "max_response_len", "rep", "stage"]
    missing = [k for k in keys + ["observed", "predicted"] if k not in chunk_records]
    if missing:
        raise ValueError(f"chunk records need columns {missing} (trainer_records, then with_predictions)")
    out = chunk_records.groupby(keys, as_index=False)[["observed", "predicted"]].sum()
    out["rel_error"] = relative_errors(out["observed"], out["predicted"])
    out.attrs.update(chunk_records.attrs)
    return out


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
    return mark_records(pd.DataFrame(rows), "synthetic", synthetic_label(spec))


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
    return mark_records(pd.DataFrame(rows), "synthetic", synthetic_label(spec))


__all__ = ["run_stage_panel", "shipped_profile", "rollout_records", "trainer_records", "perturb", "relative_errors",
           "with_predictions", "stage_times", "synthetic_label", "noise_floor_pct", "online_profile", "RECORD_KINDS",
           "PROFILE", "LABEL", "HOLDOUT", "NOISE", "TRUTH_SIGMA", "REPEATS", "QUICK_REPEATS"]


# --------------------------------------------------------------------------------------------------
# the online profiler at work (§5.1): a run that starts with a wrong trainer model
# --------------------------------------------------------------------------------------------------

#: what a profiler record's stage code ``k`` stands for
RECORD_KINDS = {"r": "rollout batch", "t": "trainer chunk"}


def online_profile(config: Any = "a6000-default", *, steps: int = 4, seed: int = 0, believed_speedup: float = 2.0,
                   overrides: Optional[dict] = None):
    """Simulate ``config`` with a scheduler that believes the trainer ``believed_speedup`` × faster than it is (the
    trainer model's FLOP-rate coefficients α scaled by 1 / ``believed_speedup``), so the online profiler has
    something to correct. Returns ``(result, records)``: the run and its profiler's records as a table in words and
    seconds (``step`` the record fell in, ``work``, ``role``, ``pool``, ``replicas``, ``observed_s``,
    ``predicted_s``, ``error_pct``; the prediction is the one the scheduler held when the work ran, and the
    profiler refits at weight syncs, i.e. between steps)."""
    from bidirl.job import config as cfgmod
    from bidirl.job.planner import plan
    from bidirl.perf.predictor import StagePredictor
    from bidirl.perf.trainer import TrainerModel
    from bidirl.sim.driver import SimDriver
    if not believed_speedup > 0:
        raise ValueError(f"believed_speedup must be > 0 (1 = the true model), got {believed_speedup!r}")
    cfg = cfgmod.load(config) if isinstance(config, str) else config
    if overrides:
        cfg = cfg.with_overrides(overrides)
    env = plan(cfg).envelope
    wrong = StagePredictor.from_config(cfg, env.rollout_layout, env.trainer_layout)
    t = wrong.trainer
    alpha = {s: v / believed_speedup for s, v in t.params.alpha.items()}
    wrong.trainer = TrainerModel(t.model, t.hardware, layout=t.layout,
                                 params=dataclasses.replace(t.params, alpha=alpha),
                                 image_tokens_per_prompt=t.image_tokens_per_prompt)
    result = SimDriver(cfg, "bidirl", steps=steps, seed=seed, predictor=wrong).run()
    ends = result.log.steps_df()["end"].to_numpy()
    rows = [{"step": int(np.searchsorted(ends, r.t)), "work": RECORD_KINDS[r.k] + (f": {r.workload['stage']}" if r.k == "t" else ""), "role": r.x,
             "pool": r.pool, "replicas": r.d, "observed_s": r.observed, "predicted_s": r.predicted,
             "error_pct": 100 * abs(r.predicted - r.observed) / r.observed if r.observed > 0 else float("nan")}
            for r in result.view.profile]
    return result, pd.DataFrame(rows)
