"""Reading a job's per-step metrics log: veRL's keys and formats, one row per step (what
:mod:`bidirl.calibrate.from_log` fits the stage-time models to).

**The log.** JSONL (one object per step, flat — bidirl's ``metrics.jsonl`` — or veRL's file logger
``{"step": N, "data": {...}}``), CSV with one column per key, or veRL's console lines
(``step:N - key:value - key:value``). Keys, as veRL names them:

=========================== ==============================================================================
``timing_s/update_actor``   the step's actor-update time (required)
``timing_s/old_log_prob``   old-policy log-prob recomputation, ``timing_s/ref`` the reference model's
                            (optional: fitted when present and the job config runs that stage)
``response_length/mean``    and ``response_length/max``: the step's response tokens (required)
``prompt_length/mean``      the step's prompt tokens (optional; default: the workload preset's mean)
``timing_s/gen``            generation time of the step's batch — for a **synchronous** trainer (veRL's
                            default ``RayPPOTrainer``), where the trainer waits for the whole batch
``fully_async/rollouter/idle_ratio`` with ``timing_s/step``: an asynchronous log (bidirl, veRL's fully-async
                            recipe); the rollout pool's busy time per step, ``(1 − idle_ratio)·timing_s/step``,
                            is one batch's generation time only when batches do not overlap (``rl.staleness:
                            0``); at s > 0 only the trainer is fitted and the calibration says so
=========================== ==============================================================================
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Union

import numpy as np
import pandas as pd

from bidirl.errors import BidirlError

#: trainer stage -> the veRL timing key of its per-step time
STAGE_KEYS = {"actor_update": "timing_s/update_actor", "old_logprob": "timing_s/old_log_prob",
              "ref_logprob": "timing_s/ref"}
REQUIRED_KEYS = ("timing_s/update_actor", "response_length/mean", "response_length/max")
GEN_KEY, STEP_TIME_KEY, ROLLOUT_IDLE_KEY = "timing_s/gen", "timing_s/step", "fully_async/rollouter/idle_ratio"
PROMPT_MEAN_KEY = "prompt_length/mean"
STEP_KEYS = ("training/global_step", "step")
_CONSOLE = re.compile(r"step:\s*(\d+)\s*-\s*(.*)")


class LogError(BidirlError, ValueError):
    """A step log that cannot be used: names the file, the row or key, and the fix."""


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------

def read_number(value, where: str) -> float:
    if isinstance(value, bool):
        raise LogError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        raise LogError(f"{where}: expected a number, got {value!r}") from None


def _jsonl_rows(path: Path) -> list:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LogError(f"{path.name}, line {n}: not JSON ({exc.msg}) — write one JSON object per line") from None
        if not isinstance(obj, dict):
            raise LogError(f"{path.name}, line {n}: expected a JSON object per step, got {type(obj).__name__}")
        if isinstance(obj.get("data"), dict) and "step" in obj:          # veRL's file logger
            obj = {"training/global_step": obj["step"], **obj["data"]}
        rows.append(obj)
    return rows


def _console_rows(path: Path) -> list:
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = _CONSOLE.search(line)
        if not m:
            continue
        row = {"training/global_step": int(m.group(1))}
        for item in m.group(2).split(" - "):
            key, sep, value = item.strip().rpartition(":")
            if sep and key:
                try:
                    row[key] = float(value)
                except ValueError:
                    continue                      # non-numeric entries (e.g. text) carry no timing
        rows.append(row)
    if not rows:
        raise LogError(f"{path.name}: no 'step:N - key:value - ...' lines (veRL's console format) found — pass "
                       "a .jsonl, .csv or a veRL console log")
    return rows


def read_step_log(path: Union[str, Path]) -> pd.DataFrame:
    """The per-step rows of a metrics log (module doc for the formats), ordered by step, one row per step.
    Raises :class:`LogError` naming the line or key and the fix."""
    path = Path(path)
    if not path.is_file():
        raise LogError(f"{path}: no such step log — pass the metrics.jsonl (or .csv / console log) of a run")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        frame = pd.DataFrame(_jsonl_rows(path))
    elif suffix == ".csv":
        try:
            frame = pd.read_csv(path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
            raise LogError(f"{path.name}: not a CSV table ({exc}) — one header row of metric names, one row per "
                           "step") from None
    else:
        frame = pd.DataFrame(_console_rows(path))
    if frame.empty:
        raise LogError(f"{path.name}: no steps in the log")
    key = next((k for k in STEP_KEYS if k in frame.columns), None)
    if key is not None:
        steps = [read_number(v, f"{path.name}: row {i}, {key}") for i, v in enumerate(frame[key])]
        if len(set(steps)) != len(steps):
            dup = next(s for s in steps if steps.count(s) > 1)
            raise LogError(f"{path.name}: step {dup:g} appears twice in {key!r} — keep one row per step (a resumed "
                           "run's log repeats steps: drop the rows before the resume point)")
        frame = frame.assign(_order=steps).sort_values("_order", kind="stable").drop(columns="_order")
    frame = frame.reset_index(drop=True)
    frame.attrs["path"] = str(path)
    return frame
