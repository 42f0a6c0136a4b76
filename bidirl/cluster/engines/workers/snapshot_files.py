"""A trainer rank's recovery snapshots on its node's disk (``recovery.snapshot_dir``; the driver's side is
:mod:`bidirl.cluster.engines.trainer_recovery`).

A snapshot of version ``v`` is one file per rank, ``<folder>/v<v>/rank<r>.pt``: the rank's ``train_state_shard``
(its shard of weights and AdamW state as CPU tensors). The copy to host memory runs beside the next chunks
(:mod:`bidirl.cluster.engines.workers.state_copy`); :class:`SnapshotWriter` waits for it and writes the file on a
thread of its own, under a temporary name renamed into place once complete, so a file that exists is whole. Each
rank keeps its last two
versions: the newest may still be in writing on another rank while the one before is the driver's recovery point.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import torch

_VERSION_DIR = re.compile(r"^v(\d+)$")


def snapshot_file(folder, version: int, rank: int) -> Path:
    return Path(folder) / f"v{int(version):08d}" / f"rank{int(rank):05d}.pt"


def versions_on_disk(folder) -> list:
    """The snapshot versions with a folder under ``folder``, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = (_VERSION_DIR.match(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


class SnapshotWriter:
    """One rank's writer: at most one write in flight; :meth:`flush` waits for it and says what was written."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._result: dict = {}
        self._lock = threading.Lock()           # flush may be called from the actor's snapshot thread too

    def write(self, folder, version: int, rank: int, shard) -> None:
        """Write ``shard`` (plain CPU tensors, or a function returning them: called on the writing thread, e.g. the
        wait for a copy in flight) as ``version`` of ``rank`` in the background (the previous write is waited for
        first); older versions of this rank beyond the last two are deleted once it is written."""
        self.flush()
        path = snapshot_file(folder, version, rank)
        result = self._result = {"version": int(version), "path": str(path)}

        def run():
            t0 = time.perf_counter()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save(shard() if callable(shard) else shard, tmp)
                os.replace(tmp, path)
                result["bytes"] = path.stat().st_size
                for old in versions_on_disk(folder)[:-2]:
                    stale = snapshot_file(folder, old, rank)
                    stale.unlink(missing_ok=True)
                    if stale.parent.is_dir() and not any(stale.parent.iterdir()):
                        shutil.rmtree(stale.parent, ignore_errors=True)
            except (OSError, RuntimeError) as exc:          # RuntimeError: the copy it waited for failed
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["seconds"] = time.perf_counter() - t0
        self._thread = threading.Thread(target=run, name="bidirl-snapshot-write", daemon=True)
        self._thread.start()

    def flush(self) -> dict:
        """Wait for the write in flight; returns its report (``version``, ``path``, ``bytes``, ``seconds``) or ``{}``.
        Raises ``OSError`` naming the file if it could not be written."""
        with self._lock:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            result, self._result = self._result, {}
        if "error" in result:
            raise OSError(f"the recovery snapshot {result['path']} could not be written ({result['error']}); set "
                          "recovery.snapshot_dir to a folder with room on every trainer node")
        return result


def read(folder, version: int, rank: int) -> dict:
    """What :meth:`SnapshotWriter.write` wrote; a clear error if the file is missing."""
    path = snapshot_file(folder, version, rank)
    if not path.is_file():
        raise FileNotFoundError(f"no recovery snapshot {path}: this rank's node does not hold version {version} "
                                "(a restarted trainer rank reads the snapshot its own node wrote)")
    return torch.load(path, map_location="cpu", weights_only=False)
