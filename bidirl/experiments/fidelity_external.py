"""Predictions checked against a real system's published per-step measurements (paper §7.4's question, asked of
a system outside bidirl).

A *row file* (``data/fidelity/<name>.yaml``) holds published measurements of real RL jobs — step time and its
breakdown (``gen``, ``old_log_prob``, ``update_actor``, veRL's timing names) — each with the job settings that
produced it, written as bidirl config keys, and its source. Exactly one row per model × hardware has
``role: calibrate``; every other row has ``role: predict``.

:func:`fit` reads the calibrating row only: it solves for three knobs of the hardware preset (:data:`FIT_KNOBS`:
``train_mfu`` with ``controller_data_rate`` from the row's two trainer stages, ``scheduler_overhead`` from its
``gen``) so that the simulator reproduces that row. :func:`evaluate` then simulates every row with the fitted preset and sets the predicted numbers beside
the published ones; predicted rows are never read before the fit is done. The fit receives the rows *sealed*
(:meth:`PublishedRow.sealed`): reading a predicted row's published numbers during the fit raises
:class:`SealedRowError`, which is how ``tests/test_fidelity_external.py`` checks that the fit reads only the
calibrating row.

A row may also publish its run's cumulative wall time at regular step counts (``total_time``, the source's "total
time" columns). Their differences are the run's mean step time per interval (:meth:`PublishedRow.interval_step_times`),
which shows whether the row is one operating point. The stage models describe a stationary job (one response-length
distribution for every step), so the calibrating row must be one: :func:`check_calibrating` refuses a calibrating row
whose interval step times spread beyond :data:`STEADY_BOUND` of their mean.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Optional

import yaml

from bidirl.errors import BidirlError
from bidirl.job import config as cfgmod
from bidirl.job import presets

ROLES = ("calibrate", "predict")
METRICS = ("step", "gen", "old_log_prob", "update_actor")
#: knob search bounds: efficiency factors are fractions of peak (bidirl.perf.params.check_knob); the per-iteration
#: overhead between 0.1 ms and 50 ms (a CUDA-graphed decode step's launch cost to ten times a slow Python step); the
#: driver's data path between 10 MB/s (a pure-Python serialiser) and 100 GB/s (above a 400 Gb/s NIC's 50 GB/s
#: and a host memory copy)
KNOB_BOUNDS = {"train_mfu": (0.02, 1.0), "scheduler_overhead": (1e-4, 5e-2), "controller_data_rate": (1e7, 1e11)}
#: simulated steps per row (full run / --quick); the first async steps fill the pipeline and are outside the
#: summary's measured window
STEPS = {"colocated": (8, 2), "async": (16, 6)}
#: the most a calibrating row's interval step times may depart from their mean (fraction). Half of the benchmark's
#: 20 % per-row tolerance (issue 37's "median step-time error <= 20 %"), so that the drift of the one operating
#: point the fit reproduces cannot by itself use up more than half of the error any prediction is allowed.
STEADY_BOUND = 0.10
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?$")


class FidelityDataError(BidirlError, ValueError):
    """A malformed row file: ``field`` names what is wrong, ``fix`` what to do."""

    def __init__(self, field_name: str, message: str, fix: str = ""):
        self.field, self.fix = field_name, fix
        super().__init__(f"{field_name}: {message}" + (f" ({fix})" if fix else ""))


class SealedRowError(BidirlError, RuntimeError):
    """A predicted row's published numbers were read where only calibrating rows may be (the fit)."""


@dataclass(frozen=True)
class PublishedRow:
    """One published measurement and the settings of the job that produced it."""
    id: str
    system: str
    policy: str
    role: str
    overrides: Mapping
    averaged_steps: Optional[int]
    _published: Mapping = field(repr=False)
    _sealed: bool = field(default=False, repr=False)
    _total_time: tuple = field(default=(), repr=False)

    @property
    def calibrating(self) -> bool:
        return self.role == "calibrate"

    def has(self, metric: str) -> bool:
        """Whether the source publishes ``metric`` for this row (not a number: allowed on a sealed row)."""
        return metric in self._published

    def published(self, metric: str) -> float:
        """The published value of ``metric`` (seconds); raises :class:`SealedRowError` on a sealed row."""
        if self._sealed:
            raise SealedRowError(f"row {self.id!r} is a predicted row: its published {metric!r} may not be read "
                                 "while fitting (only the calibrating row may)")
        if metric not in self._published:
            raise KeyError(f"row {self.id!r} publishes no {metric!r}")
        return float(self._published[metric])

    def interval_step_times(self) -> tuple:
        """The run's mean step time (seconds) in each interval between two published cumulative times (the first
        interval starts at step 0); ``()`` when the source gives none. Raises :class:`SealedRowError` on a sealed
        row, like :meth:`published`."""
        if self._sealed:
            raise SealedRowError(f"row {self.id!r} is a predicted row: its published total_time may not be read "
                                 "while fitting (only the calibrating row may)")
        out, prev_step, prev_s = [], 0, 0.0
        for step, seconds in self._total_time:
            out.append((seconds - prev_s) / (step - prev_step))
            prev_step, prev_s = step, seconds
        return tuple(out)

    def drift(self) -> Optional[float]:
        """The largest departure of :meth:`interval_step_times` from their mean (fraction); None without two
        intervals."""
        times = self.interval_step_times()
        if len(times) < 2:
            return None
        mean = statistics.fmean(times)
        return max(abs(t / mean - 1.0) for t in times)

    def sealed(self) -> "PublishedRow":
        """This row with its published numbers locked (what :func:`fit` sees of a predicted row)."""
        return dataclasses.replace(self, _sealed=True)


@dataclass(frozen=True)
class FidelitySet:
    """A row file: the model and hardware presets, the settings shared by all rows, and the rows."""
    path: Path
    source: str
    model: str
    hardware: str
    common: Mapping
    systems: Mapping
    rows: tuple
    speedups: tuple

    def row(self, row_id: str) -> PublishedRow:
        for r in self.rows:
            if r.id == row_id:
                return r
        raise KeyError(f"no row {row_id!r} in {self.path.name}")

    def calibrated_on(self, row_id: str) -> "FidelitySet":
        """This set with ``row_id`` as its calibrating row and every other row predicted (which row calibrates is a
        choice; :func:`check_calibrating` refuses a row that is not one operating point)."""
        check_calibrating(self.row(row_id), f"rows[{row_id}]")
        rows = tuple(dataclasses.replace(r, role="calibrate" if r.id == row_id else "predict") for r in self.rows)
        return dataclasses.replace(self, rows=rows)

    def for_fit(self) -> tuple:
        """The rows as :func:`fit` receives them: calibrating rows open, predicted rows sealed."""
        return tuple(r if r.calibrating else r.sealed() for r in self.rows)

    def config(self, row: PublishedRow, hardware: Optional[str] = None, steps: int = 4,
               seed: int = 0) -> cfgmod.JobConfig:
        """The bidirl job config of ``row`` (``hardware``: a preset name or file replacing the set's)."""
        data = {"model": self.model, "hardware": hardware or self.hardware, "seed": int(seed),
                "scheduler": {"policy": "no-borrow"}, "workload": {"steps": int(steps)}}
        cfg = cfgmod.from_dict(data)
        overrides = {**self.common, **self.systems[row.system]["overrides"], **row.overrides}
        try:
            return cfg.with_overrides(overrides)
        except cfgmod.ConfigError as exc:
            raise FidelityDataError(f"rows[{row.id}].overrides", str(exc),
                                    "the row's settings must be valid bidirl config keys") from None


def check_calibrating(row: PublishedRow, where: str) -> None:
    """Refuse (:class:`FidelityDataError`) a calibrating row that does not show it is one operating point: it must
    publish its run's cumulative times at two or more step counts (``total_time``), and its interval step times must
    stay within :data:`STEADY_BOUND` of their mean."""
    drift = row.drift()
    if drift is None:
        raise FidelityDataError(f"{where}.total_time", f"calibrating row {row.id!r} publishes fewer than two "
                                "interval times, so nothing shows it is one operating point",
                                "add the source's cumulative run times (total_time), or calibrate on a row that "
                                "publishes them")
    if drift > STEADY_BOUND:
        times = ", ".join(f"{t:.0f}" for t in row.interval_step_times())
        raise FidelityDataError(f"{where}.role", f"calibrating row {row.id!r} is not one operating point: its "
                                f"interval step times ({times} s) depart up to {100 * drift:.0f} % from their mean "
                                f"(bound {100 * STEADY_BOUND:.0f} %)",
                                "calibrate on a row whose run kept one step time (role: predict here)")


def _duration(text, where: str) -> float:
    m = _DURATION.match(str(text).replace(" ", ""))
    if not m or not any(m.groups()):
        raise FidelityDataError(where, f"cannot read {text!r} as a duration", "write it as the source does, e.g. "
                                "'1d3h43m', '13h44m'")
    d, h, mi = (int(g or 0) for g in m.groups())
    return 86400.0 * d + 3600.0 * h + 60.0 * mi


def _total_time(raw, where: str) -> tuple:
    """``total_time`` (cumulative run times after 100, 200, ... steps) as ((step, seconds), ...), increasing."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise FidelityDataError(where, "must be a list of cumulative run times after 100, 200, ... steps",
                                "e.g. total_time: [\"13h44m\", \"1d3h43m\"]")
    out, prev = [], 0.0
    for i, text in enumerate(raw):
        seconds = _duration(text, f"{where}[{i}]")
        if seconds <= prev:
            raise FidelityDataError(f"{where}[{i}]", f"{text!r} is not after the time before it",
                                    "cumulative times must increase")
        out.append((100 * (i + 1), seconds))
        prev = seconds
    return tuple(out)


def default_path() -> Path:
    return presets.data_dir() / "fidelity" / "verl_fully_async.yaml"


def _need(raw: Mapping, key: str, where: str):
    if key not in raw:
        raise FidelityDataError(f"{where}.{key}", "missing", f"add {key} to {where}")
    return raw[key]


def load(path: "str | Path | None" = None) -> FidelitySet:
    """Read and check a row file (:class:`FidelityDataError` naming the field on bad input)."""
    path = Path(path) if path is not None else default_path()
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise FidelityDataError(str(path), f"cannot be read ({exc})", "pass the path of a row file") from None
    if not isinstance(raw, dict):
        raise FidelityDataError(path.name, "must be a mapping", "see data/fidelity/verl_fully_async.yaml")
    systems = _need(raw, "systems", path.name)
    if not isinstance(systems, dict) or not systems:
        raise FidelityDataError("systems", "must map system names to {policy, overrides}")
    from bidirl.sim.baselines import BASELINES
    for name, sys_ in systems.items():
        pol = _need(sys_, "policy", f"systems.{name}")
        if pol not in BASELINES:
            raise FidelityDataError(f"systems.{name}.policy", f"unknown policy {pol!r}",
                                    f"use one of {', '.join(BASELINES)}")
    rows, seen = [], set()
    for i, r in enumerate(_need(raw, "rows", path.name) or []):
        where = f"rows[{i}]"
        rid = str(_need(r, "id", where))
        if rid in seen:
            raise FidelityDataError(f"{where}.id", f"{rid!r} appears twice", "give every row its own id")
        seen.add(rid)
        system = _need(r, "system", where)
        if system not in systems:
            raise FidelityDataError(f"{where}.system", f"unknown system {system!r}",
                                    f"use one of {', '.join(systems)}")
        role = r.get("role", "predict")
        if role not in ROLES:
            raise FidelityDataError(f"{where}.role", f"unknown role {role!r}", f"use one of {', '.join(ROLES)}")
        pub = _need(r, "published", where)
        if not isinstance(pub, dict) or "step" not in pub:
            raise FidelityDataError(f"{where}.published", "must give at least the step time",
                                    f"write published: {{step: seconds, ...}} with keys from {', '.join(METRICS)}")
        bad = [k for k, v in pub.items() if k not in METRICS or not isinstance(v, (int, float)) or v <= 0]
        if bad:
            raise FidelityDataError(f"{where}.published", f"bad entries {bad}",
                                    f"keys from {', '.join(METRICS)}, values in seconds > 0")
        rows.append(PublishedRow(rid, system, systems[system]["policy"], role, dict(r.get("overrides") or {}),
                                 r.get("averaged_steps"), dict(pub),
                                 _total_time=_total_time(r.get("total_time"), f"{where}.total_time")))
    calibrating = [r.id for r in rows if r.calibrating]
    if len(calibrating) != 1:
        raise FidelityDataError("rows.role", f"{len(calibrating)} calibrating rows ({calibrating}) for "
                                f"{raw.get('model')} on {raw.get('hardware')}",
                                "mark exactly one row per model and hardware role: calibrate")
    for i, r in enumerate(rows):
        if r.calibrating:
            check_calibrating(r, f"rows[{i}]")
    speedups = []
    for i, s in enumerate(raw.get("speedups") or []):
        for key in ("faster", "slower"):
            if _need(s, key, f"speedups[{i}]") not in seen:
                raise FidelityDataError(f"speedups[{i}].{key}", f"no row {s[key]!r}", "name a row id")
        speedups.append(dict(s))
    fs = FidelitySet(path, str(raw.get("source", "")), str(_need(raw, "model", path.name)),
                     str(_need(raw, "hardware", path.name)), dict(raw.get("common") or {}),
                     {k: {"policy": v["policy"], "overrides": dict(v.get("overrides") or {})}
                      for k, v in systems.items()}, tuple(rows), tuple(speedups))
    for r in fs.rows:
        fs.config(r)            # every row's settings are a valid job
    return fs


# --------------------------------------------------------------------------------------------------
# simulating a row
# --------------------------------------------------------------------------------------------------

def _kind(row: PublishedRow) -> str:
    from bidirl.sim.baselines import BASELINES
    return "colocated" if BASELINES[row.policy].colocated else "async"


def simulate_row(fs: FidelitySet, row: PublishedRow, hardware: Optional[str] = None, quick: bool = False,
                 seed: int = 0) -> dict:
    """The simulated step time and veRL-named breakdown of ``row`` (seconds, mean per measured step):
    ``step`` (median step time of the measured window), ``gen`` (time the trainer waited for its batch;
    colocated: generation plus the switches into and out of it), ``old_log_prob`` and ``update_actor`` (the
    trainer's chunk time of those stages with their offload copies and the driver's data path of their calls
    — spans with direction ``offload`` or ``dispatch`` —; the update with its optimizer steps), ``trainer_idle``."""
    from bidirl.sim import simulate
    steps = STEPS[_kind(row)][1 if quick else 0]
    cfg = fs.config(row, hardware, steps=steps, seed=seed)
    res = simulate(cfg, row.policy, steps=steps, seed=seed)
    summary = res.summary()
    lo, hi = summary["window"]
    spans = res.log.spans_df()
    steps_df = res.log.steps_df()
    kept = steps_df[(steps_df["start"] >= lo - 1e-9) & (steps_df["end"] <= hi + 1e-9)]
    n = max(1, len(kept))
    sp = spans[(spans["start"] >= lo - 1e-9) & (spans["end"] <= hi + 1e-9)]
    dur = sp["end"] - sp["start"]
    stage = sp["detail"].map(lambda d: d.get("stage") if isinstance(d, dict) else None)
    trainer = sp["role"].ne("primary") | sp["pool"].eq("trainer_pool")
    olp = float(dur[(sp["kind"] == "chunk") & (stage == "old_logprob")].sum()) / n
    switch = sp["kind"].isin(["switch_in", "switch_out"])
    offload = switch & sp["detail"].map(lambda d: isinstance(d, dict) and d.get("direction") in ("offload", "dispatch"))
    olp += float(dur[offload & (stage == "old_logprob")].sum()) / n
    upd = float(dur[((sp["kind"] == "chunk") & (stage == "actor_update")) | (sp["kind"] == "optimizer") & trainer
                    | offload & (stage == "actor_update")].sum()) / n
    switches = float(dur[switch & ~offload].sum()) / n
    gen = float(kept["wait"].mean()) if len(kept) else math.nan
    out = {"step": float(summary["timing_s/step"]), "gen": gen + (switches if _kind(row) == "colocated" else 0.0),
           "old_log_prob": olp, "update_actor": upd,
           "trainer_idle": summary.get("fully_async/trainer/idle_ratio")}
    return out


# --------------------------------------------------------------------------------------------------
# the fit: the calibrating row only
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fit:
    """The fitted knobs, the preset file holding them, and the calibrating row(s) they came from."""
    knobs: Mapping
    hardware_file: str
    rows: tuple
    at_bound: tuple


def _write_preset(base: presets.HardwareSpec, knobs: Mapping, folder: Path) -> str:
    data = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "name"}
    data.update({k: float(v) for k, v in knobs.items() if v is not None})
    data["sources"] = list(base.sources) + [f"{', '.join(knobs)} fitted to one published row "
                                            "(bidirl.experiments.fidelity_external.fit)"]
    for key in ("measured_switch_costs", "measured_weight_sync", "stage_params", "switch_model"):
        if not data.get(key):
            data.pop(key, None)
    tag = hashlib.sha1(repr(sorted(knobs.items())).encode()).hexdigest()[:12]
    path = folder / f"{base.name}-fitted-{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _solve(f, lo: float, hi: float) -> tuple:
    """Root of the increasing-or-decreasing ``f`` on [lo, hi] by scipy's brentq; the nearer bound when ``f`` keeps
    one sign there (``(x, at_bound)``)."""
    from scipy.optimize import brentq
    f_lo, f_hi = f(lo), f(hi)
    if f_lo == 0:
        return lo, False
    if f_lo * f_hi > 0:
        return (lo if abs(f_lo) < abs(f_hi) else hi), True
    return brentq(f, lo, hi, xtol=1e-4, rtol=1e-4, maxiter=40), False


#: the trainer stage whose worker-group call each published trainer figure times (veRL's timer names)
STAGE_OF_METRIC = {"old_log_prob": "old_logprob", "update_actor": "actor_update"}


def _solve_with_data_path(simulate, data_bytes: dict, targets: dict) -> tuple:
    """``train_mfu`` and ``controller_data_rate`` that reproduce ``targets``, the published seconds of the two
    trainer figures (log-prob ``l``, update ``u``).

    A figure's simulated time is its workers' time ``simulate(train_mfu)[m]`` (the data path not charged) plus
    ``data_bytes[m] / rate`` — the driver's data path of that stage's calls in a step (the job's bytes,
    :func:`bidirl.perf.controller_data.job_call_bytes`; the simulator charges exactly that, each span with its
    ±3 % jitter). Both figures are reproduced when ``(l − sim_l) / bytes_l = (u − sim_u) / bytes_u`` (one rate for
    both), a root in ``train_mfu`` found by scipy's brentq (log space, within :data:`KNOB_BOUNDS`); the rate is then
    ``bytes_l / (l − sim_l)``. Without a root in the bounds, ``train_mfu`` takes the bound whose best rate fits the
    two figures better (summed squared log ratios; the rate by a one-dimensional search, no simulation). Returns
    (knobs, names at a search bound)."""
    from scipy.optimize import brentq, minimize_scalar
    (m_l, t_l), (m_u, t_u) = targets.items()
    b_l, b_u = data_bytes[m_l], data_bytes[m_u]
    r_lo, r_hi = (math.log(b) for b in KNOB_BOUNDS["controller_data_rate"])
    m_lo, m_hi = (math.log(b) for b in KNOB_BOUNDS["train_mfu"])
    cache = {}

    def workers(log_mfu):
        key = round(float(log_mfu), 12)
        if key not in cache:
            cache[key] = simulate(math.exp(log_mfu))
        return cache[key]

    def gap(log_mfu):           # bytes-weighted difference of the two figures' leftover seconds
        sim = workers(log_mfu)
        return b_u * (t_l - sim[m_l]) - b_l * (t_u - sim[m_u])

    def best_log_rate(sim):
        loss = lambda z: sum(math.log((sim[m] + data_bytes[m] / math.exp(z)) / t) ** 2 for m, t in targets.items())
        res = minimize_scalar(loss, bounds=(r_lo, r_hi), method="bounded", options={"xatol": 1e-5})
        return float(res.x), float(res.fun)

    g_lo, g_hi = gap(m_lo), gap(m_hi)
    if g_lo * g_hi <= 0:
        log_mfu = brentq(gap, m_lo, m_hi, xtol=1e-5, rtol=1e-5, maxiter=40)
        left = t_l - workers(log_mfu)[m_l]
        log_rate = math.log(b_l / left) if left > 0 else best_log_rate(workers(log_mfu))[0]
    else:
        log_mfu = min((m_lo, m_hi), key=lambda z: best_log_rate(workers(z))[1])
        log_rate = best_log_rate(workers(log_mfu))[0]
    log_rate = min(max(log_rate, r_lo), r_hi)
    hit = tuple(n for n, z, a, b in (("train_mfu", log_mfu, m_lo, m_hi), ("controller_data_rate", log_rate, r_lo, r_hi))
                if min(z - a, b - z) < 1e-4)
    return {"train_mfu": math.exp(log_mfu), "controller_data_rate": math.exp(log_rate)}, hit


@dataclass(frozen=True)
class _Trial:
    """The calibrating ``row`` simulated with trial knobs on the ``base`` preset (what every knob group's solver
    reads; presets are written to ``folder``)."""
    fs: FidelitySet
    row: PublishedRow
    base: presets.HardwareSpec
    folder: Path
    quick: bool

    def simulate(self, knobs: Mapping) -> dict:
        return simulate_row(self.fs, self.row, _write_preset(self.base, knobs, self.folder), quick=self.quick)


def _fit_one_knob(trial: _Trial, group: tuple, metrics: tuple, knobs: Mapping) -> tuple:
    """A one-knob group by scipy's brentq on the log ratio of simulated to published seconds (summed over
    ``metrics``), the other knobs held. Returns (fitted knobs, names at a search bound)."""
    (knob,) = group
    target = sum(trial.row.published(m) for m in metrics)

    def err(x):
        sim = trial.simulate({**knobs, knob: x})
        return math.log(sum(sim[m] for m in metrics) / target)

    value, hit = _solve(err, *KNOB_BOUNDS[knob])
    return {knob: value}, [knob] if hit else []


def _fit_mfu_and_data_rate(trial: _Trial, group: tuple, metrics: tuple, knobs: Mapping) -> tuple:
    """``train_mfu`` with the driver's data-path rate by :func:`_solve_with_data_path` on the two trainer figures
    (the simulated workers' seconds without the data path; the data path's bytes of the job), the other knobs held.
    Returns (fitted knobs, names at a search bound)."""
    from bidirl.perf.controller_data import job_call_bytes
    cfg = trial.fs.config(trial.row)
    samples = cfg.workload.prompts_per_step * cfg.workload.group_size
    data_bytes = {m: job_call_bytes(STAGE_OF_METRIC[m], samples, cfg) for m in metrics}

    def workers(mfu):
        sim = trial.simulate({**knobs, "train_mfu": mfu, "controller_data_rate": None})
        return {m: sim[m] for m in metrics}

    found, hit = _solve_with_data_path(workers, data_bytes, {m: trial.row.published(m) for m in metrics})
    return found, list(hit)


class KnobGroup(NamedTuple):
    """A group of :data:`FIT_KNOBS`: the calibrating row's published figures it must reproduce, and its solver
    (``solver(trial, group, metrics, knobs) -> (fitted knobs, names at a search bound)``)."""
    metrics: tuple
    solver: Callable


#: knobs the fit solves for, in this order, each group from the published figure(s) of the calibrating row it must
#: reproduce, by the solver it names: the trainer's achieved FLOP share and the rate of the single controller's data
#: path (:mod:`bidirl.perf.controller_data`) together from its two trainer stages — a stage's time is the driver's
#: data path of its call (bytes of the padded batch, the same at any GPU count) plus its workers' compute (in
#: proportion to 1 / train_mfu), and the two stages weigh them differently (the update computes about four times
#: the log-prob's FLOPs and moves about 1.3 times its bytes), so the pair pins both; then the rollout engine's fixed
#: cost per decode iteration (scheduling, sampling, output handling) from the generation time — the term that sets a
#: long response's per-token latency once the batch has drained, which is what a step's generation waits for
FIT_KNOBS = {
    ("train_mfu", "controller_data_rate"): KnobGroup(("old_log_prob", "update_actor"), _fit_mfu_and_data_rate),
    ("scheduler_overhead",): KnobGroup(("gen",), _fit_one_knob),
}


def fit(fs: FidelitySet, rows, folder: "str | Path", quick: bool = False) -> Fit:
    """Solve :data:`FIT_KNOBS` so the simulator reproduces the calibrating row's trainer stages and generation time,
    each group by the solver it names, in order, the other knobs held (a group whose figures the row does not
    publish keeps the preset's knobs). ``rows`` are :meth:`FidelitySet.for_fit`'s: a predicted row's published
    numbers are sealed and reading one raises :class:`SealedRowError`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    calibrating = [r for r in rows if r.calibrating]
    if len(calibrating) != 1:
        raise FidelityDataError("rows.role", f"{len(calibrating)} calibrating rows", "mark exactly one")
    row = calibrating[0]
    check_calibrating(row, f"rows[{row.id}]")
    base = presets.hardware(fs.hardware)
    knobs = {k: getattr(base, k) for group in FIT_KNOBS for k in group}
    trial = _Trial(fs, row, base, folder, quick)
    bounds = []
    for group, (metrics, solver) in FIT_KNOBS.items():
        if not all(row.has(m) for m in metrics):
            continue
        found, hit = solver(trial, group, metrics, knobs)
        knobs.update(found)
        bounds += hit
    return Fit(dict(knobs), _write_preset(base, knobs, folder), (row.id,), tuple(bounds))


# --------------------------------------------------------------------------------------------------
# the evaluation
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Evaluation:
    fit: Fit
    table: list            # one dict per row: id, role, published and predicted metrics, step error
    speedups: list         # one dict per published pair
    median_error: float    # |error| of the predicted rows' step times, %
    worst_error: float


def evaluate(fs: Optional[FidelitySet] = None, quick: bool = False) -> Evaluation:
    """Fit on the calibrating row, then predict every row (module doc)."""
    fs = fs or load()
    with tempfile.TemporaryDirectory(prefix="bidirl-fidelity-") as tmp:
        fitted = fit(fs, fs.for_fit(), tmp, quick=quick)
        table = []
        for row in fs.rows:          # the fit is done: the published numbers may now be read
            sim = simulate_row(fs, row, fitted.hardware_file, quick=quick)
            pub_step = row.published("step")
            entry = {"id": row.id, "system": row.system, "role": row.role, "averaged_steps": row.averaged_steps,
                     "interval_step_times": row.interval_step_times(), "drift": row.drift(),
                     "error_pct": 100.0 * (sim["step"] - pub_step) / pub_step,
                     "trainer_idle": sim["trainer_idle"]}
            for m in METRICS:
                entry[f"published_{m}"] = row.published(m) if row.has(m) else None
                entry[f"predicted_{m}"] = sim[m]
            table.append(entry)
    by_id = {e["id"]: e for e in table}
    speedups = []
    for s in fs.speedups:
        f, sl = by_id[s["faster"]], by_id[s["slower"]]
        pub = sl["published_step"] / f["published_step"]
        pred = sl["predicted_step"] / f["predicted_step"]
        first = [fs.row(s[k]).interval_step_times() for k in ("slower", "faster")]
        pub_first = first[0][0] / first[1][0] if all(first) else None
        speedups.append({**s, "published": pub, "predicted": pred, "error_pct": 100.0 * (pred - pub) / pub,
                         "published_first_interval": pub_first,
                         "checked": pub > 1.2, "reproduced": pred > 1.0 and abs(pred - pub) / pub <= 0.2})
    errors = [abs(e["error_pct"]) for e in table if e["role"] == "predict"]
    return Evaluation(fitted, table, speedups, statistics.median(errors), max(errors))
