"""A veRL step log as a coarse timeline: per step, each pool's stage times laid end to end.

The log (the formats ``bidirl calibrate --log`` reads: :func:`bidirl.calibrate.step_log.read_step_log`) has one
row of metrics per step, so the timeline it gives has no per-GPU detail — one lane per pool and role, and the
stages where the trainer's loop runs them (every figure says so):

* step ``k`` lasts ``timing_s/step`` and starts where step ``k − 1`` ended (the first at 0);
* **synchronous trainer** (no ``fully_async/*/idle_ratio``; veRL's ``RayPPOTrainer``, colocated): generation
  ``timing_s/gen`` from the step's start, then ``timing_s/old_log_prob``, ``timing_s/ref`` and
  ``timing_s/update_actor`` back to back on the same GPUs (bidirl's colocated convention: one rollout pool,
  training as auxiliary work), then ``timing_s/param_sync`` if logged;
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

from bidirl.calibrate.step_log import GEN_KEY, ROLLOUT_IDLE_KEY, STAGE_KEYS, STEP_TIME_KEY, read_step_log
from bidirl.core.protocol import AUXILIARY, PRIMARY, ROLLOUT_POOL, TRAINER_POOL, StepRecord
from bidirl.ingest.errors import TraceFormatError
from bidirl.ingest.run import ImportedRun
from bidirl.results.trace import EventLog, Span

SYNC_KEY = "timing_s/param_sync"
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
                       colocated=not asynchronous, notes=notes)


def _resolution(frame) -> float:
    """The log's time resolution: the coarsest of 0.1 s … 1 µs of which every step time is a whole multiple."""
    x = frame[STEP_TIME_KEY].to_numpy(dtype=np.float64)
    for r in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5):
        if np.all(np.abs(x / r - np.round(x / r)) <= 1e-6):
            return r
    return 1e-6
