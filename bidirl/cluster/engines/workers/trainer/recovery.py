"""The training state saved and taken back: run checkpoints (``torch.distributed.checkpoint``) and recovery
snapshots on the node's disk (:mod:`bidirl.cluster.engines.workers.snapshot_files`; the driver's side is
:mod:`bidirl.cluster.engines.trainer_recovery`).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine` (primary ranks: an auxiliary one
holds no optimizer state).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Union

from bidirl.cluster.engines.workers import snapshot_files
from bidirl.cluster.engines.workers.trainer.tensors import local_part, rebuild, tree_map


class Recovery:
    """Save and load the training state (DCP) and recovery snapshots."""

    def _train_state(self, what: str) -> dict:
        """Weights and AdamW state as ``torch.distributed.checkpoint`` state dicts under the model's parameter
        names (DTensors holding this rank's shards when sharded; the optimizer state is initialised first if no
        step ran yet). Primary engines only: an auxiliary one holds no optimizer state."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            raise RuntimeError(f"TrainerEngine.{what}: an {self.role} trainer holds no training state; the "
                               "primary trainer's is saved and restored")
        self._ready(what)
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def _set_train_state(self, state: dict, version: int) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.version = int(version)

    def save_train_state(self, path: Union[str, Path]) -> float:
        """Write weights and optimizer state into the folder ``path`` with ``torch.distributed.checkpoint``: on
        a gang every rank calls it and writes its own shards (one file per rank). Returns seconds."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(self._train_state("save_train_state"), checkpoint_id=str(path), process_group=self._dcp_group())
        return time.perf_counter() - t0

    def load_train_state(self, path: Union[str, Path], version: int) -> float:
        """Read what :meth:`save_train_state` wrote (every rank of a gang of the same layout calls it) and
        become actor ``version``. Returns seconds."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        state = self._train_state("load_train_state")          # the layout to fill, this rank's shards
        dcp.load(state, checkpoint_id=str(path), process_group=self._dcp_group())
        self._set_train_state(state, version)
        return time.perf_counter() - t0

    def train_state_shard(self) -> dict:
        """This rank's part of the training state as plain CPU tensors, with its version: what a recovery snapshot
        writes (:meth:`save_snapshot`) and :meth:`restore_train_state_shard` takes back."""
        state = self._train_state("train_state_shard")
        return {"version": self.version,
                "state": tree_map(state, lambda t: local_part(t).detach().to("cpu", copy=True))}

    def save_snapshot(self, folder: Union[str, Path], version: int) -> float:
        """Copy this rank's training state (:meth:`train_state_shard`) and write it to ``folder`` on this node's disk
        in the background (:mod:`bidirl.cluster.engines.workers.snapshot_files`); :meth:`flush_snapshot` waits for the
        write. Returns the seconds of the copy (what the caller waits for)."""
        if int(version) != self.version:
            raise ValueError(f"save_snapshot: this engine holds version {self.version}, not {version}")
        t0 = time.perf_counter()
        self._snapshots.write(folder, self.version, self.rank, self.train_state_shard())
        return time.perf_counter() - t0

    def flush_snapshot(self) -> dict:
        """Wait for the snapshot write in flight; its report (``version``, ``bytes``, ``seconds``), ``{}`` if none."""
        return self._snapshots.flush()

    def load_snapshot(self, folder: Union[str, Path], version: int) -> float:
        """Take back the snapshot ``version`` this rank wrote to ``folder`` (a restarted rank of the same gang
        layout, on the same node). Returns seconds."""
        return self.restore_train_state_shard(snapshot_files.read(folder, version, self.rank))

    def restore_train_state_shard(self, shard: dict) -> float:
        """Take back what :meth:`train_state_shard` returned on the same rank of a gang of the same layout (the
        sharding comes from this engine's own parameters). Returns seconds."""
        t0 = time.perf_counter()
        template = self._train_state("restore_train_state_shard")
        try:
            state = rebuild(shard["state"], template)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"restore_train_state_shard: the shard does not fit this engine's state ({exc}); pass "
                             "train_state_shard() of the same rank of a gang with the same model and layout") from None
        self._set_train_state(state, shard["version"])
        return time.perf_counter() - t0

    def _dcp_group(self):
        return self._group if self._group is not None and self.world > 1 else None
