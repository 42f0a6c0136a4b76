"""From measured stage times to a calibrated hardware preset (``bidirl calibrate``).

The appendix ("Stage-Time Models") calibrates the models' τ, α and r from profiling runs and §7.4 reports
their median / p90 relative errors. :func:`calibrate_profile` does this for a profile written by
``bidirl profile`` (:mod:`bidirl.calibrate.profile`, format in :mod:`bidirl.calibrate.records`):

1. **Grid points, not records.** A grid point's observed time is the fastest of its repetitions
   (``statistic="min"``, the default) or their median (``"median"``). The repetitions are spread over the
   whole profile (:mod:`bidirl.calibrate.profile`), so on a machine shared with other work the slower ones measure
   the interference, not the engines — the rule :mod:`timeit` documents ("the min ... is a lower bound for
   how fast your machine can run the given code snippet; higher values ... are typically caused by other
   processes interfering"); the stage-time models describe the engines on the hardware, and the online
   profiler (§5.1) corrects for run-time conditions. The points are split at random (seeded) into a fit set
   and a held-out set of ``holdout`` of them; rollout and trainer share the split, and all three trainer
   stages of a point fall on the same side.
2. **Knobs.** :func:`bidirl.perf.fit.calibrate_knobs` fits the hardware preset's knobs (efficiency
   factors and engine overheads, :data:`bidirl.perf.params.KNOBS`) to the fit points of both stages. These
   carry over to other models on the same hardware.
3. **Per-model parameters.** Starting from the knob-derived priors, :func:`~bidirl.perf.fit.calibrate_rollout`
   and :func:`~bidirl.perf.fit.calibrate_trainer` fit the appendix parameters of the profiled model
   itself (per-stage τ_s and α_s; the rollout's τ_pre, α_pre, τ_dec, β_tok, β_hist and its per-request
   admission cost γ_req, fitted from 0 — :func:`bidirl.perf.rollout.request_admission_time`; the trainer's cost per
   byte of the update's saved activations beyond the cache, β_mem, fitted from 0 where the preset states
   ``cache_bytes`` — :func:`bidirl.perf.trainer.spill_bytes`). They go to the
   preset's ``stage_params`` block for that model and layout (skipped with ``overrides=False``).
   A vision-language model's records say how many LLM image tokens each prompt held (the profile's
   ``image_tokens_per_prompt``, :mod:`bidirl.calibrate.records`): every model the calibration builds charges the
   vision encoder's FLOPs for them (:func:`bidirl.perf.flops.vit_forward_flops`; once per request in the
   rollout's prefill, once per sample in each trainer stage), so the knobs and parameters fitted are the
   decoder's and the encoder's work is not folded into them. Records without the field are text-only; a
   vision-language model's are refused by name (:func:`image_tokens_of`).
4. **Errors.** Every point is predicted through the preset as it will be loaded — the prior preset, the
   knobs alone, the calibrated preset — and the relative errors are reported on the fit and held-out points.

:func:`preset_document` / :func:`write_preset` turn the result into a hardware preset YAML that
:mod:`bidirl.job.presets` loads, whose ``sources`` say what was measured, where, when and with what held-out
error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd

from bidirl.calibrate.records import Profile, ProfileError, load_profile

PREDICTORS = ("prior", "knobs", "calibrated")
STATISTICS = ("min", "median")
KINDS = ("rollout", "trainer")
DIGITS = 6           # significant digits of the fitted values written to a preset


def split_points(points, holdout: float, seed: int) -> tuple:
    """``(fit, held)`` point ids: a seeded random ``holdout`` share held out (at least one point each)."""
    points = np.sort(np.unique(np.asarray(points, dtype=np.int64)))
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be a fraction of the grid points in (0, 1), got {holdout!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if points.size < 2:
        raise ValueError(f"a profile needs at least 2 grid points to hold some out, it has {points.size}")
    n_held = int(min(points.size - 1, max(1, round(holdout * points.size))))
    perm = np.random.default_rng([int(seed), 7]).permutation(points.size)
    return np.sort(points[perm[n_held:]]), np.sort(points[perm[:n_held]])


def point_observations(profile: Profile, kind: str, statistic: str = "min") -> pd.DataFrame:
    """One row per grid point (and stage, for the trainer): the ``statistic`` (``min`` or ``median``) of its
    repetitions' observed times, ``reps`` (their number), the lengths and the per-request length arrays."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    df = profile.rollout if kind == "rollout" else profile.trainer
    keys = ["point"] + (["stage"] if kind == "trainer" else [])
    first = {c: (c, "first") for c in ("batch", "requests", "prompt_len", "response_len", "d")}
    if kind == "rollout":
        first["group_size"] = ("group_size", "first")
    out = df.groupby(keys, sort=True).agg(observed=("observed", statistic), reps=("observed", "size"),
                                          **first).reset_index()
    out["prompt_lens"] = [np.full(n, p, np.int64) for n, p in zip(out["requests"], out["prompt_len"])]
    out["response_lens"] = [np.full(n, r, np.int64) for n, r in zip(out["requests"], out["response_len"])]
    return out


def error_table(table: pd.DataFrame, predictors, count: str = "points") -> pd.DataFrame:
    """Median and p90 relative error (percent) of each predictor column of ``table`` (with ``kind``, ``split``,
    ``observed``) per kind and split; ``count`` names the column counting the rows."""
    rows = []
    for (kind, split), sub in table.groupby(["kind", "split"], sort=False):
        for pred in predictors:
            err = (sub[pred] - sub["observed"]).abs() / sub["observed"]
            rows.append({"kind": kind, "split": split, "predictor": pred, count: len(sub),
                         "median_pct": 100 * float(err.median()), "p90_pct": 100 * float(err.quantile(0.9))})
    return pd.DataFrame(rows)


def error_of(errors: pd.DataFrame, kind: str, split: str, predictor: str) -> dict:
    """``{"median", "p90"}`` (percent) of one row of :func:`error_table`; ValueError when there is none."""
    row = errors[(errors["kind"] == kind) & (errors["split"] == split) & (errors["predictor"] == predictor)]
    if row.empty:
        raise ValueError(f"no {split} {kind} points")
    return {"median": float(row["median_pct"].iloc[0]), "p90": float(row["p90_pct"].iloc[0])}


def base_document(base) -> dict:
    """A preset's datasheet fields as a YAML-ready mapping (no name, sources, stage_params, an empty switch
    model or an unset optional field such as ``controller_data_rate``: the documented defaults apply)."""
    doc = {}
    for f in dataclasses.fields(base):
        value = getattr(base, f.name)
        if (f.name in ("name", "sources", "stage_params") or (f.name == "switch_model" and not value)
                or value is None):
            continue
        doc[f.name] = dict(value) if isinstance(value, dict) else value
    return doc


def _round(value: float) -> float:
    return float(f"{float(value):.{DIGITS}g}")


@dataclass(frozen=True)
class ProfileCalibration:
    """What :func:`calibrate_profile` found. ``table`` has one row per (kind, point[, stage]) with its
    ``split`` (fit / held-out), ``observed`` and each predictor's prediction (``prior``, ``knobs``,
    ``calibrated``); ``hardware`` is the calibrated :class:`~bidirl.job.presets.HardwareSpec` (unnamed until
    written), ``base`` the preset it started from."""
    profile: Profile
    model: object
    base: object
    hardware: object
    knobs: dict
    stage_params: dict
    table: pd.DataFrame
    holdout: float
    seed: int
    knob_fit: object
    statistic: str = "min"
    image_tokens_per_prompt: int = 0

    def errors(self) -> pd.DataFrame:
        """Median and p90 relative error (percent) per kind, split and predictor."""
        return error_table(self.table, PREDICTORS, count="points")

    def error(self, kind: str, split: str = "held-out", predictor: str = "calibrated") -> dict:
        """``{"median", "p90"}`` (percent) of one kind, split and predictor."""
        return error_of(self.errors(), kind, split, predictor)

    def held_out(self, kind: str, predictor: str = "calibrated") -> pd.DataFrame:
        """The held-out points of ``kind`` with ``observed``, ``predicted`` and ``rel_error``."""
        sub = self.table[(self.table["kind"] == kind) & (self.table["split"] == "held-out")].copy()
        sub["predicted"] = sub[predictor]
        sub["rel_error"] = (sub["predicted"] - sub["observed"]).abs() / sub["observed"]
        return sub.reset_index(drop=True)

    def summary(self) -> dict:
        """A JSON-ready summary: profile, split, knobs (prior → fitted), per-model parameters, errors."""
        meta = self.profile.meta
        return {"model": meta["model"], "hardware": self.base.name, "profile_date": meta["date"],
                "grid": meta["grid"].get("name"), "points": {"fit": int(self._count("fit")),
                                                             "held-out": int(self._count("held-out"))},
                "holdout": self.holdout, "seed": self.seed, "statistic": self.statistic,
                "image_tokens_per_prompt": self.image_tokens_per_prompt,
                "knobs": self.knobs, "prior_knobs": {k: float(getattr(self.base, k)) for k in self.knobs},
                "stage_params": self.stage_params, "errors": self.errors().to_dict(orient="records")}

    def _count(self, split: str) -> int:
        t = self.table
        return int(t[(t["kind"] == "rollout") & (t["split"] == split)]["point"].nunique())


def image_tokens_of(profile: Profile, model) -> int:
    """The LLM image tokens in every prompt of ``profile`` (its ``image_tokens_per_prompt``, module doc of
    :mod:`bidirl.calibrate.records`), checked against ``model``: absent is text-only (0) for a text model and
    refused for a vision-language one (its records must say what the encoder ran on, 0 for text prompts); image
    tokens for a model without a vision encoder are refused."""
    from bidirl.calibrate.records import IMAGE_TOKENS
    n = profile.image_tokens_per_prompt
    vision = float(getattr(model, "vision_params", 0.0)) > 0
    where = f"{profile.path / 'meta.json'}" if profile.path is not None else "the profile's meta"
    if n is None:
        if vision:
            raise ProfileError(f"{where}: no field {IMAGE_TOKENS!r}, but model {model.name!r} has a vision encoder "
                               f"({model.vision_params / 1e9:.2f} B parameters) — set {IMAGE_TOKENS} to the LLM image "
                               "tokens in every measured prompt (0 if the prompts were text only), so the calibration "
                               "charges the encoder's work instead of fitting it into the decoder's knobs")
        return 0
    if n > 0 and not vision:
        raise ProfileError(f"{where}: field {IMAGE_TOKENS!r} is {n} but model {model.name!r} has no vision encoder — "
                           f"set it to 0 (or leave it out) for a text model, or name the vision-language model the "
                           "records were measured with")
    return int(n)


def _models(model, hw, meta: dict, image_tokens_per_prompt: int = 0):
    from bidirl.perf.rollout import RolloutModel
    from bidirl.perf.trainer import TrainerModel
    max_seqs = meta.get("settings", {}).get("max_num_seqs")
    return (RolloutModel(model, hw, tp=1, max_seqs=int(max_seqs) if max_seqs else None,
                         image_tokens_per_prompt=image_tokens_per_prompt),
            TrainerModel(model, hw, layout=1, image_tokens_per_prompt=image_tokens_per_prompt))


def predict_points(table: pd.DataFrame, hw, model, meta: dict, image_tokens_per_prompt: int = 0) -> np.ndarray:
    """Each row's predicted time under ``hw`` (rollout: M_r of the batch; trainer: the chunk time), every prompt
    holding ``image_tokens_per_prompt`` LLM image tokens (:func:`image_tokens_of`)."""
    rollout, trainer = _models(model, hw, meta, image_tokens_per_prompt)
    out = np.empty(len(table))
    for i, row in enumerate(table.itertuples(index=False)):
        if row.kind == "rollout":
            out[i] = rollout.stage_time(row.prompt_lens, row.response_lens, int(row.d), int(row.group_size))
        else:
            out[i] = trainer.chunk_time(row.stage, row.prompt_lens, row.response_lens, int(row.d))
    return out


def stage_params_entry(rollout_fit=None, trainer_fit=None, *, tp: int = 1, layout: int = 1) -> dict:
    """A preset's ``stage_params`` entry for one model (:mod:`bidirl.perf.params`) from the fitted appendix
    parameters of :func:`~bidirl.perf.fit.calibrate_rollout` / ``calibrate_trainer`` (either may be None)."""
    entry: dict = {}
    if rollout_fit is not None:
        entry["rollout"] = {"tp": int(tp), **{f: _round(getattr(rollout_fit.params, f)) for f in rollout_fit.fitted}}
    if trainer_fit is not None:
        fields: dict = {}
        for name in trainer_fit.fitted:                       # "tau[old_logprob]"
            field, stage = name[:-1].split("[")
            fields.setdefault(field, {})[stage] = _round(getattr(trainer_fit.params, field)[stage])
        entry["trainer"] = {"layout": int(layout), **fields}
    return entry


def calibrate_profile(profile: Union[Profile, str, Path], *, hardware: Optional[str] = None,
                      holdout: float = 0.25, seed: int = 0, overrides: bool = True,
                      statistic: str = "min", request_cost: bool = True,
                      spill_cost: Optional[bool] = None) -> ProfileCalibration:
    """Fit knobs (and, with ``overrides``, the profiled model's parameters) on a seeded split of the grid
    points and predict every point (module doc). ``hardware`` names the base preset (default: the one the
    profile names). ``request_cost=False`` leaves the per-request admission cost γ_req out of the fit (the
    appendix's M_r as written; for comparison). ``spill_cost``: fit the actor update's cost per byte of saved
    activations beyond the cache, β_mem (:func:`bidirl.perf.trainer.spill_bytes`); None: where the base preset
    states its ``cache_bytes``, False: never (the appendix's M_t as written), True: required (a preset without
    ``cache_bytes`` is refused by name)."""
    from bidirl.job import presets
    from bidirl.perf.fit import calibrate_knobs, calibrate_rollout, calibrate_trainer, knob_hardware
    from bidirl.perf.trainer import has_cache

    if not isinstance(profile, Profile):
        profile = load_profile(profile)
    model = presets.model(profile.model)
    images = image_tokens_of(profile, model)
    base = presets.hardware(hardware or profile.hardware)
    if profile.rollout["d"].max() > 1 or profile.trainer["d"].max() > 1:
        raise ProfileError("calibrate_profile fits one-replica records (d = 1, as `bidirl profile` writes); "
                           "fit records of several replicas with bidirl.perf.fit directly")
    fit_ids, held_ids = split_points(profile.points(), holdout, seed)
    obs = {k: point_observations(profile, k, statistic) for k in KINDS}
    fit = {k: obs[k][obs[k]["point"].isin(fit_ids)].reset_index(drop=True) for k in KINDS}

    knob_fit = calibrate_knobs(model, base, fit["rollout"], fit["trainer"], tp=1, layout=1,
                               image_tokens_per_prompt=images)
    knobs = {k: _round(v) for k, v in knob_fit.knobs.items()}
    knob_hw = knob_hardware(base, knobs)
    entry: dict = {}
    if overrides:
        r_model, t_model = _models(model, knob_hw, profile.meta, images)
        spill = has_cache(base) if spill_cost is None else bool(spill_cost)
        entry = stage_params_entry(calibrate_rollout(fit["rollout"], r_model, fit_request_cost=bool(request_cost)),
                                   calibrate_trainer(fit["trainer"], t_model, fit_spill_cost=spill), tp=1, layout=1)
    kept = {m: v for m, v in (base.stage_params or {}).items() if m != model.name}
    stage_params = {**kept, model.name: entry} if entry else kept
    calibrated = dataclasses.replace(knob_hw, stage_params=stage_params)

    table = pd.concat([obs[k].assign(kind=k) for k in KINDS], ignore_index=True)
    table["split"] = np.where(table["point"].isin(held_ids), "held-out", "fit")
    for name, hw in (("prior", base), ("knobs", knob_hw), ("calibrated", calibrated)):
        table[name] = predict_points(table, hw, model, profile.meta, images)
    return ProfileCalibration(profile, model, base, calibrated, knobs, entry, table, float(holdout), int(seed),
                              knob_fit, statistic, images)


# --------------------------------------------------------------------------------------------------
# the preset
# --------------------------------------------------------------------------------------------------

def records_label(profile: Profile) -> str:
    """Where the records live, without machine-specific paths: ``data/...`` inside the data folder, else
    the folder's name."""
    from bidirl.job import presets
    if profile.path is None:
        return "(records in memory)"
    path = Path(profile.path).resolve()
    root = presets.data_dir().resolve()
    try:
        return f"data/{path.relative_to(root).as_posix()}"
    except ValueError:
        return path.name


def calibration_source(cal: ProfileCalibration) -> str:
    """The ``sources`` line of a calibrated preset: what was measured, where, when, with what error."""
    meta = cal.profile.meta
    m, eng, grid = meta["machine"], meta["engines"], meta["grid"]
    counts = (f"{cal._count('fit')} fit / {cal._count('held-out')} held-out grid points, each the {cal.statistic} "
              f"of {grid.get('repeats')} repetitions")
    errs = "; ".join(f"{k} median {cal.error(k)['median']:.1f} %, p90 {cal.error(k)['p90']:.1f} %" for k in KINDS)
    knob_errs = "; ".join(f"{k} median {cal.error(k, predictor='knobs')['median']:.1f} %, "
                          f"p90 {cal.error(k, predictor='knobs')['p90']:.1f} %" for k in KINDS)
    return (f"calibrated by `bidirl calibrate` (holdout {cal.holdout:g}, seed {cal.seed}) from "
            f"{records_label(cal.profile)}: "
            f"model {meta['model']} measured {meta['date']} on {m.get('system')} {m.get('machine')} with "
            f"{m.get('usable_cpus')} usable CPUs (vllm {eng.get('vllm')}, torch {eng.get('torch')}), "
            f"{grid.get('name')} grid, {counts}; held-out error with "
            f"stage_params: {errs}; with the knobs alone: {knob_errs}")


def preset_document(cal: ProfileCalibration) -> dict:
    """The calibrated preset as a YAML-ready mapping: the base preset's datasheet numbers, the fitted knobs,
    ``stage_params`` and ``sources`` (the base's plus :func:`calibration_source`)."""
    doc = base_document(cal.base)
    doc.update(cal.knobs)
    if cal.hardware.stage_params:
        doc["stage_params"] = cal.hardware.stage_params
    sources = [s for s in cal.base.sources if not s.startswith("calibrated by `bidirl calibrate`")]
    doc["sources"] = sources + [calibration_source(cal)]
    return doc


def write_preset(cal: ProfileCalibration, path: Union[str, Path]) -> Path:
    """Write :func:`preset_document` to ``path`` (a ``<name>.yaml``; the preset is named by its file) and
    check that it loads back with the calibrated values."""
    from bidirl.calibrate.preset_file import write_hardware_preset
    header = (f"# {Path(path).stem}: hardware preset '{cal.base.name}' calibrated on measured stage times "
              "(bidirl calibrate).\n"
              f"# The knobs carry over to other models on this hardware; stage_params hold the appendix parameters\n"
              f"# fitted for model '{cal.model.name}'. Regenerate rather than edit; sources say from what.\n")
    return write_hardware_preset(preset_document(cal), cal.knobs, path, header, what="--out")


def format_calibration(cal: ProfileCalibration) -> str:
    """The human-readable report of ``bidirl calibrate``."""
    e = cal.errors()
    lines = [f"bidirl calibrate: model {cal.model.name} on {cal.base.name} — "
             f"{cal._count('fit')} fit / {cal._count('held-out')} held-out grid points "
             f"(holdout {cal.holdout:g}, seed {cal.seed}; a point's time is the {cal.statistic} of its repetitions)",
             (f"prompts: {cal.image_tokens_per_prompt} LLM image tokens each, the vision encoder charged per request "
              "in prefill and per sample in each trainer stage" if cal.image_tokens_per_prompt
              else "prompts: text only (no vision encoder charged)"),
             "", "knobs (prior → fitted):"]
    for k, v in cal.knobs.items():
        lines.append(f"  {k:<26} {getattr(cal.base, k):>12.4g} → {v:.4g}")
    if cal.stage_params:
        lines += ["", f"stage_params for {cal.model.name}: " + ", ".join(
            f"{kind}: {', '.join(k for k in v if k not in ('tp', 'layout'))}" for kind, v in cal.stage_params.items())]
    lines += ["", "relative error per grid point (%):"]
    pivot = e.pivot_table(index=["kind", "split"], columns="predictor", values=["median_pct", "p90_pct"])
    pivot = pivot.reindex(columns=[(s, p) for s in ("median_pct", "p90_pct") for p in PREDICTORS])
    pivot.columns = [f"{p} {'median' if s == 'median_pct' else 'p90'}" for s, p in pivot.columns]
    lines.append(pivot.to_string(float_format=lambda v: f"{v:.1f}"))
    return "\n".join(lines)


__all__ = ["calibrate_profile", "image_tokens_of", "ProfileCalibration", "split_points", "point_observations", "predict_points",
           "preset_document", "write_preset", "calibration_source", "format_calibration", "records_label",
           "STATISTICS"]
