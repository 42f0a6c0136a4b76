"""How an engine run gets a lost primary trainer gang back without a per-step copy of its state (issue #23).

The primary gang holds the only copy of the training state (fp32 weights and AdamW moments: 12 bytes a parameter,
48 GB at 4B). Copying it into Ray's object store after every optimizer step cost that much per step. Instead the
driver keeps a **recovery point** and the **steps since**:

* the recovery point is the model folder (version 0), the run checkpoint a resumed run started from, or a
  snapshot the ranks wrote every ``recovery.snapshot_every`` steps to their own node's disk
  (:mod:`bidirl.cluster.engines.workers.snapshot_files`: the copy taken between two calls, the write on a thread of its
  own; it becomes the recovery point once every rank's write is complete — ``flush_snapshot`` runs beside the
  calls that train);
* the steps since are what the driver already holds for each step (its ``StepData``): its samples, advantages,
  loss normaliser and the old / reference log-probs the step trained with (tokens, a few MB a step at most).

A restarted gang loads the recovery point and **replays** the steps since on its own ranks — each step's update
chunks (every sample, the same per-device micro-batch) then its optimizer step — so it ends at the version the
lost gang held, up to fp32 summation order (the chunks may group differently than in the run: the same bound as
borrowing, ``tests/rounding.py``). No sample is generated again and none is lost: the replayed steps train on the
samples they trained on. Cost, in steps: at most ``2·N − 1`` steps of training are replayed (N − 1 since the last
snapshot, plus up to N while the next one is being written), none while the gang is alive; on disk, two snapshots
per rank (its shard of the state each).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Optional

from bidirl.core import protocol as P

PRIMARY_TRAINER = P.PRIMARY_TRAINER


class TrainerRecovery:
    """The primary gang's recovery point and the steps since (module docstring). ``driver``: the
    :class:`EngineDriver`; ``every``: ``recovery.snapshot_every``; ``folder``: ``recovery.snapshot_dir`` (each run
    writes under a folder of its own in it)."""

    def __init__(self, driver, every: int, folder: Optional[str] = None):
        self.driver, self.every = driver, int(every)
        root = folder or os.path.join(tempfile.gettempdir(), "bidirl-snapshots")
        self.folder = os.path.join(root, f"run-{uuid.uuid4().hex[:12]}")
        self.point: tuple = ("model", 0)       # ("model", 0) | ("checkpoint", path, version) | ("snapshot", version)
        self.steps: list = []                  # (version it produced, StepData) since the recovery point, in order;
        #                                        a streamed step's local updates each, under the step's version
        self.partial: list = []                # the step under way's local updates applied so far (StepData)
        self.snapshots: list = []              # reports of the snapshots written (per rank)
        self.replayed = 0                      # steps replayed by restarted gangs

    @property
    def version(self) -> int:
        return int(self.point[-1])

    def from_checkpoint(self, path, version: int) -> None:
        """A resumed run: the checkpoint it started from is the recovery point."""
        self.point, self.steps = ("checkpoint", str(path), int(version)), []

    # ---- while the gang trains -----------------------------------------------------------------
    def local_update(self, data) -> None:
        """A streamed step's local update before its last (``rl.updates_per_sync``) was applied: the gang's weights
        moved without a new version, so a restarted gang replays it too before the step's next local update."""
        self.partial.append(data)

    def stepped(self, data, version: int) -> None:
        """The optimizer step that produced ``version`` from ``data`` (a ``StepData``; with its step's earlier local
        updates) is safe: keep what it trained with, and every ``every`` versions have the ranks write a snapshot."""
        self.steps += [(int(version), part) for part in self.partial] + [(int(version), data)]
        self.partial = []
        if version % self.every == 0:
            self._snapshot(int(version))

    def _snapshot(self, version: int) -> None:
        d = self.driver
        ranks = d.gangs[PRIMARY_TRAINER]

        def written(reports):
            errors = [r["error"] for r in reports if r.get("error")]
            if errors:
                from bidirl.cluster.pool import ClusterError
                raise ClusterError(errors[0])
            if any(r.get("version") != version for r in reports):
                return                                  # a gang restarted meanwhile wrote another version
            self.snapshots.append({"version": version, "bytes": sum(r["bytes"] for r in reports),
                                   "write_seconds": max(r["seconds"] for r in reports)})
            if version > self.version:
                self.point = ("snapshot", version)
                self.steps = [s for s in self.steps if s[0] > version]

        def copied(_replies):
            d._when_all([(PRIMARY_TRAINER, r.flush_snapshot.remote()) for r in ranks], written)
        d._when_all([(PRIMARY_TRAINER, r.save_snapshot.remote(self.folder, version)) for r in ranks], copied)

    # ---- a restarted gang ----------------------------------------------------------------------
    def restore_calls(self, handles: list) -> tuple:
        """``(calls, version)``: the calls that bring a restarted gang (``handles``, in rank order) to the version
        the lost one held — load the recovery point, replay the steps since — and that version. The calls run in
        order on each rank; waiting for the returned ones (the loads, then each replayed optimizer step) is enough."""
        kind = self.point[0]
        calls = []
        if kind == "snapshot":
            calls += [r.load_snapshot.remote(self.folder, self.version) for r in handles]
        elif kind == "checkpoint":
            calls += [r.load_train_state.remote(self.point[1], self.version) for r in handles]
        version = self.version
        # a version's last entry makes it; a streamed step's earlier local updates move the weights and keep it
        for k, (version, data) in enumerate(self.steps):
            last = k + 1 == len(self.steps) or self.steps[k + 1][0] != version
            calls += self._replay(handles, data, new_version=last)
        self.replayed += len({v for v, _ in self.steps})
        return calls, version

    def partial_calls(self, handles: list) -> list:
        """The calls that replay the step under way's local updates applied so far (``rl.updates_per_sync``) on a
        restarted gang, after :meth:`restore_calls` (and after the gang published the version those made): they
        move its weights to where the lost gang's stood, keeping the version."""
        calls = []
        for data in self.partial:
            calls += self._replay(handles, data, new_version=False)
        return calls

    def _replay(self, handles: list, data, new_version: bool = True) -> list:
        """One step (or local update) again on the restarted gang: per optimizer mini-batch (one without
        ``rl.mini_batch_prompts``) its update chunks (every sample once, ``micro_batch_per_device`` per rank, dealt
        as the run deals them, none across the mini-batch's end), then its optimizer step — the last one making the
        step's version when ``new_version``."""
        from bidirl.cluster.engines.workers.trainer import rank_shares

        d = self.driver
        per_device = d.config.rl.micro_batch_per_device
        size = per_device * len(handles)
        kl = d.config.rl.kl_coef > 0
        calls, cid, minis = [], 0, data.mini_batches()
        for k, (lo, hi) in enumerate(minis):
            ids = []
            for first in range(lo, hi, size):
                shares = rank_shares(list(range(first, min(hi, first + size))), per_device, len(handles))
                for r, share in zip(handles, shares):
                    r.chunk_gradient.remote(cid, *data.chunk_inputs(share, kl), keep=True, give=False)
                ids.append(cid)
                cid += 1
            calls += [r.apply_kept.remote(ids, final=new_version and k == len(minis) - 1) for r in handles]
        return calls

    def summary(self) -> dict:
        return {"recovery_point": list(self.point), "every": self.every, "snapshots": len(self.snapshots),
                "snapshot_bytes": self.snapshots[-1]["bytes"] if self.snapshots else 0,
                "steps_kept": len({v for v, _ in self.steps}), "steps_replayed": self.replayed}

    def cleanup(self) -> None:
        """Delete this run's snapshots on every primary rank's node (at the run's end)."""
        import ray
        ranks = self.driver.gangs.get(PRIMARY_TRAINER) or []
        try:
            ray.get([r.drop_snapshots.remote(self.folder) for r in ranks], timeout=60)
        except Exception:
            pass
