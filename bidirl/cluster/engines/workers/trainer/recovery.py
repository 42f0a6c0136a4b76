"""The training state saved and taken back: run checkpoints (``torch.distributed.checkpoint``) and recovery
snapshots on the node's disk (:mod:`bidirl.cluster.engines.workers.snapshot_files`; the driver's side is
:mod:`bidirl.cluster.engines.trainer_recovery`).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine` (primary ranks: an auxiliary one
holds no optimizer state). The snapshot's copy runs beside the next chunks (``_state_copy``): every call that
changes or frees the state waits for it first (``_wait_state_copy``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Union

from bidirl.cluster.engines.workers import snapshot_files
from bidirl.cluster.engines.workers.launch_order import gang_call
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

    @gang_call
    def save_train_state(self, path: Union[str, Path]) -> float:
        """Write weights and optimizer state into the folder ``path`` with ``torch.distributed.checkpoint``: on
        a gang every rank calls it and writes its own shards (one file per rank). Returns seconds."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(self._train_state("save_train_state"), checkpoint_id=str(path), process_group=self._dcp_group())
        return time.perf_counter() - t0

    @gang_call
    def load_train_state(self, path: Union[str, Path], version: int) -> float:
        """Read what :meth:`save_train_state` wrote (every rank of a gang of the same layout calls it) and
        become actor ``version``. Returns seconds."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self._wait_state_copy("load_train_state")
        state = self._train_state("load_train_state")          # the layout to fill, this rank's shards
        dcp.load(state, checkpoint_id=str(path), process_group=self._dcp_group())
        self._set_train_state(state, version)
        return time.perf_counter() - t0

    def _local_train_state(self, what: str) -> dict:
        """:meth:`_train_state` with this rank's local tensors in place of the DTensors (no copy)."""
        return tree_map(self._train_state(what), lambda t: local_part(t).detach())

    def train_state_shard(self) -> dict:
        """This rank's part of the training state as plain CPU tensors of its own, with its version (what a recovery
        snapshot holds; :meth:`restore_train_state_shard` takes it back). The copy is the snapshot's
        (:class:`~bidirl.cluster.engines.workers.state_copy.StateCopy`), waited for and cloned out of its buffer."""
        self._snapshots.flush()                     # a write in flight still reads the copy's buffer
        self._state_copy.start(self._local_train_state("train_state_shard"), self.device, self._snapshot_storages(),
                               self.host_capacity())
        return {"version": self.version, "state": tree_map(self._wait_state_copy("train_state_shard", changes=False),
                                                           lambda t: t.clone())}

    def save_snapshot(self, folder: Union[str, Path], version: int) -> float:
        """Start copying this rank's training state to host memory beside the next calls (the chunks that follow;
        :mod:`bidirl.cluster.engines.workers.state_copy`) and write it to ``folder`` on this node's disk once copied
        (:mod:`bidirl.cluster.engines.workers.snapshot_files`). Only a call that changes or frees the state
        (``apply``, ``offload``, a weight or state load) waits for the copy; :meth:`flush_snapshot` waits for the
        write. Returns the seconds the caller waited (the previous write, if still in flight, and the start)."""
        if int(version) != self.version:
            raise ValueError(f"save_snapshot: this engine holds version {self.version}, not {version}")
        t0 = time.perf_counter()
        self._snapshots.flush()                     # the previous write still reads the copy's buffer
        self._state_copy.start(self._local_train_state("save_snapshot"), self.device, self._snapshot_storages(),
                               self.host_capacity())
        held = int(self.version)
        self._snapshots.write(folder, held, self.rank, lambda: {"version": held, "state": self._state_copy.wait()})
        return time.perf_counter() - t0

    def _wait_state_copy(self, what: str, changes: bool = True):
        """Wait for the snapshot's copy in flight before ``what`` changes or frees the state; the seconds waited are
        kept in ``snapshot_waits[what]`` (the last wait of each kind). ``changes``: ``what`` changes the weights or
        the moments, so the host buffer no longer holds them as they are (``HostStash.invalidate``). Returns the
        copy (``None`` if none)."""
        t0 = time.perf_counter()
        copied = self._state_copy.wait()
        self.snapshot_waits[what] = time.perf_counter() - t0
        if changes:
            self._host.invalidate()
        return copied

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
        self._wait_state_copy("restore_train_state_shard")
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
