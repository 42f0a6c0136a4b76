"""Fit the stage-time models' free parameters to profiling records (paper §5.1 online profiler, §6.4).

The appendix calibrates τ, α and r from profiling runs; the paper reports median / p90 relative errors of
3.12 % / 5.77 % for the rollout model and 2.92 % / 4.68 % for the trainer model. This module fits with
``scipy.optimize.least_squares`` (trust-region reflective, bounded) on relative residuals
``(predicted − observed) / observed``, so every record weighs the same whatever its duration.

**Records** — a pandas DataFrame or a list of dicts, one row per measurement:

* rollout: ``prompt_lens``, ``response_lens`` (arrays, one entry per request), ``d`` (replicas that ran
  them), ``observed`` (seconds); optional ``group_size`` (default 1). Predicted: M_r(X, d) =
  :meth:`RolloutModel.stage_time`.
* trainer: ``stage``, ``prompt_lens``, ``response_lens``, ``d``, ``observed``: one chunk run by a gang of d
  replicas, each taking an equal share as one micro-batch. Predicted: :meth:`TrainerModel.chunk_time`.

**Free parameters.** Each positive coefficient is fitted as ``prior · e^θ`` with θ bounded to
``±ln(MAX_FACTOR)``, so fitted values stay positive and within a factor MAX_FACTOR of the prior (the model's
current parameters: preset-derived defaults, or the last calibration). A coefficient whose prior is 0 is
a structurally absent term (no communication at tp = 1 or in a one-GPU trainer replica) and stays 0; the
overlap exponent r is fitted (bounded to [1, MAX_R]) only where a communication term is present. The
trainer's communication time C_s = α_comm,s + β_comm,s·n_s is constant for a fixed layout (n_s does not
depend on the batch), so only one of its coefficients is identifiable: β_comm,s is fitted when n_s > 0,
α_comm,s otherwise, the other stays at its prior. Only stages present in the records are fitted.

The model features (waves, FLOPs, token sums) do not depend on the fitted parameters, so they are computed
once per record and every residual evaluation is a handful of vectorised array operations.

**Hardware knobs.** :func:`calibrate_knobs` fits, instead of the appendix parameters of one model, the
hardware preset's knobs they are derived from (:data:`bidirl.perf.params.KNOBS`: ``train_mfu``,
``prefill_mfu``, ``decode_mbu``, ``kernel_overhead_per_layer``, ``scheduler_overhead``,
``decode_token_overhead``), to rollout and trainer records together, so that what was measured with one
model predicts other models on the same hardware. The efficiency factors are fitted as their inverses
(bounded to ≥ 1, i.e. at most the datasheet peak), the overheads in seconds (≥ 0); at tp = 1 and one GPU per
trainer replica the predictions are linear in these, so the bounded least-squares problem has no spurious
local minima. Each kind of record weighs the same in total (residuals scaled by 1/√n per kind).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from bidirl.perf.balance import serpentine
from bidirl.perf.flops import STAGES, lengths, sample_forward_flops
from bidirl.perf.rollout import RolloutModel, RolloutParams, replica_times_from_features
from bidirl.perf.trainer import SPILL_STAGE, TrainerModel, TrainerParams, has_cache, microbatch_times, spill_bytes

MAX_FACTOR = 1e3
MAX_R = 16.0
ROLLOUT_COLUMNS = ("prompt_lens", "response_lens", "d", "observed")
TRAINER_COLUMNS = ("stage", "prompt_lens", "response_lens", "d", "observed")


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted parameters, the fitted model and the relative-error report on the fitting records."""
    kind: str                      # "rollout" | "trainer"
    params: Any                    # RolloutParams | TrainerParams
    model: Any                     # a new RolloutModel / TrainerModel with ``params``
    errors: np.ndarray             # |predicted − observed| / observed per record, after the fit
    prior_errors: np.ndarray       # the same with the starting parameters
    fitted: tuple                  # names of the fitted parameters (e.g. "tau_dec", "alpha[actor_update]")
    success: bool
    message: str
    predicted: np.ndarray = field(repr=False, default=None)

    @property
    def median_error(self) -> float:
        return float(np.median(self.errors))

    @property
    def p90_error(self) -> float:
        return float(np.quantile(self.errors, 0.9))

    def report(self) -> dict:
        """Median / p90 relative error in percent (after and before the fit) and what was fitted."""
        return {"kind": self.kind, "records": int(self.errors.size),
                "median_error_pct": 100 * self.median_error, "p90_error_pct": 100 * self.p90_error,
                "prior_median_error_pct": 100 * float(np.median(self.prior_errors)),
                "prior_p90_error_pct": 100 * float(np.quantile(self.prior_errors, 0.9)),
                "fitted": list(self.fitted), "success": self.success, "message": self.message}


# --------------------------------------------------------------------------------------------------
# record validation
# --------------------------------------------------------------------------------------------------

def validate_records(records, kind: str) -> pd.DataFrame:
    """``records`` as a DataFrame with the required columns checked; ValueError naming column and fix."""
    if kind not in ("rollout", "trainer"):
        raise ValueError(f"kind must be 'rollout' or 'trainer', got {kind!r}")
    required = ROLLOUT_COLUMNS if kind == "rollout" else TRAINER_COLUMNS
    if isinstance(records, pd.DataFrame):
        df = records.reset_index(drop=True)
    else:
        try:
            rows = list(records)
        except TypeError:
            raise ValueError(f"records must be a pandas DataFrame or a list of dicts with columns "
                             f"{', '.join(required)}; got {type(records).__name__}") from None
        if rows and not all(isinstance(r, dict) for r in rows):
            raise ValueError("records: every row must be a dict (column -> value); pass a list of dicts or a DataFrame")
        df = pd.DataFrame(rows)
    if len(df) == 0:
        raise ValueError(f"records: no profiling records to fit; pass at least one row with columns "
                         f"{', '.join(required)}")
    for col in required:
        if col not in df.columns:
            raise ValueError(f"records: missing column {col!r}; every {kind} record needs "
                             f"{', '.join(required)}")
    obs = pd.to_numeric(df["observed"], errors="coerce").to_numpy(dtype=float)
    bad = np.nonzero(~np.isfinite(obs) | (obs <= 0))[0]
    if bad.size:
        raise ValueError(f"records: column 'observed' must hold positive times in seconds; row {int(bad[0])} has "
                         f"{df['observed'].iloc[int(bad[0])]!r} — drop failed or negative measurements")
    for i, d in enumerate(df["d"]):
        if isinstance(d, bool) or not isinstance(d, (int, float, np.integer, np.floating)) or d != int(d) or d < 1:
            raise ValueError(f"records: column 'd' must be a whole number of replicas ≥ 1; row {i} has {d!r}")
    if kind == "trainer":
        for i, s in enumerate(df["stage"]):
            if s not in STAGES:
                raise ValueError(f"records: column 'stage' row {i} is {s!r}; use one of {', '.join(STAGES)}")
    if "group_size" in df.columns and kind == "rollout":
        for i, g in enumerate(df["group_size"]):
            if isinstance(g, bool) or not isinstance(g, (int, float, np.integer, np.floating)) or g != int(g) or g < 1:
                raise ValueError(f"records: column 'group_size' must be a whole number ≥ 1; row {i} has {g!r}")
    for i, (p, r) in enumerate(zip(df["prompt_lens"], df["response_lens"])):
        try:
            p, r = lengths(np.atleast_1d(p), np.atleast_1d(r))
        except ValueError as exc:
            raise ValueError(f"records: row {i}: {exc} (columns 'prompt_lens' / 'response_lens')") from None
        if p.size == 0:
            raise ValueError(f"records: row {i} has no requests in 'prompt_lens' / 'response_lens'; drop empty records")
    return df


# --------------------------------------------------------------------------------------------------
# parameter vectors
# --------------------------------------------------------------------------------------------------

@dataclass
class _Space:
    """Maps the optimisation vector to parameters: log-scaled coefficients, linear exponents and, where
    ``additive`` is set, non-negative costs fitted from a prior that may be 0 (value = x · OVERHEAD_SCALE, x ≥ 0)."""
    names: list                 # display names
    priors: np.ndarray          # prior values
    is_exponent: np.ndarray     # r-type parameters (fitted linearly in [1, MAX_R])
    additive: np.ndarray = None  # costs fitted linearly in [0, ∞) (None: none)
    scale: np.ndarray = None     # each additive cost's unit in the optimisation (None: OVERHEAD_SCALE seconds)

    def __post_init__(self):
        if self.additive is None:
            self.additive = np.zeros(len(self.names), dtype=bool)
        if self.scale is None:
            self.scale = np.full(len(self.names), OVERHEAD_SCALE)

    def x0(self):
        # an additive cost starts inside its bound (at least OVERHEAD_SCALE): from exactly 0, on the bound, the
        # trust-region steps never leave it, though the cost falls as it grows (a 0 prior is the usual case)
        return np.where(self.is_exponent, np.clip(self.priors, 1.0, MAX_R),
                        np.where(self.additive, np.maximum(self.priors / self.scale, 1.0), 0.0))

    def bounds(self):
        lim = np.log(MAX_FACTOR)
        lo = np.where(self.is_exponent, 1.0, np.where(self.additive, 0.0, -lim))
        hi = np.where(self.is_exponent, MAX_R, np.where(self.additive, np.inf, lim))
        return lo, hi

    def values(self, x):
        scaled = self.priors * np.exp(np.where(self.additive, 0.0, x))
        return np.where(self.is_exponent, x, np.where(self.additive, x * self.scale, scaled))


def _fit(space: _Space, predict, observed: np.ndarray, setter):
    prior_pred = predict(setter(space.priors))
    prior_err = np.abs(prior_pred - observed) / observed
    if not space.names:
        return setter(space.priors), prior_pred, prior_err, prior_err, True, "nothing to fit"

    def residuals(x):
        return (predict(setter(space.values(x))) - observed) / observed

    lo, hi = space.bounds()
    sol = least_squares(residuals, space.x0(), bounds=(lo, hi), method="trf", x_scale=1.0,
                        diff_step=1e-6, max_nfev=200 * (len(space.names) + 1))
    params = setter(space.values(sol.x))
    pred = predict(params)
    return params, pred, np.abs(pred - observed) / observed, prior_err, bool(sol.success), str(sol.message)


# --------------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------------

def _rollout_features(df: pd.DataFrame, model: RolloutModel):
    feats, starts, pos = [], [], 0
    groups = df["group_size"] if "group_size" in df.columns else [1] * len(df)
    for i, (p, r, d, g) in enumerate(zip(df["prompt_lens"], df["response_lens"], df["d"], groups)):
        p, r = lengths(np.atleast_1d(p), np.atleast_1d(r))
        try:
            replica, d_eff = model.partition(p, r, int(d), int(g))
        except ValueError as exc:
            raise ValueError(f"records: row {i}: {exc}") from None
        feats.append(model.replica_features(p, r, replica, d_eff))
        starts.append(pos)
        pos += d_eff
    merged = feats[0]
    for f in feats[1:]:
        merged = merged.concat(f)
    return merged, np.asarray(starts)


def calibrate_rollout(records, model: RolloutModel, *, fit_request_cost: bool = False) -> CalibrationResult:
    """Fit ``model``'s :class:`RolloutParams` to rollout records (module doc); starts from ``model.params``.

    ``fit_request_cost``: also fit the per-request admission cost γ_req (``gamma_req``,
    :func:`bidirl.perf.rollout.request_admission_time`), from its prior even when that is 0, as a non-negative
    cost. Its feature B_j must vary apart from the others, which profiling records over batch sizes and lengths
    give; off by default, so a fit that cannot separate it (one job's log) leaves it where it is."""
    if not isinstance(model, RolloutModel):
        raise ValueError(f"model must be a RolloutModel, got {type(model).__name__}")
    if not isinstance(fit_request_cost, bool):
        raise ValueError(f"fit_request_cost must be True or False, got {fit_request_cost!r}")
    df = validate_records(records, "rollout")
    observed = df["observed"].to_numpy(dtype=float)
    feats, starts = _rollout_features(df, model)
    prior = model.params
    names = [f.name for f in dataclasses.fields(RolloutParams)]
    comm_present = prior.c_pre > 0 or prior.c_dec > 0
    free = [n for n in names if (n == "r" and comm_present) or (n == "gamma_req" and fit_request_cost)
            or (n not in ("r", "gamma_req") and getattr(prior, n) > 0)]
    space = _Space(free, np.array([getattr(prior, n) for n in free], float), np.array([n == "r" for n in free]),
                   np.array([n == "gamma_req" for n in free], dtype=bool))

    def setter(values):
        return dataclasses.replace(prior, **{n: float(v) for n, v in zip(free, values)})

    def predict(params):
        return np.maximum.reduceat(replica_times_from_features(params, feats), starts)

    params, pred, err, prior_err, ok, msg = _fit(space, predict, observed, setter)
    fitted = RolloutModel(model.model, model.hardware, tp=model.tp, params=params,
                          kv_budget_bytes=model.kv_budget_bytes, max_seqs=model.max_seqs,
                          image_tokens_per_prompt=model.image_tokens_per_prompt)
    return CalibrationResult("rollout", params, fitted, err, prior_err, tuple(free), ok, msg, pred)


# --------------------------------------------------------------------------------------------------
# trainer
# --------------------------------------------------------------------------------------------------

def _trainer_shares(df: pd.DataFrame, model: TrainerModel):
    """Per replica micro-batch of the records: stage index, FLOPs, message bytes, cache-spill bytes
    (:func:`bidirl.perf.trainer.spill_bytes`); and where each record's replicas start."""
    stage_idx, flops, spill, starts, pos = [], [], [], [], 0
    index = {s: i for i, s in enumerate(STAGES)}
    for stage, p, r, d in zip(df["stage"], df["prompt_lens"], df["response_lens"], df["d"]):
        p, r = lengths(np.atleast_1d(p), np.atleast_1d(r))
        d_eff = min(int(d), p.size)
        replica, _ = serpentine(p + r, d_eff)
        f = np.bincount(replica, weights=sample_forward_flops(model.model, p, r, model.image_tokens_per_prompt),
                        minlength=d_eff)
        tokens = np.bincount(replica, weights=(p + r).astype(float), minlength=d_eff)
        stage_idx.append(np.full(d_eff, index[stage]))
        flops.append(f)
        spill.append(spill_bytes(model.model, model.hardware, stage, tokens))
        starts.append(pos)
        pos += d_eff
    idx = np.concatenate(stage_idx)
    msg = np.array([model.message_bytes(s) for s in STAGES])[idx]
    return idx, np.concatenate(flops), msg, np.concatenate(spill), np.asarray(starts)


def spill_cost_unit(hardware) -> float:
    """The unit β_mem (s per spilled byte) is fitted in: one pass over the byte at the datasheet memory bandwidth,
    ``1 / memory_bandwidth`` seconds (:data:`OVERHEAD_SCALE` where the hardware states no bandwidth)."""
    bandwidth = getattr(hardware, "memory_bandwidth", None)
    return OVERHEAD_SCALE if bandwidth is None else 1.0 / float(bandwidth)


def calibrate_trainer(records, model: TrainerModel, *, fit_spill_cost: bool = False) -> CalibrationResult:
    """Fit ``model``'s :class:`TrainerParams` to trainer chunk records (module doc); starts from ``model.params``.

    ``fit_spill_cost``: also fit the actor update's cost per byte of saved activations beyond the device's cache,
    β_mem (:func:`bidirl.perf.trainer.spill_bytes`), from its prior even when that is 0, as a non-negative cost.
    It needs ``cache_bytes`` on the model's hardware (ValueError otherwise) and update records on both sides of
    the cache (profiling records over batch sizes and lengths give them); off by default."""
    if not isinstance(model, TrainerModel):
        raise ValueError(f"model must be a TrainerModel, got {type(model).__name__}")
    if not isinstance(fit_spill_cost, bool):
        raise ValueError(f"fit_spill_cost must be True or False, got {fit_spill_cost!r}")
    if fit_spill_cost and not has_cache(model.hardware):
        raise ValueError(f"fit_spill_cost needs the device's last-level cache: hardware "
                         f"{getattr(model.hardware, 'name', model.hardware)!r} has no cache_bytes; set it in the "
                         "hardware preset or fit without the spill cost")
    df = validate_records(records, "trainer")
    observed = df["observed"].to_numpy(dtype=float)
    idx, flops, msg, spill, starts = _trainer_shares(df, model)
    prior = model.params
    present = [s for s in STAGES if s in set(df["stage"])]
    free: list = []          # (field, stage)
    for s in present:
        free += [("tau", s), ("alpha", s)]
        n_s = model.message_bytes(s)
        comm_field = "beta_comm" if n_s > 0 else "alpha_comm"
        comm_prior = prior.beta_comm[s] * n_s if n_s > 0 else prior.alpha_comm[s]
        if comm_prior > 0:
            free += [(comm_field, s), ("r", s)]
    free = [(f, s) for f, s in free if f == "r" or getattr(prior, f)[s] > 0]
    if SPILL_STAGE in present and (fit_spill_cost or prior.beta_mem[SPILL_STAGE] > 0) \
            and np.any(spill[idx == STAGES.index(SPILL_STAGE)] > 0):
        free.append(("beta_mem", SPILL_STAGE))
    additive = np.array([f == "beta_mem" for f, _ in free], dtype=bool)
    unit = np.where(additive, spill_cost_unit(model.hardware), OVERHEAD_SCALE)
    space = _Space([f"{f}[{s}]" for f, s in free], np.array([getattr(prior, f)[s] for f, s in free], float),
                   np.array([f == "r" for f, _ in free]), additive, unit)

    def setter(values):
        maps = {f.name: dict(getattr(prior, f.name)) for f in dataclasses.fields(TrainerParams)}
        for (f, s), v in zip(free, values):
            maps[f][s] = float(v)
        return TrainerParams(**maps)

    def predict(params):
        return np.maximum.reduceat(microbatch_times(params, idx, flops, msg, spill), starts)

    params, pred, err, prior_err, ok, message = _fit(space, predict, observed, setter)
    fitted = TrainerModel(model.model, model.hardware, layout=model.layout, params=params,
                          sequence_parallel=getattr(model, "sequence_parallel", 1),
                          expert_parallel=getattr(model, "expert_parallel", 1),
                          image_tokens_per_prompt=model.image_tokens_per_prompt)
    return CalibrationResult("trainer", params, fitted, err, prior_err, tuple(space.names), ok, message, pred)


# --------------------------------------------------------------------------------------------------
# hardware knobs
# --------------------------------------------------------------------------------------------------

#: seconds a zero-prior overhead knob is scaled by in the optimisation (its typical size on CPU and GPU)
OVERHEAD_SCALE = 1e-5
ROLLOUT_KNOBS = ("prefill_mfu", "decode_mbu", "kernel_overhead_per_layer", "scheduler_overhead",
                 "decode_token_overhead")
TRAINER_KNOBS = ("train_mfu", "kernel_overhead_per_layer")


@dataclass(frozen=True)
class KnobCalibration:
    """Fitted hardware knobs, the hardware spec carrying them, and relative errors per record, before
    (``prior_*``) and after the fit (``None`` for a kind without records)."""
    knobs: dict
    prior_knobs: dict
    hardware: Any
    rollout_errors: Any
    trainer_errors: Any
    prior_rollout_errors: Any
    prior_trainer_errors: Any
    success: bool
    message: str

    def report(self) -> dict:
        out = {"knobs": dict(self.knobs), "prior_knobs": dict(self.prior_knobs), "success": self.success,
               "message": self.message}
        for kind in ("rollout", "trainer"):
            err, prior = getattr(self, f"{kind}_errors"), getattr(self, f"prior_{kind}_errors")
            if err is not None:
                out[kind] = {"records": int(err.size), "median_error_pct": 100 * float(np.median(err)),
                             "p90_error_pct": 100 * float(np.quantile(err, 0.9)),
                             "prior_median_error_pct": 100 * float(np.median(prior)),
                             "prior_p90_error_pct": 100 * float(np.quantile(prior, 0.9))}
        return out


def knob_hardware(hardware, knobs: dict):
    """``hardware`` with ``knobs`` set and no per-model ``stage_params`` (predictions from the knobs alone)."""
    from bidirl.perf.params import check_knob
    values = {k: check_knob(k, v) for k, v in knobs.items()}
    extra = {"stage_params": {}} if hasattr(hardware, "stage_params") else {}
    return dataclasses.replace(hardware, **values, **extra)


def calibrate_knobs(model_spec, hardware, rollout_records=None, trainer_records=None, *, tp: int = 1,
                    layout: int = 1, image_tokens_per_prompt: int = 0) -> KnobCalibration:
    """Fit ``hardware``'s knobs to records of ``model_spec`` (rollout replicas of ``tp`` GPUs, trainer replicas
    of ``layout`` GPUs; every prompt holding ``image_tokens_per_prompt`` LLM image tokens, whose vision-encoder
    FLOPs are charged, not fitted); module doc. Starts from the preset's knobs; ``stage_params`` are ignored."""
    from bidirl.perf.params import EFFICIENCY_KNOBS, knob, knob_rollout_params, knob_trainer_params
    if rollout_records is None and trainer_records is None:
        raise ValueError("calibrate_knobs: pass rollout_records and/or trainer_records")
    base = knob_hardware(hardware, {})
    prior = {k: knob(base, k) for k in (*EFFICIENCY_KNOBS, *ROLLOUT_KNOBS[2:])}
    parts = []              # (kind, predict(hw) -> array, observed)
    free: list = []
    if rollout_records is not None:
        df = validate_records(rollout_records, "rollout")
        shape_model = RolloutModel(model_spec, base, tp=tp, image_tokens_per_prompt=image_tokens_per_prompt)
        feats, starts = _rollout_features(df, shape_model)

        def predict_rollout(hw, feats=feats, starts=starts):
            params = knob_rollout_params(model_spec, hw, tp)
            return np.maximum.reduceat(replica_times_from_features(params, feats), starts)
        parts.append(("rollout", predict_rollout, df["observed"].to_numpy(dtype=float)))
        free += [k for k in ROLLOUT_KNOBS if k not in free]
    if trainer_records is not None:
        df = validate_records(trainer_records, "trainer")
        shape_model = TrainerModel(model_spec, base, layout=layout, image_tokens_per_prompt=image_tokens_per_prompt)
        idx, flops, msg, _, starts = _trainer_shares(df, shape_model)

        def predict_trainer(hw, idx=idx, flops=flops, msg=msg, starts=starts):
            params = knob_trainer_params(model_spec, hw, layout)
            return np.maximum.reduceat(microbatch_times(params, idx, flops, msg), starts)
        parts.append(("trainer", predict_trainer, df["observed"].to_numpy(dtype=float)))
        free += [k for k in TRAINER_KNOBS if k not in free]

    is_eff = np.array([k in EFFICIENCY_KNOBS for k in free])
    z_prior = np.array([1.0 / prior[k] if k in EFFICIENCY_KNOBS else prior[k] for k in free])
    scale = np.where(z_prior > 0, z_prior, OVERHEAD_SCALE)

    def hw_of(x):
        z = x * scale
        return knob_hardware(base, {k: (1.0 / v if e else v) for k, v, e in zip(free, z, is_eff)})

    def errors(hw):
        return {kind: np.abs(pred(hw) - obs) / obs for kind, pred, obs in parts}

    weights = {kind: 1.0 / np.sqrt(obs.size) for kind, _, obs in parts}

    def residuals(x):
        hw = hw_of(x)
        return np.concatenate([weights[kind] * (pred(hw) - obs) / obs for kind, pred, obs in parts])

    lo = np.where(is_eff, 1.0, 0.0) / scale
    x0 = np.clip(z_prior / scale, lo, None)
    sol = least_squares(residuals, x0, bounds=(lo, np.inf), method="trf", x_scale="jac",
                        max_nfev=200 * (len(free) + 1))
    fitted_hw = hw_of(sol.x)
    after, before = errors(fitted_hw), errors(base)
    knobs = {k: knob(fitted_hw, k) for k in free}
    return KnobCalibration(knobs, {k: prior[k] for k in free}, fitted_hw, after.get("rollout"), after.get("trainer"),
                           before.get("rollout"), before.get("trainer"), bool(sol.success), str(sol.message))


def relative_errors(observed: Sequence[float], predicted: Sequence[float]) -> np.ndarray:
    """|predicted − observed| / observed."""
    o, p = np.asarray(observed, float), np.asarray(predicted, float)
    return np.abs(p - o) / o
