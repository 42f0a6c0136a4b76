"""Calibrate the stage-time models from a user's own job: a veRL-style per-step metrics log.

Users of veRL, AReaL or bidirl already log one row of metrics per training step. This module fits the hardware
preset's efficiency knobs (:data:`bidirl.perf.params.KNOBS`; by default ``train_mfu`` and ``decode_mbu``) so
that the appendix's stage-time models reproduce that job's measured stage times; with the fitted preset,
``bidirl plan`` and ``bidirl simulate`` answer "what would BiDiRL gain on *my* job, and at which split".

**The log** (formats and keys: :mod:`bidirl.calibrate.step_log`): veRL's per-step timings
(``timing_s/update_actor``, ``timing_s/old_log_prob``, ``timing_s/ref``, ``timing_s/gen``), response and prompt
lengths, and for an asynchronous log the rollout pool's ``idle_ratio``.

**The job.** A bidirl config describes what the log does not: model, hardware preset, GPUs and the job's
rollout/trainer split (``cluster.partition``; ``colocated=True`` for a job whose rollout and trainer share all
GPUs, veRL's default), prompts per step, group size, ``rl.micro_batch_per_device`` and the stages it runs.

**One step's batch.** The log gives a step's mean and longest response, not every length; the step's batch is the
workload preset's length distribution for that step (:class:`bidirl.perf.workload.GroupLengths`, the config's
seed), rescaled so that its mean and its longest response are the log's (and its mean prompt, when logged).

**The fit.** Steps are split at random (seeded) into fit and held-out steps; the first ``skip`` steps (warm-up:
compilation, cache allocation) are left out. The knobs are fitted with ``scipy.optimize.least_squares`` on the
relative errors of every (step, stage) time of the fit steps, efficiency factors as their inverses (≥ 1: at most
the datasheet peak), overheads in seconds (≥ 0), as :func:`bidirl.perf.fit.calibrate_knobs` does for
profiling records. The job model's ``stage_params`` in the base preset are dropped (the fitted knobs describe
this job); other models' entries are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from bidirl.calibrate.step_log import (GEN_KEY, PROMPT_MEAN_KEY, REQUIRED_KEYS, ROLLOUT_IDLE_KEY, STAGE_KEYS,
                                       STEP_TIME_KEY, LogError, read_number, read_step_log)
from bidirl.job import config as cfgmod
from bidirl.perf.params import EFFICIENCY_KNOBS, KNOBS

DEFAULT_KNOBS = ("train_mfu", "decode_mbu")
#: which stage side a knob can be fitted from
KNOB_SIDE = {"train_mfu": "trainer", "prefill_mfu": "rollout", "decode_mbu": "rollout",
             "scheduler_overhead": "rollout", "decode_token_overhead": "rollout",
             "kernel_overhead_per_layer": "both"}
OVERHEAD_SCALE = 1e-5        # seconds: the optimisation's unit for an overhead knob whose prior is 0
# --------------------------------------------------------------------------------------------------
# the job's batches and observations
# --------------------------------------------------------------------------------------------------

def step_batch(cfg, step: int, response_mean: float, response_max: float,
               prompt_mean: Optional[float] = None) -> tuple:
    """``(prompt_lens, response_lens)`` of step ``step``'s batch: the workload's lengths for that step, rescaled
    to the logged mean and longest response (and mean prompt); group after group in group-id order."""
    from bidirl.perf.workload import GroupLengths
    w = cfg.workload
    lengths = GroupLengths.of(cfg, cfg.seed)
    groups = [lengths(step * w.prompts_per_step + g) for g in range(w.prompts_per_step)]
    p = np.repeat(np.array([prompt for prompt, _ in groups], dtype=float), w.group_size)
    r = np.array([n for _, targets in groups for n in targets], dtype=float)
    top = max(1.0, float(response_max))
    mean = min(max(1.0, float(response_mean)), top)
    for _ in range(20):               # scale to the mean, cap at the max; the cap moves the mean, so repeat
        r = np.minimum(r * (mean / max(r.mean(), 1e-9)), top)
        if abs(r.mean() - mean) <= 1e-6 * mean:
            break
    r[int(np.argmax(r))] = top
    if prompt_mean is not None and prompt_mean > 0:
        p = p * (float(prompt_mean) / p.mean())
    return np.maximum(np.rint(p), 1).astype(np.int64), np.maximum(np.rint(r), 1).astype(np.int64)


@dataclass(frozen=True)
class Observation:
    step: int             # the log's row (0-based, in step order)
    kind: str             # rollout | trainer
    stage: str            # generate, or the trainer stage
    observed: float       # seconds
    prompt_lens: np.ndarray
    response_lens: np.ndarray


def _column(frame: pd.DataFrame, key: str, name: str) -> np.ndarray:
    out = np.array([read_number(v, f"{name}: row {i}, {key}") if v is not None and not (isinstance(v, float) and
                                                                                    math.isnan(v)) else math.nan
                    for i, v in enumerate(frame[key])], dtype=float)
    return out


def rollout_times(frame: pd.DataFrame, cfg) -> tuple:
    """``(seconds per row or None, note)``: each step's batch generation time, if the log measures it."""
    name = Path(frame.attrs.get("path", "log")).name
    if ROLLOUT_IDLE_KEY in frame.columns and STEP_TIME_KEY in frame.columns:
        if cfg.rl.staleness != 0:
            return None, (f"asynchronous log at rl.staleness {cfg.rl.staleness:g}: the rollout pool overlaps "
                          "batches, so its busy time per step is not one batch's generation time; only the trainer "
                          "was fitted (log a run at staleness 0 to fit the rollout too)")
        busy = (1.0 - _column(frame, ROLLOUT_IDLE_KEY, name)) * _column(frame, STEP_TIME_KEY, name)
        return busy, f"rollout: the rollout pool's busy time per step, (1 − {ROLLOUT_IDLE_KEY})·{STEP_TIME_KEY}"
    if GEN_KEY in frame.columns:
        return _column(frame, GEN_KEY, name), f"rollout: {GEN_KEY} (a synchronous trainer waits for the whole batch)"
    return None, f"no {GEN_KEY} in the log: only the trainer was fitted"


def observations(frame: pd.DataFrame, cfg) -> tuple:
    """``(observations, notes)`` of every usable (step, stage) time of the log under the job ``cfg``."""
    name = Path(frame.attrs.get("path", "log")).name
    missing = [k for k in REQUIRED_KEYS if k not in frame.columns]
    if missing:
        raise LogError(f"{name}: missing {missing} — a step log needs {', '.join(REQUIRED_KEYS)} per step (veRL logs "
                       "them by default; bidirl's engine runs write them to metrics.jsonl)")
    notes = []
    mean = _column(frame, "response_length/mean", name)
    top = _column(frame, "response_length/max", name)
    prompt = _column(frame, PROMPT_MEAN_KEY, name) if PROMPT_MEAN_KEY in frame.columns else None
    if prompt is None:
        notes.append(f"no {PROMPT_MEAN_KEY}: prompts follow the workload preset {cfg.workload.dataset!r}")
    gen, note = rollout_times(frame, cfg)
    notes.append(note)
    stages = [s for s in cfg.rl.stages if STAGE_KEYS[s] in frame.columns]
    skipped = [s for s in cfg.rl.stages if s not in stages]
    if skipped:
        notes.append(f"stages the job runs but the log does not time: {', '.join(skipped)}")
    trainer = {s: _column(frame, STAGE_KEYS[s], name) for s in stages}
    out = []
    for i in range(len(frame)):
        if not (np.isfinite(mean[i]) and np.isfinite(top[i]) and top[i] > 0):
            continue
        p, r = step_batch(cfg, i, mean[i], top[i], None if prompt is None or not np.isfinite(prompt[i]) else prompt[i])
        if gen is not None and np.isfinite(gen[i]) and gen[i] > 0:
            out.append(Observation(i, "rollout", "generate", float(gen[i]), p, r))
        for s, t in trainer.items():
            if np.isfinite(t[i]) and t[i] > 0:
                out.append(Observation(i, "trainer", s, float(t[i]), p, r))
    if not out:
        raise LogError(f"{name}: no step has positive stage times with response lengths — check the log's units "
                       "(seconds) and keys")
    return out, notes


# --------------------------------------------------------------------------------------------------
# predicting and fitting
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobShape:
    """Where the job ran: replica layouts and replica counts of both roles (module doc, "The job")."""
    rollout_layout: int
    trainer_layout: int
    rollout_replicas: int
    trainer_replicas: int
    colocated: bool

    @classmethod
    def of(cls, cfg, hardware, colocated: bool) -> "JobShape":
        from bidirl.job.planner import min_feasible_layouts
        rho_r, rho_t, _ = min_feasible_layouts(cfg, hardware)
        if colocated:
            g_r = g_t = cfg.cluster.gpus
        elif cfg.cluster.partition is None:
            raise cfgmod.ConfigError("cluster.partition", "the job's rollout/trainer split is not set",
                                     "set cluster.partition to the split the logged job ran on, or calibrate with "
                                     "colocated=True (--colocated) for a job whose rollout and trainer share all "
                                     "GPUs (veRL's default)")
        else:
            g_r, g_t = cfg.cluster.partition.rollout, cfg.cluster.partition.trainer
        return cls(rho_r, rho_t, max(1, g_r // rho_r), max(1, g_t // rho_t), bool(colocated))


def trainer_order(prompt_lens, response_lens, group_size: int, colocated: bool) -> np.ndarray:
    """The order in which the logged job's trainer saw a step's samples: a colocated (synchronous) job trains on
    the batch as it was submitted, group-id order, once every response is done — as ``bidirl.sim.colocated``
    simulates it; a split (asynchronous) job consumes the groups in the order they complete
    (:func:`bidirl.job.planner.consumption_order`), as the planner and the coordinator do. One order per job
    shape, so a fitted preset reproduces the simulator's trainer times for the same lengths."""
    if colocated:
        return np.arange(np.asarray(prompt_lens).size)
    from bidirl.job.planner import consumption_order
    return consumption_order(prompt_lens, response_lens, group_size)


def predict(obs: Sequence[Observation], cfg, hardware, shape: JobShape) -> np.ndarray:
    """Each observation's time under ``hardware``'s models: M_r of the batch on the job's rollout replicas, or
    one trainer stage's chunk times summed over the batch in the order the job's trainer saw it
    (:func:`trainer_order`)."""
    from bidirl.perf.predictor import StagePredictor
    pred = StagePredictor.from_config(cfg, shape.rollout_layout, shape.trainer_layout, hardware)
    g, mb = cfg.workload.group_size, cfg.rl.micro_batch_per_device
    out = np.empty(len(obs))
    for i, o in enumerate(obs):
        if o.kind == "rollout":
            out[i] = pred.rollout.stage_time(o.prompt_lens, o.response_lens, shape.rollout_replicas, g)
        else:
            order = trainer_order(o.prompt_lens, o.response_lens, g, shape.colocated)
            out[i] = pred.trainer.stage_time(o.prompt_lens[order], o.response_lens[order], shape.trainer_replicas,
                                             mb, (o.stage,))
    return out


def split_steps(steps: Sequence[int], holdout: float, seed: int) -> tuple:
    """``(fit, held)`` step sets: a seeded random ``holdout`` share held out (at least one step on each side)."""
    from bidirl.calibrate.from_records import split_points
    return tuple(set(map(int, s)) for s in split_points(np.asarray(sorted(set(steps))), holdout, seed))


@dataclass(frozen=True)
class LogCalibration:
    """What :func:`calibrate_from_log` found. ``table``: one row per (step, stage) with ``split``, ``observed``,
    ``prior`` (the base preset's prediction) and ``fitted``; ``hardware`` is the fitted preset."""
    config: object
    base: object
    hardware: object
    knobs: dict
    prior_knobs: dict
    table: pd.DataFrame
    shape: JobShape
    notes: tuple
    log_path: str
    holdout: float
    seed: int
    skip: int
    success: bool
    stage_params: dict = dataclasses.field(default_factory=dict)

    def errors(self) -> pd.DataFrame:
        """Median and p90 relative error (percent) per kind, split and predictor (prior / fitted)."""
        from bidirl.calibrate.from_records import error_table
        return error_table(self.table, ("prior", "fitted"), count="times")

    def error(self, kind: str, split: str = "held-out", predictor: str = "fitted") -> dict:
        from bidirl.calibrate.from_records import error_of
        return error_of(self.errors(), kind, split, predictor)

    def summary(self) -> dict:
        steps = self.table.groupby("split")["step"].nunique().to_dict()
        return {"log": Path(self.log_path).name, "model": self.config.model, "hardware": self.base.name,
                "steps": {k: int(v) for k, v in steps.items()}, "skipped_warmup_steps": self.skip,
                "holdout": self.holdout, "seed": self.seed, "knobs": dict(self.knobs),
                "prior_knobs": dict(self.prior_knobs), "stage_params": self.stage_params,
                "job": dataclasses.asdict(self.shape),
                "notes": list(self.notes), "success": self.success,
                "errors": self.errors().to_dict(orient="records")}

    def source(self) -> str:
        """The ``sources`` line of the written preset."""
        parts = [f"{k} {self.error(k)['median']:.1f} % median, {self.error(k)['p90']:.1f} % p90"
                 for k in sorted(self.table["kind"].unique())
                 if len(self.table[(self.table["kind"] == k) & (self.table["split"] == "held-out")])]
        steps = self.table.groupby("split")["step"].nunique().to_dict()
        return (f"calibrated by `bidirl calibrate --log` from {Path(self.log_path).name}: model {self.config.model} "
                f"on {self.config.cluster.gpus} GPUs ({'colocated' if self.shape.colocated else 'split'} "
                f"{self.shape.rollout_replicas}×{self.shape.rollout_layout} rollout / {self.shape.trainer_replicas}"
                f"×{self.shape.trainer_layout} trainer GPUs), {steps.get('fit', 0)} fit / "
                f"{steps.get('held-out', 0)} held-out steps (seed {self.seed}, first {self.skip} skipped); "
                f"held-out error: {'; '.join(parts)}")


def calibrate_from_log(log, config, *, knobs: Sequence[str] = DEFAULT_KNOBS, hardware=None,
                       colocated: bool = False, holdout: float = 0.25, seed: int = 0, skip: int = 1,
                       model_params: bool = True) -> LogCalibration:
    """Fit ``knobs`` of the job's hardware preset (or ``hardware``, a preset name or HardwareSpec) to a step log
    (a path or a :func:`read_step_log` frame) of the job ``config``, then (``model_params``) the job model's
    appendix parameters from there (module doc)."""
    from bidirl.job import presets
    from bidirl.perf.fit import knob_hardware
    from bidirl.perf.params import check_knob, knob

    cfg = cfgmod.load(config)
    frame = log if isinstance(log, pd.DataFrame) else read_step_log(log)
    path = frame.attrs.get("path", "(in memory)")
    knobs = tuple(knobs)
    unknown = [k for k in knobs if k not in KNOBS]
    if not knobs or unknown:
        raise ValueError(f"knobs: {unknown or 'none given'} — choose from {', '.join(KNOBS)}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip must be a whole number of warm-up steps ≥ 0, got {skip!r}")
    base = hardware if isinstance(hardware, presets.HardwareSpec) else \
        presets.hardware(hardware) if hardware else cfg.hardware_spec
    shape = JobShape.of(cfg, base, colocated)
    obs, notes = observations(frame, cfg)
    obs = [o for o in obs if o.step >= skip]
    kinds = {o.kind for o in obs}
    usable = [k for k in knobs if KNOB_SIDE[k] == "both" or KNOB_SIDE[k] in kinds]
    if not usable:
        raise LogError(f"{Path(path).name}: the log times only the {'/'.join(sorted(kinds)) or 'no'} stage(s); none "
                       f"of the knobs {', '.join(knobs)} describes them")
    notes = [*notes, *(f"{k} not fitted: the log has no {KNOB_SIDE[k]} times" for k in knobs if k not in usable)]
    fit_steps, held_steps = split_steps([o.step for o in obs], holdout, seed)
    fit_obs = [o for o in obs if o.step in fit_steps]
    note = warn_underdetermined("the hardware knobs " + ", ".join(usable), len(usable), operating_points(fit_obs))
    notes += [note] if note else []

    # the model's own stage_params would override the knobs: the fit describes this job with knobs alone
    kept = {m: v for m, v in (base.stage_params or {}).items() if m != cfg.model}
    start = knob_hardware(base, {})
    prior = {k: knob(start, k) for k in usable}
    is_eff = np.array([k in EFFICIENCY_KNOBS for k in usable])
    z0 = np.array([1.0 / prior[k] if e else prior[k] for k, e in zip(usable, is_eff)])
    scale = np.where(z0 > 0, z0, OVERHEAD_SCALE)

    def hw_of(x):
        z = np.asarray(x) * scale
        return knob_hardware(start, {k: (1.0 / v if e else v) for k, v, e in zip(usable, z, is_eff)})

    observed = np.array([o.observed for o in fit_obs])
    kinds_fit = np.array([o.kind for o in fit_obs])
    weights = np.array([1.0 / math.sqrt(max(1, int((kinds_fit == k).sum()))) for k in kinds_fit])

    def residuals(x):
        return weights * (predict(fit_obs, cfg, hw_of(x), shape) - observed) / observed

    lo = np.where(is_eff, 1.0, 0.0) / scale
    sol = least_squares(residuals, np.clip(z0 / scale, lo, None), bounds=(lo, np.inf), method="trf",
                        x_scale="jac", max_nfev=100 * (len(usable) + 1))
    fitted = {k: float(f"{knob(hw_of(sol.x), k):.6g}") for k in usable}
    fitted = {k: check_knob(k, v) for k, v in fitted.items()}
    fitted_hw = dataclasses.replace(knob_hardware(start, fitted), stage_params=kept)
    entry: dict = {}
    if model_params:
        with warnings_as_notes(notes):
            entry = _fit_stage_params(fit_obs, cfg, fitted_hw, shape)
        if entry:
            fitted_hw = dataclasses.replace(fitted_hw, stage_params={**kept, cfg.model: entry})

    table = pd.DataFrame({"step": [o.step for o in obs], "kind": [o.kind for o in obs],
                          "stage": [o.stage for o in obs], "observed": [o.observed for o in obs]})
    table["split"] = np.where(table["step"].isin(held_steps), "held-out", "fit")
    table["prior"] = predict(obs, cfg, base, shape)
    table["fitted"] = predict(obs, cfg, fitted_hw, shape)
    if STEP_TIME_KEY in frame.columns:
        notes.append(_unexplained(frame, table, skip))
    return LogCalibration(cfg, base, fitted_hw, fitted, prior, table, shape, tuple(notes), str(path),
                          float(holdout), int(seed), int(skip), bool(sol.success), entry)


@contextlib.contextmanager
def warnings_as_notes(notes: list):
    """Record :class:`UnderdeterminedFit` warnings raised inside as notes of the calibration too (the report and
    ``--json`` show them), and re-raise each for the caller's warning filters."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnderdeterminedFit)
        yield
    for w in caught:
        if issubclass(w.category, UnderdeterminedFit):
            notes.append(str(w.message))
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _unexplained(frame: pd.DataFrame, table: pd.DataFrame, skip: int) -> str:
    """How much of the logged step time the fitted stage times leave out (coordination, rewards, RPCs, data
    movement: work the stage-time models do not describe), as a note."""
    name = Path(frame.attrs.get("path", "log")).name
    step = _column(frame, STEP_TIME_KEY, name)[skip:]
    stages = table.groupby("step")["fitted"].sum()
    sync = _column(frame, "timing_s/param_sync", name)[skip:] if "timing_s/param_sync" in frame.columns else 0.0
    explained = np.nanmedian(stages.reindex(range(skip, len(frame))).to_numpy() + sync)
    median = float(np.nanmedian(step))
    return (f"median logged step {median:.3g} s, of which the fitted stage times (plus the logged weight sync) "
            f"explain {explained:.3g} s ({100 * explained / median:.0f} %); the rest is outside the stage-time "
            "models (coordination, rewards, RPCs), so simulated throughput with this preset is an upper bound")


def _fit_stage_params(obs: Sequence[Observation], cfg, hardware, shape: JobShape) -> dict:
    """The job model's ``stage_params`` entry fitted to the observations, starting from ``hardware``'s knobs:
    one rollout record per step (the batch on the job's rollout replicas) and, per trainer stage, one record per
    chunk, the stage's time shared among its chunks as the knob-fitted model predicts."""
    from bidirl.calibrate.from_records import stage_params_entry
    from bidirl.perf.fit import calibrate_rollout, calibrate_trainer
    from bidirl.perf.predictor import StagePredictor
    pred = StagePredictor.from_config(cfg, shape.rollout_layout, shape.trainer_layout, hardware)
    g, d_t = cfg.workload.group_size, shape.trainer_replicas
    size = pred.trainer.chunk_size(cfg.rl.micro_batch_per_device, d_t)
    rollout, trainer = [], []
    for o in obs:
        if o.kind == "rollout":
            rollout.append({"prompt_lens": o.prompt_lens, "response_lens": o.response_lens,
                            "d": shape.rollout_replicas, "group_size": g, "observed": o.observed})
            continue
        order = trainer_order(o.prompt_lens, o.response_lens, g, shape.colocated)
        p, r = o.prompt_lens[order], o.response_lens[order]
        share = pred.trainer.chunk_times(o.stage, p, r, d_t, size)
        share = share / share.sum() if share.sum() > 0 else np.full(share.size, 1.0 / share.size)
        for k, w in enumerate(share):
            part = slice(k * size, (k + 1) * size)
            trainer.append({"stage": o.stage, "prompt_lens": p[part], "response_lens": r[part], "d": d_t,
                            "observed": o.observed * float(w)})
    r_fit = calibrate_rollout(rollout, pred.rollout) if rollout else None
    t_fit = calibrate_trainer(trainer, pred.trainer) if trainer else None
    for fit, points in ((r_fit, operating_points(o for o in obs if o.kind == "rollout")),
                        (t_fit, operating_points(o for o in obs if o.kind == "trainer"))):
        if fit is not None:
            warn_underdetermined(f"the {fit.kind} model's appendix parameters", len(fit.fitted), points)
    return stage_params_entry(r_fit, t_fit, tp=shape.rollout_layout, layout=shape.trainer_layout)


class UnderdeterminedFit(UserWarning):
    """A fit has fewer operating points than free parameters: the data cannot pin them all (any of many
    parameter sets reproduces it), so what the fitted model predicts away from the logged job is not measured."""


def operating_points(obs) -> int:
    """Distinct operating points among observations: one per (kind, stage) of a log — every step of one job runs
    the same model on the same replicas with the same batch size; only its lengths vary, which moves all stage
    times together rather than separating the parameters that scale with FLOPs, bytes and per-step overheads."""
    return len({(o.kind, o.stage) for o in obs})


def warn_underdetermined(what: str, parameters: int, points: int) -> Optional[str]:
    """Warn (:class:`UnderdeterminedFit`) and return the note when ``points`` < ``parameters``."""
    if points >= parameters:
        return None
    note = (f"{what}: {parameters} parameters fitted to {points} operating point{'s' * (points != 1)} — "
            "underdetermined; predictions away from the logged job are extrapolations (fit the knobs only, "
            "--knobs-only, or calibrate from profiling records that vary batch and replicas)")
    import warnings
    warnings.warn(note, UnderdeterminedFit, stacklevel=3)
    return note


# --------------------------------------------------------------------------------------------------
# the preset
# --------------------------------------------------------------------------------------------------

def preset_document(cal: LogCalibration) -> dict:
    """The fitted preset as a YAML-ready mapping: the base preset with the fitted knobs and a ``sources`` line."""
    from bidirl.calibrate.from_records import base_document
    doc = base_document(cal.base)
    doc.update(cal.knobs)
    if cal.hardware.stage_params:
        doc["stage_params"] = cal.hardware.stage_params
    doc["sources"] = [*cal.base.sources, cal.source()]
    return doc


def write_preset(cal: LogCalibration, path: Union[str, Path]) -> Path:
    """Write :func:`preset_document` to ``path`` (``<name>.yaml``) and check it loads back with the fitted knobs.
    Use it in a config as ``hardware: path/to/<name>.yaml`` (or copy it into ``data/presets/hardware/``)."""
    from bidirl.calibrate.preset_file import write_hardware_preset
    header = (f"# {Path(path).stem}: hardware preset '{cal.base.name}' with knobs fitted to the step log of a "
              f"{cal.config.model} job (bidirl calibrate --log).\n")
    return write_hardware_preset(preset_document(cal), cal.knobs, path, header)


def what_if(config, preset: Union[str, Path], *, steps: Optional[int] = None, seed: Optional[int] = None,
            colocated: bool = False, log=None) -> dict:
    """"What would BiDiRL gain on my job, and at which split": with the fitted preset file, the planner's choice
    of split, and simulated throughput (tokens/s) of the job as it ran — its split without borrowing, or veRL's
    colocated trainer for a ``colocated`` job — and of BiDiRL at the job's split and at the planner's choice;
    with the ``log``, its measured throughput beside them (``measured``)."""
    from bidirl.job.planner import plan
    from bidirl.sim import simulate
    cfg = cfgmod.load(config).with_overrides({"hardware": str(Path(preset).resolve())})
    free = plan(cfg.with_overrides({"cluster.partition": None}))
    choice = (free.envelope.rollout_gpus, free.envelope.trainer_gpus)
    runs = {}
    if colocated:
        runs["as run (verl-colocated)"] = simulate(cfg, "verl-colocated", steps=steps, seed=seed)
    else:
        runs["as run (no-borrow)"] = simulate(cfg, "no-borrow", steps=steps, seed=seed)
        runs[f"bidirl at {cfg.cluster.partition.rollout}-{cfg.cluster.partition.trainer}"] = \
            simulate(cfg, "bidirl", steps=steps, seed=seed)
    at_choice = cfg.with_overrides({"cluster.partition": list(choice)})
    runs[f"bidirl at {choice[0]}-{choice[1]} (planner's choice)"] = simulate(at_choice, "bidirl", steps=steps, seed=seed)
    throughput = {name: float(r.summary()["throughput"]) for name, r in runs.items()}
    base = next(iter(throughput.values()))
    return {"planner_choice": f"{choice[0]}-{choice[1]}", "throughput": throughput,
            "gain": {name: tp / base for name, tp in throughput.items()}, "provenance": "simulated",
            "measured": measured_throughput(log) if log is not None else None}


def measured_throughput(log) -> Optional[float]:
    """The log's median job throughput (tokens/s): ``bidirl/throughput``, else veRL's per-GPU ``perf/throughput``
    times the GPUs is not known here, so None."""
    frame = log if isinstance(log, pd.DataFrame) else read_step_log(log)
    if "bidirl/throughput" not in frame.columns:
        return None
    return float(np.nanmedian(_column(frame, "bidirl/throughput", "log")))


def format_log_calibration(cal: LogCalibration) -> str:
    """The human-readable report of ``bidirl calibrate --log``."""
    s = cal.shape
    steps = cal.table.groupby("split")["step"].nunique().to_dict()
    lines = [f"bidirl calibrate --log {Path(cal.log_path).name}: {cal.config.model} on {cal.base.name}, "
             f"{s.rollout_replicas}×{s.rollout_layout} rollout / {s.trainer_replicas}×{s.trainer_layout} trainer GPUs"
             f"{' (colocated)' if s.colocated else ''} — {steps.get('fit', 0)} fit / {steps.get('held-out', 0)} "
             f"held-out steps (seed {cal.seed}; first {cal.skip} skipped as warm-up)", "", "knobs (prior → fitted):"]
    lines += [f"  {k:<26} {cal.prior_knobs[k]:>12.4g} → {v:.4g}" for k, v in cal.knobs.items()]
    lines += ["", "relative error per step and stage (%):"]
    e = cal.errors()
    for r in e.itertuples(index=False):
        lines.append(f"  {r.kind:<8} {r.split:<9} {r.predictor:<7} median {r.median_pct:6.1f}  p90 {r.p90_pct:6.1f}"
                     f"  ({r.times} times)")
    lines += ["", *(f"note: {n}" for n in cal.notes)]
    return "\n".join(lines)


__all__ = ["read_step_log", "calibrate_from_log", "LogCalibration", "LogError", "step_batch", "observations",
           "write_preset", "preset_document", "format_log_calibration", "what_if", "DEFAULT_KNOBS", "STAGE_KEYS"]
