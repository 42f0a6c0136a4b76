"""Where every second of a synchronous veRL step went, from its step log: each logged stage in a named category, the
rest of the step (nothing logged) last — and which categories leave the GPUs idle.

veRL's ``RayPPOTrainer.fit`` times its loop with nested ``marked_timer`` blocks (``verl/trainer/ppo/ray_trainer.py``
at v0.4.1, commit 8d9e350, lines 979–1159): ``step`` holds ``gen`` (the batch's generation), ``reward``,
``old_log_prob``, ``ref``, ``values``, ``adv``, ``update_critic``, ``update_actor``, ``testing`` (validation, every
``test_freq`` steps) and ``save_checkpoint``; newer releases add ``update_weights`` after ``update_actor`` (commit
b178a3c, line 1610). Inside ``gen`` the colocated worker adds two keys of its own (``verl/workers/fsdp_workers.py``
at v0.4.1, line 664; ``verl/workers/sharding_manager/fsdp_vllm.py`` line 155): ``reshard`` (entering the rollout
sharding manager: vLLM wakes up and loads the actor's weights — the colocated switch and its weight sync) and
``generate_sequences`` (vLLM generating). Nested keys are counted once: ``gen`` is split into those two and the
untimed rest of ``gen`` (leaving the sharding manager — vLLM sleeps, the model goes back to training mode — the
TP all-gather of the data and Ray moving the batch to the driver).

=============================== ======================================================================= ===========
category                        keys (``timing_s/``; older logs' ``timing/`` read the same)             GPUs
=============================== ======================================================================= ===========
``generation``                  ``generate_sequences`` (``gen`` when the log has no nested keys)        busy
``colocated switch``            ``reshard`` (vLLM wake-up and weight load)                              busy
``rest of gen (untimed)``       ``gen − generate_sequences − reshard``                                  busy
``weight sync``                 ``update_weights``, ``param_sync``                                      busy
``old log-probs`` …             ``old_log_prob``, ``ref``, ``values``, ``update_critic``,               busy
                                ``update_actor``: one category per training stage
``validation``                  ``testing``                                                             busy
``checkpointing``               ``save_checkpoint``                                                     busy
``other logged stages``         any other ``timing_s/*`` key, named in the notes                        busy
``driver CPU``                  ``reward``, ``adv``, ``dump_rollout_generations`` (the driver process)  idle
``idle (no stage logged)``      ``step`` minus all of the above                                         idle
=============================== ======================================================================= ===========

The categories partition ``timing_s/step`` (they sum to it), so the GPU-weighted idle of a step is the share of
its time in the two idle categories: a colocated trainer runs every stage on every GPU, so in each category all
GPUs are busy or all idle. A checkpoint save holds the GPUs (FSDP gathers the sharded state on them). What a step
log cannot show: how many GPUs idle *within* a stage — the long tail of generation (replicas done early wait for
the longest response) and stragglers in training — which only a timeline (``ray timeline``) records. A log without
``timing_s/step`` (veRL before 2025) gets the breakdown of its logged stages, and says so.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import pandas as pd

from bidirl.calibrate.step_log import LogError

T = "timing_s/"
GENERATION, SWITCH, GEN_REST = "generation", "colocated switch", "rest of gen (untimed)"
SYNC, VALIDATION, CHECKPOINT = "weight sync", "validation", "checkpointing"
OTHER, DRIVER, IDLE = "other logged stages", "driver CPU", "idle (no stage logged)"
#: training stages: veRL key -> category
TRAINING: dict = {"old_log_prob": "old log-probs", "ref": "reference log-probs", "values": "critic values",
                  "update_critic": "critic update", "update_actor": "actor update"}
#: every category, in the loop's order, idle last (module doc)
CATEGORIES: tuple = (SWITCH, GENERATION, GEN_REST, *TRAINING.values(), SYNC, VALIDATION, CHECKPOINT, OTHER,
                     DRIVER, IDLE)
#: the categories in which no GPU works
GPU_IDLE: tuple = (DRIVER, IDLE)
#: the keys of each single-key category
KEYS: dict = {**{k: c for k, c in TRAINING.items()}, "update_weights": SYNC, "param_sync": SYNC,
              "testing": VALIDATION, "save_checkpoint": CHECKPOINT, "reward": DRIVER, "adv": DRIVER,
              "dump_rollout_generations": DRIVER}
#: keys inside ``gen`` (counted through it), the step itself, and keys timed outside the step
NESTED, STEP, OUTSIDE = ("generate_sequences", "reshard", "gen_max"), "step", ("start_profile", "stop_profile")
#: a console log rounds every time to 1 ms: each logged value is within 0.5 ms of the true one
ROUNDING_S = 0.0005


def _tolerance(n_values: int) -> float:
    """How far a sum of ``n_values`` rounded times may stray from the sum of the true times: n · 0.5 ms."""
    return n_values * ROUNDING_S


def step_categories(row: Mapping, where: str) -> tuple:
    """``({category: seconds}, step_s, other_keys)`` of one step's metrics (module doc). ``step_s`` is
    ``timing_s/step``, or the sum of the categories when the log has none. Raises :class:`LogError` naming
    ``where`` when the nested keys or the stages add up to more than their total."""
    t = {k[len(T):]: float(v) for k, v in row.items()
         if isinstance(k, str) and k.startswith(T) and v is not None and np.isfinite(float(v))}
    for key, v in t.items():
        if v < 0:
            raise LogError(f"{where}: {T}{key} is {v}, below 0 — stage times are seconds >= 0")
    out = dict.fromkeys(CATEGORIES, 0.0)
    if "gen" in t:
        inner = t.get("generate_sequences", 0.0) + t.get("reshard", 0.0)
        if "generate_sequences" in t:
            rest = t["gen"] - inner
            if rest < -_tolerance(3):
                raise LogError(f"{where}: {T}generate_sequences + {T}reshard ({inner:.3f} s) exceed {T}gen "
                               f"({t['gen']:.3f} s), which holds them — check the log's keys")
            out[GENERATION], out[SWITCH], out[GEN_REST] = t["generate_sequences"], t.get("reshard", 0.0), max(rest, 0.0)
        else:
            out[GENERATION] = t["gen"]
    other = sorted(k for k in t if k not in KEYS and k not in NESTED and k not in OUTSIDE
                   and k not in ("gen", STEP))
    for key, v in t.items():
        if key in KEYS:
            out[KEYS[key]] += v
    out[OTHER] = float(sum(t[k] for k in other))
    logged = sum(out.values())
    if STEP in t:
        step_s = t[STEP]
        n = sum(1 for k in t if k not in NESTED and k not in OUTSIDE)
        if logged > step_s + _tolerance(n):
            raise LogError(f"{where}: the logged stages add up to {logged:.3f} s, more than {T}step ({step_s:.3f} s) "
                           f"by more than the log's rounding ({n} values × {ROUNDING_S * 1e3:g} ms) — check that the "
                           "timing keys are seconds of this step")
        out[IDLE] = max(step_s - logged, 0.0)
        # within the rounding the parts may exceed the step by a few ms: take it from the largest part
        excess = logged - step_s
        if excess > 0:
            big = max(CATEGORIES[:-1], key=lambda c: out[c])
            out[big] -= excess
    else:
        step_s = logged
    return out, step_s, other


def breakdown(frame: pd.DataFrame, name: str) -> tuple:
    """``(table, notes)``: one row per step of a synchronous step log (``step``, ``line`` where known, ``step_s``,
    then :data:`CATEGORIES` in seconds, summing to ``step_s``), and what the reader should know (module doc)."""
    lines = frame.attrs.get("lines")
    rows, others = [], set()
    for i in range(len(frame)):
        record = frame.iloc[i].to_dict()
        line = lines[i] if lines else None
        where = f"{name}, line {line}" if line else f"{name}, row {i}"
        parts, step_s, other = step_categories(record, where)
        others.update(other)
        step = record.get("training/global_step", record.get("step", i))
        rows.append({"step": int(step), "line": line, "step_s": step_s, **parts})
    table = pd.DataFrame(rows, columns=["step", "line", "step_s", *CATEGORIES])
    notes = []
    if f"{T}step" not in frame.columns:
        notes.append(f"no {T}step in this log (veRL before 2025): each step's time is the sum of its logged stages, "
                     "so nothing is left for idle between them")
    if others:
        notes.append(f"{OTHER}: " + ", ".join(T + k for k in sorted(others)) + " (counted as GPU work)")
    if f"{T}generate_sequences" not in frame.columns and f"{T}gen" in frame.columns:
        notes.append(f"no {T}generate_sequences / {T}reshard in this log: {GENERATION} is all of {T}gen, the "
                     "colocated switch inside it included")
    notes.append("a step log has no per-GPU detail: GPUs idling within a stage (the long tail of generation, "
                 "training stragglers) are not visible; a Ray timeline shows them")
    return table, notes


def gpu_idle_share(table: pd.DataFrame) -> Optional[float]:
    """The GPU-weighted idle share of the steps: their seconds in :data:`GPU_IDLE` over their time (every GPU of
    a colocated trainer is in the same category at once, so this is also GPU-seconds idle / available)."""
    total = float(table["step_s"].sum())
    return float(table[list(GPU_IDLE)].to_numpy().sum() / total) if total > 0 else None
