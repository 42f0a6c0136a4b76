"""Stage-time profiles on disk: the measured records :mod:`bidirl.perf.fit` fits (paper appendix,
"Stage-Time Models": τ, α and r are calibrated from profiling runs).

A profile is a folder written by ``bidirl profile`` (:mod:`bidirl.calibrate.profile`):

``meta.json``
    what was measured, where and when: ``format`` (``"bidirl-profile"``), ``version`` (1), ``model`` and
    ``hardware`` (preset names), ``grid`` (its name and axes), ``seed``, ``engines`` (package versions),
    ``machine`` (from :mod:`platform` / :mod:`os`), ``settings`` (engine settings), ``date`` (UTC, ISO 8601),
    ``seconds`` (wall time of the whole profile). Optional: ``image_tokens_per_prompt`` — the LLM image tokens
    in every measured prompt (part of its ``prompt_len``; a whole number ≥ 0, at most the shortest
    ``prompt_len``), whose vision-encoder FLOPs the stage models charge (:func:`bidirl.perf.flops.vit_forward_flops`:
    once per request in the rollout's prefill, once per sample in every trainer stage). Absent means text-only
    prompts: no vision encoder ran. ``bidirl profile`` writes 0 (its prompts are token ids, no images); a
    vision-language model's records without the field are refused by ``bidirl calibrate``
    (:func:`bidirl.calibrate.from_records.image_tokens_of`), since records that say nothing about the images
    would fit the encoder's work into the decoder's knobs.
``rollout.csv``
    one row per measured rollout batch on one replica: ``point`` (grid point id), ``rep`` (repetition),
    ``batch`` (prompt groups), ``group_size``, ``requests`` (= batch × group_size), ``prompt_len``,
    ``response_len``, ``d`` (replicas, 1), ``observed`` (seconds).
``trainer.csv``
    one row per measured trainer chunk (one micro-batch on one replica): ``point``, ``rep``, ``stage``
    (``old_logprob`` / ``ref_logprob`` / ``actor_update``), ``batch``, ``requests`` (samples), ``prompt_len``,
    ``response_len``, ``d`` (1), ``observed`` (seconds).

Every request of a profiled unit has the same prompt length and exactly ``response_len`` generated tokens
(fixed-length generation), so a row stores the lengths once and :func:`load_profile` expands them to the
per-request ``prompt_lens`` / ``response_lens`` arrays the calibration takes. Warm-up runs are not stored.
CSV keeps a profile small, diffable and shippable with the package data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import pandas as pd

from bidirl.errors import BidirlError
from bidirl.perf.flops import STAGES

FORMAT = "bidirl-profile"
VERSION = 1
META_FILE, ROLLOUT_FILE, TRAINER_FILE = "meta.json", "rollout.csv", "trainer.csv"
META_KEYS = ("format", "version", "model", "hardware", "grid", "seed", "engines", "machine", "settings", "date")
#: optional meta.json field (module doc): absent means text-only prompts
IMAGE_TOKENS = "image_tokens_per_prompt"
ROLLOUT_FIELDS = ("point", "rep", "batch", "group_size", "requests", "prompt_len", "response_len", "d", "observed")
TRAINER_FIELDS = ("point", "rep", "stage", "batch", "requests", "prompt_len", "response_len", "d", "observed")
_WHOLE = {"point": 0, "rep": 0, "batch": 1, "group_size": 1, "requests": 1, "prompt_len": 1, "response_len": 1,
          "d": 1}


class ProfileError(BidirlError, ValueError):
    """A profile folder, file or field is missing or malformed; the message names the file, field and fix."""


@dataclass(frozen=True)
class Profile:
    """A loaded profile: ``meta`` (dict) and the rollout / trainer records as DataFrames with the stored
    columns plus ``prompt_lens`` and ``response_lens`` (int arrays, one entry per request)."""
    meta: dict
    rollout: pd.DataFrame
    trainer: pd.DataFrame
    path: Union[Path, None] = None

    @property
    def model(self) -> str:
        return str(self.meta["model"])

    @property
    def hardware(self) -> str:
        return str(self.meta["hardware"])

    @property
    def image_tokens_per_prompt(self):
        """The LLM image tokens in every measured prompt (module doc), or None where the profile does not say
        (text-only prompts)."""
        n = self.meta.get(IMAGE_TOKENS)
        return None if n is None else int(n)

    def points(self) -> np.ndarray:
        """The grid point ids present in the records, sorted."""
        return np.array(sorted(set(self.rollout["point"]) | set(self.trainer["point"])), dtype=np.int64)


def with_lengths(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` plus ``prompt_lens`` / ``response_lens`` arrays (``requests`` entries of the row's lengths)."""
    df = df.copy()
    df["prompt_lens"] = [np.full(int(n), int(p), np.int64) for n, p in zip(df["requests"], df["prompt_len"])]
    df["response_lens"] = [np.full(int(n), int(r), np.int64) for n, r in zip(df["requests"], df["response_len"])]
    return df


def records_frame(rows, kind: str) -> pd.DataFrame:
    """Rows (dicts with the stored fields of ``kind``) as a DataFrame in the stored column order."""
    fields = ROLLOUT_FIELDS if kind == "rollout" else TRAINER_FIELDS
    return pd.DataFrame(list(rows), columns=list(fields))


def save_profile(folder: Union[str, Path], meta: dict, rollout: pd.DataFrame, trainer: pd.DataFrame) -> Path:
    """Write ``meta.json``, ``rollout.csv`` and ``trainer.csv`` into ``folder`` (created); returns it.

    The frames must hold the stored fields (extra columns such as ``prompt_lens`` are dropped); ``meta``
    gets ``format`` and ``version``. Everything is checked first, with the same rules as
    :func:`load_profile`.
    """
    folder = Path(folder)
    meta = {"format": FORMAT, "version": VERSION, **meta}
    _check_meta(meta, folder / META_FILE)
    frames = {ROLLOUT_FILE: rollout[list(ROLLOUT_FIELDS)], TRAINER_FILE: trainer[list(TRAINER_FIELDS)]}
    for name, df in frames.items():
        checked = _check_records(df.reset_index(drop=True), folder / name,
                                 "rollout" if name == ROLLOUT_FILE else "trainer")
        _check_image_tokens(meta, checked, folder / META_FILE, folder / name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    for name, df in frames.items():
        df.to_csv(folder / name, index=False, float_format="%.6g", lineterminator="\n")
    return folder


def save_trainer_records(folder: Union[str, Path], meta: dict, trainer: pd.DataFrame) -> Path:
    """Write ``meta.json`` and ``trainer.csv`` only (a trainer-only measurement such as ``bidirl bench --only
    trainer_scale``), checked with the same rules as :func:`save_profile`. ``bidirl calibrate`` reads a folder that
    also holds a ``rollout.csv``: copy these records into a profile's folder to fit a preset's trainer knobs."""
    folder = Path(folder)
    meta = {"format": FORMAT, "version": VERSION, **meta}
    _check_meta(meta, folder / META_FILE)
    frame = trainer[list(TRAINER_FIELDS)].reset_index(drop=True)
    _check_image_tokens(meta, _check_records(frame, folder / TRAINER_FILE, "trainer"), folder / META_FILE,
                        folder / TRAINER_FILE)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    frame.to_csv(folder / TRAINER_FILE, index=False, float_format="%.6g", lineterminator="\n")
    return folder


def load_profile(folder: Union[str, Path]) -> Profile:
    """Read and check a profile folder; :class:`ProfileError` names the file, the field and the fix."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProfileError(f"{folder}: no such profile folder — pass the --out folder of `bidirl profile` "
                           "(it holds meta.json, rollout.csv and trainer.csv)")
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise ProfileError(f"{meta_path}: missing — a profile folder needs meta.json, rollout.csv and trainer.csv; "
                           "write one with `bidirl profile CONFIG --out DIR`")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{meta_path}: not valid JSON ({exc}) — rewrite it with `bidirl profile`") from None
    _check_meta(meta, meta_path)
    frames = {}
    for name, kind in ((ROLLOUT_FILE, "rollout"), (TRAINER_FILE, "trainer")):
        path = folder / name
        if not path.is_file():
            raise ProfileError(f"{path}: missing — a profile needs both {ROLLOUT_FILE} and {TRAINER_FILE}; "
                               "re-run `bidirl profile`")
        try:
            df = pd.read_csv(path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path}: not a readable CSV table ({str(exc).strip()}) — re-run "
                               "`bidirl profile`") from None
        frames[kind] = with_lengths(_check_records(df, path, kind))
        _check_image_tokens(meta, frames[kind], meta_path, path)
    return Profile(meta, frames["rollout"], frames["trainer"], folder)


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------

def _check_meta(meta, path: Path) -> None:
    if not isinstance(meta, dict):
        raise ProfileError(f"{path}: must hold a JSON object with keys {', '.join(META_KEYS)}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ProfileError(f"{path}: missing field(s) {', '.join(missing)} — a profile's meta.json carries "
                           f"{', '.join(META_KEYS)}; re-run `bidirl profile`")
    if meta["format"] != FORMAT:
        raise ProfileError(f"{path}: field 'format' is {meta['format']!r}, expected {FORMAT!r} — this is not a "
                           "bidirl profile")
    if meta["version"] != VERSION:
        raise ProfileError(f"{path}: field 'version' is {meta['version']!r}; this bidirl reads version {VERSION} "
                           "— re-run `bidirl profile` with this version")
    for key in ("model", "hardware", "date"):
        if not isinstance(meta[key], str) or not meta[key].strip():
            raise ProfileError(f"{path}: field {key!r} must be a non-empty string, got {meta[key]!r} — name the "
                               f"{key} preset (or the date) the records were measured with")
    for key in ("grid", "engines", "machine", "settings"):
        if not isinstance(meta[key], dict):
            raise ProfileError(f"{path}: field {key!r} must be a JSON object, got {type(meta[key]).__name__} — "
                               "re-run `bidirl profile`")
    if IMAGE_TOKENS in meta:
        n = meta[IMAGE_TOKENS]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ProfileError(f"{path}: field {IMAGE_TOKENS!r} is {n!r} — must be a whole number ≥ 0, the LLM image "
                               "tokens in every measured prompt (0 for text-only prompts; leave the field out only "
                               "for a text model)")


def _check_image_tokens(meta: dict, records: pd.DataFrame, meta_path: Path, path: Path) -> None:
    """The image tokens are part of every prompt: no more than the shortest ``prompt_len`` of the checked
    ``records`` (``path``)."""
    n = meta.get(IMAGE_TOKENS)
    if n is None or records.empty:
        return
    shortest = int(records["prompt_len"].min())
    if n > shortest:
        i = int(np.argmin(records["prompt_len"].to_numpy()))
        raise ProfileError(f"{meta_path}: field {IMAGE_TOKENS!r} is {n} but {path.name} row {i + 1} has prompt_len "
                           f"{shortest} — the image tokens are part of every prompt's prompt_len; give the LLM "
                           "image tokens per prompt (0 for text-only prompts)")


def _check_records(df: pd.DataFrame, path: Path, kind: str) -> pd.DataFrame:
    fields = ROLLOUT_FIELDS if kind == "rollout" else TRAINER_FIELDS
    missing = [f for f in fields if f not in df.columns]
    if missing:
        raise ProfileError(f"{path}: missing column(s) {', '.join(missing)} — {kind} records need "
                           f"{', '.join(fields)}")
    if len(df) == 0:
        raise ProfileError(f"{path}: no records — profile at least one grid point")
    df = df.reset_index(drop=True)
    for col in fields:
        if col == "stage":
            bad = [i for i, s in enumerate(df[col]) if s not in STAGES]
            if bad:
                raise ProfileError(f"{path}: row {bad[0] + 1}, field 'stage' is {df[col].iloc[bad[0]]!r} — use one "
                                   f"of {', '.join(STAGES)}")
            continue
        values = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
        if col == "observed":
            bad = np.nonzero(~np.isfinite(values) | (values <= 0))[0]
            fix = "a positive time in seconds; drop failed measurements"
        else:
            low = _WHOLE[col]
            bad = np.nonzero(~np.isfinite(values) | (values < low) | (values != np.floor(values)))[0]
            fix = f"a whole number ≥ {low}"
        if bad.size:
            i = int(bad[0])
            raise ProfileError(f"{path}: row {i + 1}, field {col!r} is {df[col].iloc[i]!r} — must be {fix}")
        df[col] = values if col == "observed" else values.astype(np.int64)
    if kind == "rollout":
        wrong = np.nonzero(df["requests"].to_numpy() != df["batch"].to_numpy() * df["group_size"].to_numpy())[0]
        if wrong.size:
            i = int(wrong[0])
            raise ProfileError(f"{path}: row {i + 1}, field 'requests' is {df['requests'].iloc[i]} but batch × "
                               f"group_size = {df['batch'].iloc[i] * df['group_size'].iloc[i]} — a rollout unit is "
                               "whole prompt groups")
    keys = ["point", "rep"] + (["stage"] if kind == "trainer" else [])
    dup = df.duplicated(keys)
    if dup.any():
        i = int(np.nonzero(dup.to_numpy())[0][0])
        raise ProfileError(f"{path}: row {i + 1} repeats ({', '.join(keys)}) = "
                           f"{tuple(df[k].iloc[i] for k in keys)} — each measurement must appear once")
    shape = ["prompt_len", "response_len", "requests"]
    counts = df.groupby("point")[shape].nunique()
    mixed = counts.index[(counts > 1).any(axis=1)]
    if len(mixed):
        raise ProfileError(f"{path}: grid point {int(mixed[0])} has records of different shapes (prompt_len, "
                           "response_len, requests) — one point id per grid point")
    return df


__all__ = ["Profile", "ProfileError", "load_profile", "save_profile", "records_frame", "with_lengths", "FORMAT",
           "VERSION", "META_FILE", "ROLLOUT_FILE", "TRAINER_FILE", "ROLLOUT_FIELDS", "TRAINER_FIELDS", "META_KEYS",
           "IMAGE_TOKENS"]
