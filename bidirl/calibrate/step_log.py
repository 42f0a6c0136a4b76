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

**Console logs as they are** (veRL's ``console`` logger, one ``step:N - key:value - …`` line per step, between
everything else a job prints): ANSI colour codes and Ray's worker prefixes (``(TaskRunner pid=N)``,
``(main_task pid=N)``) are stripped; lines that are not metric lines (Hydra config dumps, tqdm bars, samples,
warnings) are skipped and counted. veRL's older key names (``timing/*``, before ``timing_s/*``) are read as the
newer ones. A **validation-only** line (no ``timing_s/*`` key: veRL prints the validation scores of step 0 before
training starts, and the final ones after the last step) is not a training step: it is kept apart in
``frame.attrs["validation_rows"]`` (a list of dicts, with the line number as ``_line``). A step logged twice (a run resumed from a checkpoint replays the steps after
it) keeps its **last** line, and ``frame.attrs["repeated_steps"]`` says which. A metric line cut short by the end
of the file (a run killed mid-write) is left out and ``frame.attrs["cut_line"]`` names it; a malformed metric line
anywhere else is an error naming its line number. ``frame.attrs["notes"]`` says each of these in words.
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
_CONSOLE = re.compile(r"^step:\s*(\d+)\s*(?:-\s*(.*))?$")
#: ANSI escape sequences (colours, cursor moves) as terminals and Ray's log forwarding write them
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
#: Ray's prefix on a line forwarded from a worker: ``(TaskRunner pid=678203)``, ``(main_task pid=1, ip=…)``
_RAY_PREFIX = re.compile(r"^\s*\([\w.:\-]+ pid=\d+(?:, ip=[\w.:\-]+)?\)\s?")
#: veRL's timing prefix before ``timing_s/`` (Dec 2024 and earlier): read as the newer name
OLD_TIMING_PREFIX, TIMING_PREFIX = "timing/", "timing_s/"


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


def console_text(line: str) -> str:
    """A console line (or a piece of one between carriage returns) without ANSI codes and without Ray's worker
    prefix (module doc)."""
    return _RAY_PREFIX.sub("", _ANSI.sub("", line), count=1).strip()


def _console_item(item: str, where: str) -> tuple:
    """``(key, value)`` of one ``key:value`` item; ``value`` is a float, or the text when it is not a number."""
    key, sep, value = item.strip().rpartition(":")
    if not sep or not key.strip():
        raise LogError(f"{where}: {item.strip()[:80]!r} is not a key:value pair"
                       + " — a veRL metric line is 'step:N - key:value - key:value - …'")
    key = key.strip()
    if key.startswith(OLD_TIMING_PREFIX):
        key = TIMING_PREFIX + key[len(OLD_TIMING_PREFIX):]
    try:
        return key, float(value)
    except ValueError:
        return key, value.strip()


def _console_rows(path: Path) -> tuple:
    """``(training rows, validation-only rows, notes, facts)`` of a console log (module doc)."""
    raw = path.read_bytes().decode("utf-8", errors="replace")       # no newline translation: \r stays
    # lines as editors and grep -n count them: split at newlines only (tqdm's carriage returns stay inside a line)
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    ends_cut = bool(raw) and not raw.endswith("\n")
    rows, validation, texts, skipped = [], [], {}, 0
    cut_line, notes_end = None, None
    for n, line in enumerate(lines, 1):
        # a progress bar redraws with carriage returns: the metric line may be any one of the pieces
        m = next((x for x in (_CONSOLE.match(console_text(piece)) for piece in line.split("\r")) if x), None)
        if not m:
            skipped += 1
            continue
        where = f"{path.name}, line {n}"
        last = n == len(lines) and ends_cut
        row = {"training/global_step": int(m.group(1)), "_line": n}
        try:
            for item in (m.group(2) or "").split(" - "):
                if item.strip():
                    key, value = _console_item(item, where)
                    if isinstance(value, str):
                        texts.setdefault(key, n)
                    else:
                        row[key] = value
        except LogError:
            if not last:
                raise
            cut_line = n                # the file ends inside this line: the run stopped while writing it
            break
        if last and rows and not set.intersection(*(set(r) for r in rows)) <= set(row):
            cut_line = n                # ends mid-line and lacks keys every metric line before had: cut short
            break
        if last:
            notes_end = (f"the file does not end with a newline; its last line ({n}) has every key that all metric "
                         "lines before it have, so it is read as complete")
        (rows if any(k.startswith(TIMING_PREFIX) for k in row) else validation).append(row)
    if not rows:
        raise LogError(f"{path.name}: no 'step:N - key:value - ...' lines with timing keys (veRL's console format) "
                       "found — pass a .jsonl, .csv or a veRL console log")
    notes = [f"{skipped} console lines that are not metric lines (config dumps, progress bars, samples, warnings) "
             "were skipped"]
    if texts:
        notes.append("non-numeric values (not read): " + ", ".join(f"{k} (first on line {n})" for k, n in texts.items()))
    if validation:
        notes.append(f"{len(validation)} validation-only line(s) (no timing keys) kept apart, not steps: lines "
                     + ", ".join(str(r["_line"]) for r in validation))
    if cut_line is not None:
        notes.append(f"line {cut_line}, the last metric line, is cut short (the file ends mid-line): left out")
    if notes_end:
        notes.append(notes_end)
    return rows, validation, notes, {"cut_line": cut_line}


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
        rows, validation, notes, facts = _console_rows(path)
        frame = _last_of_each_step(pd.DataFrame(rows), path, notes)
        frame.attrs.update(path=str(path), validation_rows=validation,
                           notes=notes, cut_line=facts["cut_line"])
        frame.attrs["lines"] = frame.pop("_line").astype(int).tolist()
        return frame
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


_GPUS = re.compile(r"n_gpus_per_node['\"]?\s*[=:]\s*(\d+)")
_NODES = re.compile(r"\bnnodes['\"]?\s*[=:]\s*(\d+)")


def job_gpus(path: Union[str, Path]) -> tuple:
    """``(gpus, where)``: ``trainer.n_gpus_per_node × trainer.nnodes`` as a veRL console log prints them (its launch
    command or Hydra config dump), with the line numbers they came from; ``(1.0, None)`` when the log has neither."""
    path = Path(path)
    if path.suffix.lower() in (".jsonl", ".json", ".csv"):
        return 1.0, None
    found: dict = {}
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for key, pattern in (("gpus", _GPUS), ("nodes", _NODES)):
            m = pattern.search(line)
            if m and key not in found:
                found[key] = (int(m.group(1)), n)
        if len(found) == 2:
            break
    if "gpus" not in found:
        return 1.0, None
    nodes, nodes_line = found.get("nodes", (1, None))
    where = f"line {found['gpus'][1]}" + (f", nnodes line {nodes_line}" if nodes_line else ", nnodes not printed: 1")
    return float(found["gpus"][0] * nodes), where


def _last_of_each_step(frame: pd.DataFrame, path: Path, notes: list) -> pd.DataFrame:
    """One row per step, the last line of each (a resumed run replays steps after its checkpoint), in step order;
    ``notes`` gets which steps repeated and which lines were kept."""
    key = "training/global_step"
    repeated = frame[frame.duplicated(key, keep=False)]
    if len(repeated):
        kept = frame.drop_duplicates(key, keep="last")
        steps = sorted(set(repeated[key].astype(int)))
        shown = ", ".join(str(s) for s in steps[:10]) + (f" … ({len(steps)} steps)" if len(steps) > 10 else "")
        notes.append(f"step(s) {shown} logged more than once (a resumed run replays the steps after its checkpoint): "
                     f"the last line of each is kept (lines {', '.join(str(n) for n in kept[kept[key].isin(steps)]['_line'][:10])}"
                     f"{' …' if len(steps) > 10 else ''}), {len(repeated) - len(steps)} earlier line(s) left out")
        frame = kept
    frame = frame.sort_values(key, kind="stable").reset_index(drop=True)
    frame.attrs["repeated_steps"] = sorted(set(repeated[key].astype(int))) if len(repeated) else []
    return frame
