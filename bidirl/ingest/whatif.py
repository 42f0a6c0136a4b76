"""The what-if of an imported run: calibrate the stage-time models from it, then simulate the job under
no-borrow (or veRL's colocated trainer) and BiDiRL at the planner's split, beside what was measured.

The fit and the simulations are :mod:`bidirl.calibrate.from_log`'s (``calibrate_from_log``, ``what_if``), which
read a per-step log with veRL's keys. A step-log import is such a log already; a timeline is turned into one
(:func:`step_log_of`): per step ``timing_s/step`` (the step's time), ``timing_s/gen`` (union of its generation
spans; a synchronous trainer waits for all of it) or, for a disaggregated run, ``fully_async/rollouter/idle_ratio``
(the rollout pool's union-based idle share of the step), and ``timing_s/old_log_prob`` / ``timing_s/ref`` /
``timing_s/update_actor`` (union of that stage's chunk spans). A timeline has no response lengths: they come from
the job config's workload model (``response_length/mean`` and ``/max`` of that step's batch), said in the notes.

What the simulated trainer is (:func:`trainer_assumptions`, in the output as ``assumptions``): the job config's
trainer settings — ``rl.param_offload`` / ``rl.optimizer_offload``, ``rl.activation_checkpointing``, the
micro-batching (``rl.max_tokens_per_micro_batch`` or ``rl.micro_batch_per_device``), ``rl.sequence_parallel`` and
the rollout's tensor parallel (``cluster.rollout_tensor_parallel``, or the smallest layout that fits) — each with
the value the simulation runs under. From a colocated run the disaggregated trainer's time is not the colocated
trainer's, copied: the colocated stage times fit the stage-time models' knobs under these settings (taken to be the
run's), and the disaggregated trainer's stages are predicted by those models on its own GPUs, under the same
settings (paper §4, the stage-time models of the appendix).
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


def trainer_assumptions(cfg, *, colocated: bool, hardware=None) -> list:
    """What the what-if assumes about the trainer it simulates (module doc): one ``{"key", "value", "as_simulated"}``
    per job-settings key, the value the simulation runs under, then (``key`` ``basis``) where the trainer's time
    comes from. ``hardware``: the fitted preset (the rollout layout that fits depends on it)."""
    from bidirl.job.planner import min_feasible_layouts
    r = cfg.rl
    on_host = "copied host↔device around {} at the hardware preset's host_bandwidth"
    rows = [
        ("rl.param_offload", r.param_offload,
         on_host.format("each trainer stage") if r.param_offload else "parameters stay on the trainer GPUs"),
        ("rl.optimizer_offload", r.optimizer_offload,
         on_host.format("each optimizer step") if r.optimizer_offload else "optimizer state stays on the trainer GPUs"),
        ("rl.activation_checkpointing", r.activation_checkpointing,
         "blocks recomputed in the backward pass" if r.activation_checkpointing is True else
         "no recompute (not set: the stage-time model recomputes only when it is true)"
         if r.activation_checkpointing is None else "no recompute"),
    ]
    if r.max_tokens_per_micro_batch is not None:
        rows.append(("rl.max_tokens_per_micro_batch", r.max_tokens_per_micro_batch,
                     f"token-budget micro-batches: up to {r.max_tokens_per_micro_batch} tokens per device"))
    else:
        rows.append(("rl.micro_batch_per_device", r.micro_batch_per_device,
                     f"{r.micro_batch_per_device} samples per device per micro-batch"))
    rows.append(("rl.sequence_parallel", r.sequence_parallel,
                 "no sequence parallelism" if r.sequence_parallel == 1 else
                 f"Ulysses degree {r.sequence_parallel}: each sample over {r.sequence_parallel} GPUs"))
    tp = cfg.cluster.rollout_tensor_parallel
    if tp is None:
        tp_fit = min_feasible_layouts(cfg, hardware)[0]
        rows.append(("cluster.rollout_tensor_parallel", None,
                     f"not set: the smallest layout that fits, {tp_fit} GPU(s) per rollout replica"))
    else:
        rows.append(("cluster.rollout_tensor_parallel", tp, f"{tp} GPU(s) per rollout replica"))
    out = [{"key": k, "value": v, "as_simulated": text} for k, v, text in rows]
    if colocated:
        offload = (" The run's offload (set for a colocated trainer, whose GPUs also hold the engines) is kept; "
                   "a disaggregated trainer may not need it: set rl.param_offload / rl.optimizer_offload: false in "
                   "--config to simulate without") if r.param_offload or r.optimizer_offload else ""
        basis = ("the colocated trainer's stage times fit the stage-time models under these settings (taken to be "
                 "the run's); the disaggregated trainer's stages are predicted by those models on its own GPUs "
                 "under the same settings, not copied from the colocated run." + offload)
    else:
        basis = ("the run's trainer stage times fit the stage-time models under these settings (taken to be the "
                 "run's); each split's trainer is predicted by those models on its own GPUs")
    out.append({"key": "basis", "value": None, "as_simulated": basis})
    return out


def imported_what_if(run: ImportedRun, config, *, steps: Optional[int] = None, seed: Optional[int] = None,
                     skip: int = 1, preset_path=None) -> dict:
    """Fit the job's preset to the imported run and simulate it (module doc). Returns ``calibration`` (the fit's
    summary), ``what_if`` (:func:`bidirl.calibrate.from_log.what_if`: simulated tokens/s, the planner's split,
    gains), ``assumptions`` (:func:`trainer_assumptions`: the trainer settings it simulates under) and ``measured``
    (the run's median step time, seconds), with ``notes``."""
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
        fitted = cfg.with_overrides({"hardware": str(path.resolve())})
        assumptions = trainer_assumptions(fitted, colocated=run.colocated, hardware=fitted.hardware_spec)
    times = metrics.step_times(run.log)
    return {"calibration": cal.summary(), "what_if": outcome, "assumptions": assumptions,
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
