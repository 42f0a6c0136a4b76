"""The gang: a trainer rank's process group and FSDP2 sharding (paper §5; the ``TrainerEngine`` docstring,
"Sharding").

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: it sets the engine's ``mesh``,
``_group``, ``_transport_group``, ``rank``, ``world`` and ``replicas``, and uses its loading mixin to fill a model
built on the meta device.
"""

from __future__ import annotations

from typing import Optional

import torch

from bidirl.cluster.engines.workers import launch_order
from bidirl.cluster.engines.workers.trainer.tensors import on_meta
from bidirl.rl import model_folder as checkpoint


def rendezvous_timeout(backend: str):
    """How long a rank waits at the gang's rendezvous: what ``init_process_group`` gives a ``tcp://`` rendezvous
    for ``backend`` (torch's default process-group timeout; NCCL's own default for NCCL)."""
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    return default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout else default_pg_timeout


class Distribution:
    """Join a gang, shard over its device mesh, and leave it."""

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded with FSDP2 (after :meth:`init_process_group`, or bf16-mixed on first use)."""
        return self.mesh is not None

    def _reshard(self, model) -> None:
        """Free the unsharded weights a forward left gathered (FSDP2 keeps the root's after a forward-only pass)."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def listen(self, host: str) -> str:
        """Open the gang's rendezvous on this rank (rank 0, before any rank joins) and return its ``host:port``:
        a ``TCPStore`` listening on every interface of this node on a port the OS picks as it binds (port 0), with
        the timeout ``tcp://`` rendezvous gives. The engine keeps it, and :meth:`init_process_group` at this address
        joins through it, so the port is held from the moment it is named — never picked, released and bound again
        later, when anything else on the node could take it in between (the driver's weight-transfer stores listen
        the same way: ``weight_transport.Rendezvous``). ``host``: the address other nodes reach this one at."""
        import torch.distributed as dist

        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=rendezvous_timeout(self._backend()))
        self._rendezvous = (f"{host}:{store.port}", store)
        return self._rendezvous[0]

    def _rendezvous_store(self, addr: str, backend: str):
        """The store this rank joins the gang through: the one :meth:`listen` opened here at ``addr``, else a
        client of the store listening there (connecting with the rendezvous timeout while it is not up yet)."""
        import torch.distributed as dist

        if self._rendezvous is not None and self._rendezvous[0] == addr:
            return self._rendezvous[1]
        host, port = addr.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False, timeout=rendezvous_timeout(backend))

    def init_process_group(self, rank: int, world: int, addr: str, backend: Optional[str] = None,
                           replicas: int = 1) -> None:
        """Join a ``world``-rank gang through the rendezvous store at ``addr`` (``host:port``: rank 0's
        :meth:`listen`; gloo on CPU, NCCL on GPU) and shard the model with FSDP2 over a
        ``(replicas, world / replicas)`` mesh (package docstring); an engine built with ``gang=True`` reads only
        its shards from the checkpoint now.

        Call it before any other work (the optimizer is rebuilt over the sharded parameters).
        """
        import torch.distributed as dist

        if not (0 <= rank < world):
            raise ValueError(f"init_process_group: rank must be in [0, world), got rank={rank}, world={world}")
        if not addr.rpartition(":")[2].isdigit():
            raise ValueError(f"init_process_group: addr must be 'host:port', got {addr!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or world % replicas:
            raise ValueError(f"init_process_group: replicas must be a positive divisor of world={world}, "
                             f"got {replicas!r}")
        if self.sharded:
            raise RuntimeError("init_process_group: the engine is already sharded; join the gang before any work")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            backend = backend or self._backend()
            store = self._rendezvous_store(addr, backend)
            # every rank waits for the whole gang at the store, as tcp:// rendezvous's store waited for its clients
            # (a rank that never comes fails the others after the timeout, NCCL's eager init included)
            store.set(f"bidirl-gang/{world}/joined/{rank}", "1")
            store.wait([f"bidirl-gang/{world}/joined/{r}" for r in range(world)])
            # device_id: NCCL forms the communicator eagerly, here, not inside the first collective of a chunk
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    device_id=self.device if self.device.type == "cuda" else None)
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise RuntimeError(f"init_process_group: this process already is rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not rank {rank} of {world}")
        self._group = dist.group.WORLD
        self.rank, self.world, self.replicas = rank, world, replicas
        # the weight transport's gathers run beside training (on another thread): a group of their own
        self._transport_group = dist.new_group(backend=backend or self._backend()) if world > 1 else None
        for group in (self._group, self._transport_group):       # every rank forms both communicators now
            if group is not None and world > 1:
                torch.distributed.all_reduce(torch.zeros(1, device=self._comm_device()), group=group)
        self._shard(self._device_mesh(replicas, world // replicas))
        if self._transport_group is not None:       # two threads launch the gang's collectives: one order
            self._launches = launch_order.LaunchOrder(launch_order.gang_store(f"{addr}/{world}"), rank, world)
            for model in (self.model, self._reference):
                if model is not None:
                    launch_order.yield_at_blocks(checkpoint.transformer_blocks(model), lambda: self._launches)

    def _device_mesh(self, replicas: int, shard: int):
        from torch.distributed.device_mesh import init_device_mesh
        if replicas == 1:
            return init_device_mesh(self.device.type, (shard,), mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))

    def _shard_alone(self) -> None:
        """Shard over a one-rank group of this process (bf16-mixed compute needs FSDP2 even without a gang)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(self._backend(), store=dist.HashStore(), rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            raise RuntimeError(f"TrainerEngine: precision 'bf16-mixed' shards the model, and this process is in a "
                               f"group of {dist.get_world_size()} ranks; call init_process_group(rank, world, addr) "
                               "on every rank of the gang before any work")
        self._group = dist.group.WORLD
        self._shard(self._device_mesh(1, 1))

    def _shard(self, mesh) -> None:
        """Shard the model (and the reference) over ``mesh``; one still on the meta device (``gang=True``) is then
        filled with this rank's shards alone."""
        if self.optimizer is not None and self.optimizer.state:
            raise RuntimeError("TrainerEngine: shard the model before the first optimizer step")
        self.mesh = mesh
        for model in (self.model, self._reference):
            if model is not None:
                self._fully_shard(model)
                if on_meta(model):
                    self._materialise(model)
        self._pending = False
        self._track_parameters()

    def _load_if_pending(self) -> None:
        """An engine built for a gang (``gang=True``) asked for work before joining one: load it as a lone engine
        (sharded over its own one-rank group when it computes in bf16-mixed, whole otherwise)."""
        if not self._pending:
            return
        if self.precision == "bf16-mixed":
            self._shard_alone()
            return
        for model in (self.model, self._reference):
            if model is not None:
                self._materialise(model)
        self._pending = False
        self._track_parameters()

    def _fully_shard(self, model) -> None:
        """FSDP2 over the engine's mesh: each transformer block, then the root; gradients reduced as sums."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if self.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        for block in checkpoint.transformer_blocks(model):
            fully_shard(block, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)                   # sum, not mean, over the gang
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)      # plain SUM collectives (gloo has no PREMUL_SUM)
                elif self._backend() == "gloo":
                    raise RuntimeError("TrainerEngine: this torch's FSDP2 cannot reduce gradients as sums over gloo "
                                       "(no set_force_sum_reduction_for_comms); use torch >= 2.8")

    def destroy_process_group(self) -> None:
        """Leave the gang's process group (the engine cannot run sharded work afterwards)."""
        import torch.distributed as dist

        if self._group is not None and dist.is_initialized() and self.world > 1:
            dist.destroy_process_group()
        self._group = None
        self._launches = None
        self._rendezvous = None
        self.rank, self.world = 0, 1
