"""Run checkpoints: all that a resumed run needs, written atomically at step boundaries (``bidirl run
--checkpoint-dir DIR``, ``--resume DIR``).

A checkpoint is taken at a step boundary — when the weight sync of a step has finished and before the
coordinator hears of it (its ``SyncFinished`` event). There the run is quiescent: every lease is back with
its pool's own workers, no chunk runs, and every unfinished group is parked in the rollout buffer with its
prefix (partial rollout) or nothing runs at all (without it). A checkpoint therefore holds:

* the **control plane** (``control.pkl``, :class:`ControlPlane`): the :class:`~bidirl.core.coordinator.Coordinator`
  pickled whole — versions, the rollout buffer with the groups in flight, their prefixes and staleness tags,
  the admission counter (the data position: group ``g`` is always prompt row ``g``), the batches consumed, the
  chunk-id counter, the profiler's records, refitted models and switch costs — plus the boundary event, the
  event log so far, the driver's per-run state (measured costs, per-step training metrics) and the driver
  process's RNG states. The core is a sans-I/O state machine of plain data, so pickling it needs no knowledge
  of its internals; sampling is keyed by (request seed, position), so no sampler RNG state exists to save;
* the **trainer state** (``trainer/``): the primary trainer gang's weights and AdamW state, written by every
  rank with ``torch.distributed.checkpoint`` — one file per rank, sharded as the gang is (FSDP2) — by the
  engine driver; emulated runs have none;
* ``config.yaml`` (the job config, so a mismatch names the keys that differ) and ``manifest.json``.

Layout of a checkpoint folder::

    DIR/step-000003/              the boundary after 3 steps (the last ``keep`` are kept)
        manifest.json             format and version, the run's identity, step, files with sizes and SHA-256
        config.yaml  control.pkl  trainer/.metadata  trainer/__0_0.distcp ...
    DIR/.partial-step-000004-*/   being written; renamed to step-000004 when complete, ignored otherwise

**Identity** (:class:`RunIdentity`): the config (and its SHA-256), policy, steps, seed, the driver kind, the
model (its config's SHA-256 and weight files), the data (the prompt file's SHA-256 and rows) and the layout
(world size: GPU slots, pools, ranks per gang). A resumed run must match it — all but ``steps``: a run may be
resumed to go on to more steps than it was started with — otherwise :class:`CheckpointError` names every
difference. A checkpoint whose files are missing, truncated or altered (sizes and SHA-256 in the
manifest) is refused the same way; resuming from a folder skips such checkpoints (with a warning naming why)
and takes the newest good one.

``control.pkl`` is a pickle: load checkpoints you (or your cluster) wrote, as with any torch checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import sys
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from bidirl.core.protocol import SyncFinished
from bidirl.errors import BidirlError
from bidirl.results.trace import EventLog
from bidirl.runtime.driver import RunListener

FORMAT = "bidirl-run-checkpoint"
FORMAT_VERSION = 2                 # 2: the package layout by role (pickled classes moved)
MANIFEST = "manifest.json"
CONTROL_FILE = "control.pkl"
CONFIG_FILE = "config.yaml"
TRAINER_DIR = "trainer"
STEP_PREFIX = "step-"
PARTIAL_PREFIX = ".partial-"
_CHUNK = 1 << 20


class CheckpointError(BidirlError, ValueError):
    """A checkpoint that cannot be written or resumed from; the message names the checkpoint, what is wrong
    (the file, or each field that differs from this run) and the fix."""


class CheckpointSkipped(RuntimeError):
    """A worker could not contribute its state to a checkpoint (it died meanwhile): the boundary is skipped, the
    run goes on and the next boundary writes one."""


# --------------------------------------------------------------------------------------------------
# identity: what must match for a run to resume from a checkpoint
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint was written by. ``config`` is the job config as plain data; ``model``, ``data`` and
    ``layout`` are small dicts the driver fills (layout: the world size of every pool and gang)."""
    config: dict
    policy: str
    steps: int
    seed: int
    driver: str                    # "engines" | "emulated"
    model: dict
    data: dict
    layout: dict

    def __post_init__(self):
        # as JSON stores them (tuples become lists), so an identity read back from a manifest compares equal
        for name in ("config", "model", "data", "layout"):
            object.__setattr__(self, name, json.loads(json.dumps(getattr(self, name), default=str)))

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()

    def to_json(self) -> dict:
        return dict(asdict(self), config_sha256=self.config_sha256)

    @classmethod
    def from_json(cls, data: dict) -> "RunIdentity":
        return cls(**{k: data[k] for k in ("config", "policy", "steps", "seed", "driver", "model", "data", "layout")})

    def differences(self, run: "RunIdentity") -> list:
        """One line per field in which ``run`` (this run) differs from ``self`` (the checkpoint's)."""
        out = []
        if self.driver != run.driver:
            out.append(f"driver: the checkpoint was written by a run with {self.driver} workers, this run uses "
                       f"{run.driver}")
        for key, value in sorted(self.layout.items()):
            if run.layout.get(key) != value:
                out.append(f"world size: {key} is {value} in the checkpoint, {run.layout.get(key)} in this run")
        for key in sorted(set(run.layout) - set(self.layout)):
            out.append(f"world size: {key} is absent in the checkpoint, {run.layout[key]} in this run")
        for what, mine, theirs in (("model", self.model, run.model), ("data", self.data, run.data)):
            for key in sorted(set(mine) | set(theirs)):
                if mine.get(key) != theirs.get(key):
                    out.append(f"{what}: {key} is {_short(mine.get(key))} in the checkpoint, "
                               f"{_short(theirs.get(key))} in this run")
        # ``steps`` may differ: a resumed run may go on to more steps than the run that wrote the checkpoint
        for key in ("policy", "seed"):
            if getattr(self, key) != getattr(run, key):
                out.append(f"{key}: {getattr(self, key)!r} in the checkpoint, {getattr(run, key)!r} in this run")
        mine, theirs = _flatten(self.config), _flatten(run.config)
        for key in sorted(set(mine) | set(theirs)):
            if key.split(".", 1)[0] in RESUMABLE_ACROSS:
                continue
            if mine.get(key, "(absent)") != theirs.get(key, "(absent)"):
                out.append(f"config: {key} is {_short(mine.get(key, '(absent)'))} in the checkpoint, "
                           f"{_short(theirs.get(key, '(absent)'))} in this run")
        return out


#: config sections a run may be resumed with other values of: how the run recovers from a lost trainer (where
#: its snapshots go, how often) changes nothing it computes
RESUMABLE_ACROSS = ("recovery",)


def _flatten(data: Any, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def file_sha256(path: Union[str, Path]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# the control plane
# --------------------------------------------------------------------------------------------------

@dataclass
class ControlPlane:
    """The control-plane half of a checkpoint (module docstring): pickled into ``control.pkl``."""
    coordinator: Any               # bidirl.core.coordinator.Coordinator, whole
    boundary: Any                  # the SyncFinished the checkpoint was taken before (fed again on resume)
    log: EventLog                  # spans, steps and decisions recorded so far
    driver: dict                   # the driver's own per-run state (PoolDriver.checkpoint_state)
    rng: dict                      # global RNG states of the driver process


def capture(driver, boundary, driver_state: dict) -> ControlPlane:
    """The control plane of ``driver`` (a :class:`bidirl.runtime.driver.Driver`) just before it feeds ``boundary``.

    The coordinator is taken whole: the checkpoint needs all of it and none of its internals.
    """
    return ControlPlane(driver.coordinator, boundary, driver.log, dict(driver_state), rng_states())


def rng_states() -> dict:
    """Python's, numpy's and (when loaded) torch's global RNG states."""
    out = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.random.get_rng_state()
    return out


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "torch" in states:
        import torch
        torch.random.set_rng_state(states["torch"])


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------

def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step):06d}"


def step_of(path: Path) -> Optional[int]:
    name = path.name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX):].isdigit():
        return None
    return int(name[len(STEP_PREFIX):])


def step_folders(root: Union[str, Path]) -> list:
    """The ``step-*`` folders under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint folder: every file the manifest lists is there with its size and SHA-256."""
    path: Path
    manifest: dict

    @classmethod
    def open(cls, path: Union[str, Path]) -> "Checkpoint":
        """Read and verify the checkpoint at ``path``; :class:`CheckpointError` names what is wrong."""
        path = Path(path)
        where = f"checkpoint {str(path)!r}"
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{where} has no {MANIFEST}: it is partial (its writer stopped before the end) "
                                  "or not a bidirl checkpoint; resume from an older one or from its folder")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where}: {MANIFEST} is unreadable ({exc}); the checkpoint is corrupt, "
                                  "resume from an older one") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{where}: {MANIFEST} is not a bidirl run checkpoint manifest (format "
                                  f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{where} has format version {manifest.get('format_version')!r}; this bidirl "
                                  f"reads version {FORMAT_VERSION}: resume it with the bidirl that wrote it "
                                  f"({manifest.get('bidirl_version')})")
        for name, entry in sorted(manifest.get("files", {}).items()):
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{where}: file {name} is missing; the checkpoint is incomplete, resume from "
                                      "an older one")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"{where}: file {name} is {size} bytes, the manifest says {entry['bytes']}: "
                                      "it is truncated or was altered; resume from an older checkpoint")
            if file_sha256(file) != entry["sha256"]:
                raise CheckpointError(f"{where}: file {name} does not match its SHA-256 in the manifest: it is "
                                      "corrupt; resume from an older checkpoint")
        return cls(path, manifest)

    @property
    def step(self) -> int:
        """Steps done at this boundary."""
        return int(self.manifest["step"])

    @property
    def trainer_version(self) -> int:
        return int(self.manifest["trainer_version"])

    @property
    def identity(self) -> RunIdentity:
        return RunIdentity.from_json(self.manifest["identity"])

    @property
    def trainer_dir(self) -> Optional[Path]:
        """The trainer state's folder (``torch.distributed.checkpoint``), or None (an emulated run's)."""
        return self.path / TRAINER_DIR if self.manifest.get("trainer") else None

    def check_matches(self, run: RunIdentity) -> None:
        """Raise :class:`CheckpointError` naming every difference between this run and the checkpoint's."""
        diff = self.identity.differences(run)
        if diff:
            raise CheckpointError(f"checkpoint {str(self.path)!r} was written by another run; "
                                  + "; ".join(diff) + ". Resume with the checkpoint's config (its config.yaml) and "
                                  "the same model, data, cluster, --policy and --seed, or start a new run "
                                  "with another --checkpoint-dir")

    def control(self) -> ControlPlane:
        """The control plane (unpickled; the file was verified against the manifest)."""
        try:
            with open(self.path / CONTROL_FILE, "rb") as f:
                control = pickle.load(f)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {CONTROL_FILE} cannot be loaded by this bidirl "
                                  f"({type(exc).__name__}: {exc}); it was written by bidirl "
                                  f"{self.manifest.get('bidirl_version')}: resume with that version") from None
        if not isinstance(control, ControlPlane):
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {CONTROL_FILE} holds a "
                                  f"{type(control).__name__}, not a ControlPlane")
        return control

    def trainer_weights(self) -> dict:
        """The primary trainer's weights at this boundary as full tensors under the model's parameter names,
        gathered from the sharded files in this process (for inspection and export)."""
        if self.trainer_dir is None:
            raise CheckpointError(f"checkpoint {str(self.path)!r} holds no trainer state (an emulated run's)")
        import tempfile

        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "state.pt"
            dcp_to_torch_save(str(self.trainer_dir), str(target))
            state = torch.load(target, map_location="cpu", weights_only=False)
        return dict(state["model"])


def check_source(source: Union[str, Path]) -> Path:
    """``source`` as a path, if it is a folder to resume from (a run's checkpoint folder or one checkpoint)."""
    source = Path(source)
    if not source.is_dir():
        raise CheckpointError(f"--resume {str(source)!r}: no such folder; pass the --checkpoint-dir of the run "
                              "to resume (or one of its step-* folders)")
    return source


def find(source: Union[str, Path], run: Optional[RunIdentity] = None) -> Checkpoint:
    """The checkpoint to resume from: ``source`` itself if it is a checkpoint (it must be good), else the newest
    good ``step-*`` checkpoint in the folder ``source`` — corrupt or partial ones are skipped with a warning
    naming why. With ``run``, the checkpoint must have been written by the same run (:meth:`Checkpoint.check_matches`).
    """
    source = check_source(source)
    if (source / MANIFEST).exists():
        found = Checkpoint.open(source)
    else:
        refused, found = [], None
        for path in reversed(step_folders(source)):
            try:
                found = Checkpoint.open(path)
                break
            except CheckpointError as exc:
                refused.append(str(exc))
        if found is None:
            why = ("; ".join(refused)) if refused else "it holds no step-* checkpoint"
            raise CheckpointError(f"no good checkpoint to resume from in {str(source)!r}: {why}")
        for reason in refused:
            warnings.warn(f"skipping a newer checkpoint: {reason}", RuntimeWarning, stacklevel=2)
    if run is not None:
        found.check_matches(run)
    return found


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------

def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class CheckpointWriter:
    """Writes checkpoints into ``root`` every ``every`` steps (and at the last step), keeping the last ``keep``.

    A checkpoint is written into a ``.partial-*`` folder — the trainer ranks add their files to
    :meth:`begin`'s ``trainer/`` — and renamed into place by :meth:`commit` once its manifest is written, so a
    run killed meanwhile leaves a partial folder, never a half checkpoint under a step name. Leftover partial
    folders are removed when a writer starts.
    """
    root: Union[str, Path]
    every: int = 1
    keep: int = 3

    def __post_init__(self):
        for name in ("every", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--checkpoint-every" if name == "every" else "--keep"
                raise CheckpointError(f"{flag} must be a positive integer (steps between checkpoints / checkpoints "
                                      f"kept), got {value!r}")
        self.root = Path(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"--checkpoint-dir {str(self.root)!r} is a file; pass a folder")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create --checkpoint-dir {str(self.root)!r}: {exc.strerror or exc}") from None
        for leftover in self.root.glob(PARTIAL_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def due(self, step: int, last: bool = False) -> bool:
        """Whether the boundary after ``step`` steps gets a checkpoint."""
        return last or step % self.every == 0

    def begin(self, step: int) -> Path:
        """A fresh partial folder for the checkpoint of ``step`` (its ``trainer/`` subfolder created)."""
        tmp = self.root / f"{PARTIAL_PREFIX}{step_name(step)}-{uuid.uuid4().hex[:8]}"
        (tmp / TRAINER_DIR).mkdir(parents=True)
        return tmp

    def abandon(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, tmp: Path, *, step: int, trainer_version: int, t: float, identity: RunIdentity,
               control: ControlPlane, config_yaml: str, trainer: bool) -> Checkpoint:
        """Finish the checkpoint in ``tmp``: control plane, config, manifest (sizes and SHA-256 of every file),
        then rename it to ``step-NNNNNN`` and drop checkpoints beyond the last ``keep``."""
        with open(tmp / CONTROL_FILE, "wb") as f:
            pickle.dump(control, f, protocol=pickle.HIGHEST_PROTOCOL)
        (tmp / CONFIG_FILE).write_text(config_yaml)
        files = {}
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync_file(file)
            files[file.relative_to(tmp).as_posix()] = {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
        if trainer and not any(name.startswith(TRAINER_DIR + "/") for name in files):
            raise CheckpointError(f"checkpoint of step {step}: the trainer wrote no files into {tmp / TRAINER_DIR}")
        from bidirl import __version__
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "bidirl_version": __version__,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": int(step),
                    "trainer_version": int(trainer_version), "t": float(t), "trainer": bool(trainer),
                    "identity": identity.to_json(), "files": files}
        part = tmp / (MANIFEST + ".tmp")
        part.write_text(json.dumps(manifest, indent=1, default=str))
        _fsync_file(part)
        os.replace(part, tmp / MANIFEST)
        final = self.root / step_name(step)
        if final.exists():             # an older attempt at this step (e.g. before a resume): replace it
            old = self.root / f"{PARTIAL_PREFIX}replaced-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        for stale in step_folders(self.root)[: -self.keep]:
            shutil.rmtree(stale, ignore_errors=True)
        return Checkpoint(final, manifest)


class Checkpointing(RunListener):
    """Writes a checkpoint at each due step boundary of a run (module doc): just before the step's
    ``SyncFinished`` reaches the coordinator, when the run is quiescent.

    The driver supplies what a checkpoint holds through four methods: ``identity()`` (:class:`RunIdentity`),
    ``checkpoint_state()`` (its own per-run state), ``save_trainer_state(folder)`` (the trainer's files, False
    when it has none; raises :class:`CheckpointSkipped` when it cannot now) and ``boundary`` (the boundary a
    resumed run started from, which is already a checkpoint)."""

    def __init__(self, writer: CheckpointWriter):
        self.writer = writer

    def on_event(self, driver, event) -> None:
        if isinstance(event, SyncFinished):
            self.write(driver, event)

    def write(self, driver, boundary) -> Optional[Path]:
        """The checkpoint at the boundary ``boundary`` closes, if one is due; its folder or None."""
        step = driver.steps_done + 1
        if boundary is driver.boundary or not self.writer.due(step, last=step >= driver.steps):
            return None
        tmp = self.writer.begin(step)
        try:
            try:
                trainer = driver.save_trainer_state(tmp / TRAINER_DIR)
            except CheckpointSkipped as exc:
                self.writer.abandon(tmp)
                warnings.warn(f"no checkpoint after step {step}: {exc}; the next boundary writes one", RuntimeWarning,
                              stacklevel=2)
                return None
            control = capture(driver, boundary, driver.checkpoint_state())
            return self.writer.commit(tmp, step=step, trainer_version=boundary.version, t=boundary.t,
                                      identity=driver.identity(), control=control,
                                      config_yaml=driver.config.to_yaml(), trainer=trainer)
        except BaseException:
            self.writer.abandon(tmp)
            raise
