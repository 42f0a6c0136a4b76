"""The trainer's weights leaving and entering it: full state dicts, published versions, and the weight transport's
send and receive (paper §3.2, §6.2; :mod:`bidirl.cluster.engines.workers.weight_transport`).

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: it keeps ``published`` (actor
version → this rank's shards in the wire dtype) and uses the gang's transport group.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from bidirl.cluster.engines.workers.launch_order import gang_call
from bidirl.cluster.engines.workers.trainer.offload import PUBLISHED_VERSIONS
from bidirl.cluster.engines.workers.trainer.tensors import (checkpoint_tensors, is_dtensor, local_part,
                                                             local_slice)
from bidirl.rl import model_folder as checkpoint


class Weights:
    """State dicts, ``publish``, ``send_weights`` and ``receive_weights``."""

    @gang_call
    def state_dict(self) -> dict:
        """The full weights under the HF checkpoint's names, on CPU (the tied ``lm_head.weight`` included, as
        vLLM's reload needs; an MoE model's fused experts split per expert, ``model_folder.split_experts``). On a sharded gang every rank must call it: rank 0 gets the weights, the others
        ``{}``."""
        self._ready("state_dict")
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        else:
            state = self.model.state_dict()
        weights = checkpoint.split_experts(checkpoint.hf_weights(state, self.tied))   # an MoE model's, per expert
        return {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}

    def load_state_dict(self, state: dict, version: Optional[int] = None) -> float:
        """Overwrite the weights with full weights (HF names, e.g. :meth:`state_dict` of another trainer of the
        model); a sharded rank copies its own shards (no communication). Returns the seconds spent."""
        self._ready("load_state_dict")
        t0 = time.perf_counter()
        self._wait_state_copy("load_state_dict")
        targets = {checkpoint.hf_name(k): v for k, v in self.model.state_dict(keep_vars=True).items()}
        weights = checkpoint.fuse_experts(checkpoint.hf_weights(state, self.tied), targets)
        missing = [k for k in targets if k not in weights and not (k == "lm_head.weight" and self.tied)]
        unexpected = [k for k in weights if k not in targets]
        wrong = [f"{k} {tuple(weights[k].shape)} != {tuple(t.shape)}" for k, t in targets.items()
                 if k in weights and tuple(weights[k].shape) != tuple(t.shape)]
        if missing or unexpected or wrong:
            raise ValueError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, shape "
                             f"mismatches {wrong[:5]}; pass the state_dict() of a trainer of the same model")
        with torch.no_grad():
            for k, t in targets.items():
                if k in weights:
                    local_part(t).copy_(local_slice(weights[k].to(t.dtype), t))
        if version is not None:
            self.version = int(version)
        return time.perf_counter() - t0

    def named_weights(self) -> dict:
        """``{checkpoint name: parameter or persistent buffer}`` of the trained model, each tensor once (a tied
        head is the embedding's parameter: the transport delivers it under both names)."""
        self._load_if_pending()
        return checkpoint_tensors(self.model)

    def publish(self, version: int, dtype: str, keep: Sequence[int] = ()) -> int:
        """Keep this rank's shards of the current weights, cast to the wire ``dtype``, as actor ``version`` — what
        :meth:`send_weights` sends whatever the engine does next (a rollouter may need a version after the next
        optimizer step changed the weights: §3.2's sync follows the step, and a restarted rollouter's load may come
        later still). Versions other than ``version`` and ``keep`` are dropped. On CPU in fp32 this is a copy of
        the shards; on GPU a bf16 copy on the device. While the engine is offloaded they sit in its host buffer
        (:meth:`offload`, the same code on every device) and sends read them there. Returns the
        bytes kept for ``version``. Every rank of a gang calls it (no communication)."""
        from bidirl.cluster.engines.workers.weight_transport import DTYPES
        if dtype not in DTYPES:
            raise ValueError(f"TrainerEngine.publish: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self._check_onloaded("publish")
        wanted = {int(v) for v in keep} | {int(version)}
        if len(wanted) > PUBLISHED_VERSIONS:
            raise ValueError(f"TrainerEngine.publish: at most {PUBLISHED_VERSIONS} versions are kept (the newest and "
                             f"the one before it; the host buffer is sized for them), asked for {sorted(wanted)}")
        shards = {}
        with torch.no_grad():
            for name, t in self.named_weights().items():
                shards[name] = (local_part(t).detach().to(DTYPES[dtype], copy=True),
                                self._dim0_sharding(name, t) if is_dtensor(t) else None)
        published = {v: p for v, p in self.published.items() if v in wanted}     # a new dict: a send in flight
        published[int(version)] = shards                                            # keeps what it reads
        self.published = published
        return sum(t.numel() * t.element_size() for t, _ in shards.values())

    def _dim0_sharding(self, name: str, param) -> int:
        """The global row count of a parameter FSDP2 shards by rows (``Shard(0)``, replicated across replicas);
        checks that this rank holds rows ``[j·c, min(N, (j + 1)·c))``, c = ⌈N / S⌉, j its index in the replica —
        ``torch.chunk``'s split, which :meth:`_gather_bucket` reassembles."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        placements = tuple(param.placements)
        if placements[-1] != Shard(0) or any(p != Replicate() for p in placements[:-1]):
            raise ValueError(f"publish: {name} is sharded as {placements}; the weight transport gathers FSDP2's "
                             "row sharding (Shard(0), replicated across replicas) only")
        n, shards = int(param.shape[0]), int(self.mesh.shape[-1])
        chunk = -(-n // shards)
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        j = self.rank % shards
        if int(offset[0]) != min(n, j * chunk) or int(shape[0]) != max(0, min(n, (j + 1) * chunk) - j * chunk):
            raise ValueError(f"publish: {name}'s shard on rank {self.rank} holds rows {offset[0]}+{shape[0]} of {n}, "
                             f"not torch.chunk's split over {shards} ranks")
        return n

    def _gather_bucket(self, shards: dict, names: Sequence[str]) -> list:
        """Full tensors of ``names`` from published ``shards``: one all-gather of the bucket's row shards (each
        padded to ⌈N / S⌉ rows) over the gang's transport group, replica 0's pieces concatenated and cut to N rows
        (every rank calls it with the same names). Touches no live parameter: it runs beside training."""
        import torch.distributed as dist

        dev = self._comm_device()
        parts, pieces = [], []
        shards_per_replica = int(self.mesh.shape[-1]) if self.mesh is not None else 1
        for name in names:
            local, rows = shards[name]
            local = local.to(dev)
            if rows is None:
                parts.append((local, None))
                continue
            chunk = -(-rows // shards_per_replica)
            padded = torch.zeros((chunk,) + tuple(local.shape[1:]), dtype=local.dtype, device=dev)
            padded[:local.shape[0]] = local
            pieces.append(padded.reshape(-1))
            parts.append((padded, rows))
        if pieces:
            flat = torch.cat(pieces)
            gathered = [torch.empty_like(flat) for _ in range(self.world)]
            dist.all_gather(gathered, flat, group=self._transport_group)
        out, offset = [], 0
        for local, rows in parts:
            if rows is None:
                out.append(local)
                continue
            n = local.numel()
            full = torch.cat([gathered[j][offset:offset + n].view(local.shape) for j in range(shards_per_replica)])
            out.append(full[:rows])
            offset += n
        return out

    def send_weights(self, transfer) -> dict:
        """Send published version ``transfer.version`` to the transfer's receivers: every rank of the gang calls it
        (the gathers are collectives over the gang's transport group, bucket by bucket); rank 0 sends
        (:func:`weight_transport.send_buckets`). It reads only what :meth:`publish` kept, so it may run beside
        training (the actor runs it on a thread of its own). A receiver that dies or times out is dropped, never
        an error here; returns rank 0's report."""
        from bidirl.cluster.engines.workers import weight_transport as wt
        version = int(transfer.version)
        shards = self.published.get(version)
        if shards is None:
            raise ValueError(f"send_weights: version {version} is not published on this rank (published: "
                             f"{sorted(self.published)}); publish(version, dtype) after the optimizer step")
        wanted = transfer.layout.shapes()
        aliases = dict(transfer.layout.aliases)
        missing = sorted(k for k in wanted if k not in shards and k not in aliases)
        wrong = sorted(k for k in wanted
                       if k in shards and tuple(self._global_shape(k, *shards[k])) != tuple(wanted[k]))
        if missing or wrong or any(t.dtype != transfer.layout.torch_dtype for t, _ in shards.values()):
            raise ValueError(f"send_weights: the layout does not fit this model (missing {missing[:5]}, shape "
                             f"mismatches {wrong[:5]}, or another dtype than {transfer.layout.dtype}); build it from "
                             "this trainer's model folder (weight_transport.model_layout)")
        broadcast = agree = None
        turn = self._transport_turn
        if self.world > 1:
            import torch.distributed as dist

            def broadcast(n: int) -> int:
                flag = torch.tensor([n], dtype=torch.int64, device=self._comm_device())
                with turn():
                    dist.broadcast(flag, src=0, group=self._transport_group)
                return int(flag.item())

            def agree(t) -> None:
                with turn():
                    wt.check_same_transfer(t.tid, t.version, self.rank, self._transport_group, self._comm_device())

        def gather(names):
            with turn():                 # one bucket's gather per turn: it slips in between two blocks of a chunk
                return self._gather_bucket(shards, names)
        with torch.no_grad(), self._reading_published(shards):
            return wt.send_buckets(transfer, self.rank, gather, self._comm_device(), broadcast, agree)

    def _transport_turn(self):
        """A ``transport`` turn of the gang's launch order (:mod:`~bidirl.cluster.engines.workers.launch_order`);
        nothing to order on a gang of one."""
        from contextlib import nullcontext

        from bidirl.cluster.engines.workers.launch_order import TRANSPORT
        return self._launches.turn(TRANSPORT) if self._launches is not None else nullcontext()

    @staticmethod
    def _global_shape(name: str, local: torch.Tensor, rows) -> tuple:
        return tuple(local.shape) if rows is None else (int(rows),) + tuple(local.shape[1:])

    def receive_weights(self, transfer, rank: int) -> dict:
        """Load ``transfer.version`` as receiver ``rank`` (an auxiliary gang's ranks each receive every bucket and
        copy their own shards in: no communication within the gang). Returns the receiver's report."""
        from bidirl.cluster.engines.workers import weight_transport as wt
        self._ready("receive_weights")
        t0 = time.perf_counter()
        self._wait_state_copy("receive_weights")
        weights = self.named_weights()
        shapes = transfer.layout.shapes()
        missing = sorted(k for k in weights if k not in shapes)
        wrong = sorted(k for k in shapes if k in weights and tuple(weights[k].shape) != tuple(shapes[k]))
        unexpected = sorted(k for k in shapes if k not in weights and k != "lm_head.weight")
        receiver = wt.Receiver(transfer, rank, self._comm_device())
        if missing or wrong or unexpected:
            receiver.abandon("layout mismatch")
            raise ValueError(f"receive_weights: the weights sent do not fit this model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, shape mismatches {wrong[:5]}")
        receiver.connect()
        with torch.no_grad():
            for name, full in receiver.items():
                t = weights.get(name)
                if t is not None:
                    local_part(t).copy_(local_slice(full.to(t.dtype), t))
        self.version = int(transfer.version)
        return dict(receiver.close(), seconds=time.perf_counter() - t0)
