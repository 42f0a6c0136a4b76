"""A veRL step log as a coarse timeline: per step, each pool's stage times laid end to end.

The log (the formats ``bidirl calibrate --log`` reads: :func:`bidirl.calibrate.step_log.read_step_log`) has one
row of metrics per step, so the timeline it gives has no per-GPU detail — one lane per pool and role, and the
stages where the trainer's loop runs them (every figure says so):

* step ``k`` lasts ``timing_s/step`` and starts where step ``k − 1`` ended (the first at 0);
* **synchronous trainer** (no ``fully_async/*/idle_ratio``; veRL's ``RayPPOTrainer``, colocated): every second
  of the step in a named category (:mod:`bidirl.ingest.step_breakdown`: generation, the colocated switch, each
  training stage, weight sync, validation, checkpointing, driver CPU, then idle), kept as the run's
  ``breakdown``; the GPU work is drawn in the loop's order on one lane (bidirl's colocated convention: one rollout
  pool holding every GPU, training as auxiliary work; the switch as ``switch_in``, the untimed rest of ``gen`` as
  ``switch_out``, validation as ``generate``), driver CPU and idle as gaps. The GPU count is the job's
  ``trainer.n_gpus_per_node × trainer.nnodes`` where the log prints its config, else 1 (said in the notes);
* **asynchronous trainer** (veRL's fully-async recipe, bidirl): the rollout pool is busy
  ``(1 − fully_async/rollouter/idle_ratio) · timing_s/step`` from the step's start (where in the step it ran is not
  logged); the trainer's stages and ``timing_s/param_sync`` run back to back and end at the step's end (it waits
  for the batch first).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from bidirl.calibrate.step_log import GEN_KEY, ROLLOUT_IDLE_KEY, STAGE_KEYS, STEP_TIME_KEY, job_gpus, read_step_log
from bidirl.ingest import step_breakdown as sb
from bidirl.core.protocol import AUXILIARY, PRIMARY, ROLLOUT_POOL, TRAINER_POOL, StepRecord
from bidirl.ingest.errors import TraceFormatError
from bidirl.ingest.run import ImportedRun
from bidirl.results.trace import EventLog, Span

SYNC_KEY = "timing_s/param_sync"
#: what a synchronous step log was recorded under
SYNC_POLICY = "veRL RayPPOTrainer (synchronous; colocated hybrid engine)"
#: what an asynchronous step log was recorded under
ASYNC_POLICY = "an asynchronous trainer (veRL fully-async or bidirl; the log does not say which policy)"
TOKENS_KEY, SAMPLES_KEY = "perf/total_num_tokens", "bidirl/samples"
#: the trainer stages in the order veRL's loop runs them
STAGE_ORDER = ("old_logprob", "ref_logprob", "actor_update")
COARSE_NOTE = ("coarse timeline from a step log: per-step stage times laid end to end on one lane per pool and "
               "role — no per-GPU detail, and where in a step each stage ran is the trainer loop's order, not "
               "measured")


def _value(frame, key: str, i: int, name: str) -> float:
    if key not in frame.columns:
        return 0.0
    v = frame[key].iloc[i]
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise TraceFormatError(f"{name}, row {i}", f"{key!r} is {v!r}, not a number of seconds",
                               "log numbers (seconds) for timing keys") from None
    if math.isnan(x):
        return 0.0
    if x < 0 or not math.isfinite(x):
        raise TraceFormatError(f"{name}, row {i}", f"{key!r} is {x!r}", "stage times are finite seconds >= 0")
    return x


def import_step_log(path) -> ImportedRun:
    """The coarse timeline of a step log (module doc). Raises ``TraceFormatError``/``LogError`` naming the row."""
    frame = read_step_log(path)
    name = Path(str(path)).name
    if ROLLOUT_IDLE_KEY not in frame.columns:
        return _synchronous(frame, path, name)
    if STEP_TIME_KEY not in frame.columns:
        raise TraceFormatError(name, f"no {STEP_TIME_KEY!r} column: a step's time is needed to lay out its stages",
                               "log timing_s/step (veRL does by default)")
    asynchronous = ROLLOUT_IDLE_KEY in frame.columns
    gen_lane = f"{ROLLOUT_POOL}/rollouter/0"
    train_pool, train_role = (TRAINER_POOL, PRIMARY) if asynchronous else (ROLLOUT_POOL, AUXILIARY)
    train_lane = f"{train_pool}/trainer/0"
    spans, steps, t = [], [], 0.0
    for i in range(len(frame)):
        step_s = _value(frame, STEP_TIME_KEY, i, name)
        start, end = t, t + step_s
        stages = [(s, _value(frame, STAGE_KEYS[s], i, name)) for s in STAGE_ORDER]
        sync = _value(frame, SYNC_KEY, i, name)
        if asynchronous:
            idle = _value(frame, ROLLOUT_IDLE_KEY, i, name)
            if idle > 1:
                raise TraceFormatError(f"{name}, row {i}", f"{ROLLOUT_IDLE_KEY!r} is {idle}, above 1",
                                       "an idle ratio lies in [0, 1]")
            gen = (1.0 - idle) * step_s
            cursor = end - sum(d for _, d in stages) - sync
        else:
            gen = _value(frame, GEN_KEY, i, name)
            cursor = start + gen
        need = (gen if asynchronous else gen + sum(d for _, d in stages) + sync)
        if need > step_s * (1 + 1e-9) + 1e-9 or cursor < start - 1e-9:
            raise TraceFormatError(f"{name}, row {i}", f"the stage times add up to more than {STEP_TIME_KEY} "
                                   f"({step_s:.6g} s)", "check that the timing keys are seconds of this step")
        if gen > 0:
            spans.append(Span(gen_lane, ROLLOUT_POOL, PRIMARY, "generate", start, start + gen, i, i,
                              {"name": GEN_KEY if not asynchronous else f"(1 − {ROLLOUT_IDLE_KEY})·{STEP_TIME_KEY}"}))
        first_train = None
        for stage, d in stages:
            if d > 0:
                first_train = cursor if first_train is None else first_train
                spans.append(Span(train_lane, train_pool, train_role, "chunk", cursor, cursor + d, i, i,
                                  {"name": STAGE_KEYS[stage], "stage": stage}))
                cursor += d
        if sync > 0:
            spans.append(Span(train_lane, train_pool, train_role, "sync", cursor, cursor + sync, i, i,
                              {"name": SYNC_KEY}))
        first_train = end if first_train is None else first_train
        steps.append(StepRecord(step=i, start=start, end=end, tokens=int(_value(frame, TOKENS_KEY, i, name)),
                                samples=int(_value(frame, SAMPLES_KEY, i, name)), wait=first_train - start,
                                consume=end - first_train, version=i + 1))
        t = end
    pool_gpus = {ROLLOUT_POOL: 1.0, TRAINER_POOL: 1.0 if asynchronous else 0.0}
    lanes = sorted({s.worker for s in spans})
    notes = [COARSE_NOTE, "GPU counts are not in a step log: each pool counts as 1 GPU, so idle is in seconds"]
    if asynchronous:
        notes.append(f"the rollout pool's busy time per step is (1 − {ROLLOUT_IDLE_KEY})·{STEP_TIME_KEY}, drawn "
                     "from the step's start")
    workers = pd.DataFrame({"worker": lanes, "source": lanes, "name": lanes,
                            "label": [w.split("/")[1] for w in lanes], "pool": [w.split("/")[0] for w in lanes],
                            "gpus": [1.0] * len(lanes)})
    return ImportedRun(log=EventLog(spans=spans, steps=steps), source=str(path), format="verl-log",
                       map_name="(step-log keys)", pool_gpus=pool_gpus, gpus_per_worker={w: 1.0 for w in lanes},
                       workers=workers, origin_s=0.0, resolution_s=_resolution(frame), coarse=True,
                       colocated=not asynchronous, notes=notes, policy=ASYNC_POLICY)


#: how each category of a synchronous step is drawn: (span kind, stage) — None: not GPU work, no span
DRAWN: dict = {sb.SWITCH: ("switch_in", None), sb.GENERATION: ("generate", None), sb.GEN_REST: ("switch_out", None),
               **{c: ("chunk", s) for c, s in zip(sb.TRAINING.values(), ("old_logprob", "ref_logprob", "old_logprob",
                                                                          "actor_update", "actor_update"))},
               sb.SYNC: ("sync", None), sb.VALIDATION: ("generate", None), sb.CHECKPOINT: ("sync", None),
               sb.OTHER: ("chunk", "other"), sb.DRIVER: None, sb.IDLE: None}


def _synchronous(frame: pd.DataFrame, path, name: str) -> ImportedRun:
    """A synchronous (colocated) trainer's step log: the categories of every step and a lane drawing them."""
    table, notes = sb.breakdown(frame, name)
    gpus, where = job_gpus(path)
    lane = f"{ROLLOUT_POOL}/trainer/0"
    spans, steps, t = [], [], 0.0
    for i, rec in enumerate(table.to_dict("records")):
        start = cursor = t
        step = int(rec["step"])
        first_train = None
        for category in sb.CATEGORIES:
            d = float(rec[category])
            if d <= 0:
                continue
            drawn = DRAWN[category]
            if drawn is not None:
                kind, stage = drawn
                detail = {"name": category, **({"stage": stage} if stage else {})}
                if kind == "chunk" and first_train is None:
                    first_train = cursor
                spans.append(Span(lane, ROLLOUT_POOL, AUXILIARY if kind == "chunk" else PRIMARY, kind, cursor,
                                  cursor + d, step, step, detail))
            cursor += d
        end = start + float(rec["step_s"])
        first_train = end if first_train is None else first_train
        steps.append(StepRecord(step=step, start=start, end=end, tokens=int(_row_value(frame, TOKENS_KEY, i)),
                                samples=0, wait=first_train - start, consume=end - first_train, version=step + 1))
        t = end
    table = table.assign(start=[s.start for s in steps], end=[s.end for s in steps])
    notes = list(frame.attrs.get("notes", [])) + notes
    notes.append(f"{gpus:g} GPUs: trainer.n_gpus_per_node × trainer.nnodes as the log prints them ({where})"
                 if where else "the log prints no trainer.n_gpus_per_node / trainer.nnodes: counted as 1 GPU, so "
                 "GPU-seconds are seconds")
    notes.append(f"GPU-weighted idle = the steps' {' + '.join(sb.GPU_IDLE)} over their time (a colocated trainer "
                 "runs every stage on every GPU)")
    workers = pd.DataFrame({"worker": [lane], "source": [lane], "name": [lane], "label": ["trainer"],
                            "pool": [ROLLOUT_POOL], "gpus": [gpus]})
    return ImportedRun(log=EventLog(spans=spans, steps=steps), source=str(path), format="verl-log",
                       map_name="(step-log keys)", pool_gpus={ROLLOUT_POOL: gpus, TRAINER_POOL: 0.0},
                       gpus_per_worker={lane: gpus}, workers=workers, origin_s=0.0,
                       resolution_s=_resolution(table.rename(columns={"step_s": STEP_TIME_KEY})), coarse=True,
                       colocated=True, notes=notes, breakdown=table, gpu_idle_categories=sb.GPU_IDLE,
                       validation_rows=list(frame.attrs.get("validation_rows", [])), policy=SYNC_POLICY)


def _row_value(frame: pd.DataFrame, key: str, i: int) -> float:
    if key not in frame.columns:
        return 0.0
    v = frame[key].iloc[i]
    return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _resolution(frame) -> float:
    """The log's time resolution: the coarsest of 0.1 s … 1 µs of which every step time is a whole multiple."""
    x = frame[STEP_TIME_KEY].to_numpy(dtype=np.float64)
    for r in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5):
        if np.all(np.abs(x / r - np.round(x / r)) <= 1e-6):
            return r
    return 1e-6
