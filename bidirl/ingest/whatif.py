"""The what-if of an imported run: calibrate the stage-time models from it, then simulate the job under
no-borrow (or veRL's colocated trainer) and BiDiRL at the planner's split, beside what was measured.

The fit and the simulations are :mod:`bidirl.calibrate.from_log`'s (``calibrate_from_log``, ``what_if``), which
read a per-step log with veRL's keys. A step-log import is such a log already; a timeline is turned into one
(:func:`step_log_of`): per step ``timing_s/step`` (the step's time), ``timing_s/gen`` (union of its generation
spans; a synchronous trainer waits for all of it) or, for a disaggregated run, ``fully_async/rollouter/idle_ratio``
(the rollout pool's union-based idle share of the step), and ``timing_s/old_log_prob`` / ``timing_s/ref`` /
``timing_s/update_actor`` (union of that stage's chunk spans). A timeline has no response lengths: they come from
the job config's workload model (``response_length/mean`` and ``/max`` of that step's batch), said in the notes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from bidirl.calibrate import from_log, step_log
from bidirl.core.protocol import ROLLOUT_POOL
from bidirl.ingest.run import ImportedRun
from bidirl.job import config as cfgmod
from bidirl.results import metrics
from bidirl.results.metrics import union_length

LENGTHS_NOTE = ("a timeline has no response lengths: each step's mean and longest response are the job config's "
                "workload model's")


def step_log_of(run: ImportedRun, config) -> pd.DataFrame:
    """The per-step log (veRL's keys) of an imported timeline (module doc)."""
    from bidirl.perf.workload import GroupLengths
    cfg = cfgmod.load(config)
    spans = run.log.spans_df()
    steps = run.log.steps_df().sort_values("step", kind="stable")
    lengths = GroupLengths.of(cfg, cfg.seed)
    w = cfg.workload
    stage = spans["detail"].map(lambda d: d.get("stage", "") if isinstance(d, dict) else "")
    rows = []
    for r in steps.itertuples(index=False):
        a, b = float(r.start), float(r.end)
        inside = spans[(spans["start"] < b) & (spans["end"] > a)]
        row = {"training/global_step": int(r.step) + 1, step_log.STEP_TIME_KEY: b - a}
        gen = inside[inside["kind"] == "generate"]
        if run.colocated:
            row[step_log.GEN_KEY] = union_length(gen["start"], gen["end"], a, b)
        else:
            row[step_log.ROLLOUT_IDLE_KEY] = metrics.idle(inside, ROLLOUT_POOL, a, b) / (b - a) if b > a else 0.0
        for name, key in step_log.STAGE_KEYS.items():
            part = inside[stage.loc[inside.index] == name]
            if len(part):
                row[key] = union_length(part["start"], part["end"], a, b)
        responses = np.concatenate([lengths(int(r.step) * w.prompts_per_step + g)[1] for g in range(w.prompts_per_step)])
        prompts = [lengths(int(r.step) * w.prompts_per_step + g)[0] for g in range(w.prompts_per_step)]
        row["response_length/mean"] = float(np.mean(responses))
        row["response_length/max"] = float(np.max(responses))
        row[step_log.PROMPT_MEAN_KEY] = float(np.mean(prompts))
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame.attrs["path"] = run.source
    return frame


def imported_what_if(run: ImportedRun, config, *, steps: Optional[int] = None, seed: Optional[int] = None,
                     skip: int = 1, preset_path=None) -> dict:
    """Fit the job's preset to the imported run and simulate it (module doc). Returns ``calibration`` (the fit's
    summary), ``what_if`` (:func:`bidirl.calibrate.from_log.what_if`: simulated tokens/s, the planner's split,
    gains) and ``measured`` (the run's median step time, seconds), with ``notes``."""
    cfg = cfgmod.load(config)
    if run.format == "verl-log":
        frame, notes = step_log.read_step_log(run.source), []
    else:
        frame, notes = step_log_of(run, cfg), [LENGTHS_NOTE]
    cal = from_log.calibrate_from_log(frame, cfg, colocated=run.colocated, skip=min(skip, max(0, len(frame) - 2)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(preset_path) if preset_path is not None else Path(tmp) / "imported-run.yaml"
        from_log.write_preset(cal, path)
        outcome = from_log.what_if(cfg, path, steps=steps, seed=seed, colocated=run.colocated, log=frame)
    times = metrics.step_times(run.log)
    return {"calibration": cal.summary(), "what_if": outcome,
            "measured": {"median_step_s": float(np.median(times)) if len(times) else None,
                         "steps": int(len(times)),
                         "throughput": outcome.get("measured") or _measured_throughput(run, frame, cfg, skip)},
            "notes": notes + list(cal.notes)}


def _measured_throughput(run: ImportedRun, frame: pd.DataFrame, cfg, skip: int) -> Optional[float]:
    """Tokens per second of the measured steps after the first ``skip`` (warm-up): the steps' tokens when the
    source has them, else the job's batch (prompts × group size × (mean prompt + mean response) of each step,
    as :func:`step_log_of` sets them) over the measured step times."""
    times = metrics.step_times(run.log)[skip:]
    if not len(times) or times.sum() <= 0:
        return None
    tokens = run.log.steps_df().sort_values("step")["tokens"].to_numpy(dtype=float)[skip:]
    if not tokens.sum() and step_log.PROMPT_MEAN_KEY in frame.columns:
        w = cfg.workload
        per = w.prompts_per_step * w.group_size * (frame[step_log.PROMPT_MEAN_KEY] + frame["response_length/mean"])
        tokens = per.to_numpy(dtype=float)[skip:]
    return float(tokens.sum() / times.sum()) if tokens.sum() else None
