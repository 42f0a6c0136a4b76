"""Ray start-up and the GPU slots a Ray run's workers sit on (the pool driver's placement; paper §3.2).

Pools map to one placement group over ``G`` GPU slots — the logical resource ``gpu_slot`` on a machine without
GPUs, ``GPU`` on real hardware — reserved once (placement groups cannot be resized) and split by bundle index:
bundles ``[0, g_r)`` are the rollout pool, ``[g_r, G)`` the trainer pool. Each worker holds half of the bundle it
sits on (:meth:`RaySlots.at`). :class:`RaySlots` starts an embedded Ray (or checks the one connected), reads which
resource the slots are, reserves the group and places actors on its bundles; the pool driver holds one
(``PoolDriver.slots``).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

from bidirl.cluster.errors import ClusterError
from bidirl.errors import ConfigError

#: logical CPUs each logical GPU slot's bundle reserves (engines on CPU: many workers share a few cores)
BUNDLE_CPU = 0.1
#: CPUs of each GPU node that ``cluster.cpus_per_gpu: auto`` leaves to the driver and Ray's own processes
RESERVED_CPUS = 2


def workers_at_driver_priority() -> None:
    """Before this process starts a Ray of its own (embedded): its worker processes — the engines — will run at this
    process's priority (``RAY_worker_niceness``, unless the user set it). Ray lowers every worker to niceness 15,
    below its driver and control plane; on a machine that also runs anything else at the usual priority the
    engines then get ≈ 3 % of the CPU (CFS weights 1024 for niceness 0 against 36 for 15): a test run that took
    36 s on a quiet 2-core machine had not finished after 9 minutes beside two busy loops. A cluster started
    elsewhere (``address``) keeps its own setting."""
    os.environ.setdefault("RAY_worker_niceness", str(os.nice(0)))


def gpu_bundle_cpus(setting, nodes) -> float:
    """The logical CPUs each GPU's bundle reserves on real GPUs, for ``cluster.cpus_per_gpu`` = ``setting`` on a
    cluster whose nodes have ``nodes`` = ``[(CPUs, GPUs), ...]`` (nodes without GPUs hold no bundle): ``"auto"`` is
    ⌊(CPUs − RESERVED_CPUS) / GPUs⌋ on the tightest node (never below :data:`BUNDLE_CPU`); a number is taken as it
    is if every node has that many CPUs per GPU (else a :class:`ConfigError`: the bundles could never be placed).
    The slot's two workers (§3.2) request half each (:meth:`RaySlots.at`); Ray sets their ``OMP_NUM_THREADS`` from
    it, and the trainer its torch threads (``TrainerEngine.host_threads``)."""
    nodes = [(float(c), float(g)) for c, g in nodes if g > 0]
    if not nodes:
        raise ValueError("gpu_bundle_cpus: no node with GPUs")
    if setting == "auto":
        return max(BUNDLE_CPU, min(math.floor((c - RESERVED_CPUS) / g) for c, g in nodes))
    cpus, gpus = min(nodes, key=lambda n: n[0] / n[1])
    if setting * gpus > cpus:
        raise ConfigError("cluster.cpus_per_gpu", f"{setting:g} CPUs for each GPU, but a node of the cluster has "
                          f"{cpus:g} CPUs for {gpus:g} GPUs", f"set at most {cpus / gpus:g}, or auto")
    return float(setting)




class RaySlots:
    """The GPU slots of one Ray run (module doc). ``config``: the job; ``uses_gpus()``: whether the run's kind of
    worker runs on real GPUs when the cluster offers enough of them (the backend's ``uses_gpus``, read when first
    needed: the backend is plugged in after the driver is built)."""

    def __init__(self, config, uses_gpus: Callable[[], bool]):
        self.config, self.uses_gpus = config, uses_gpus
        self.pg = None                                  # the placement group, once reserved (or taken from kept workers)
        self.resource_name: Optional[str] = None        # resource(), read from the cluster once
        self._bundle_cpus: Optional[float] = None       # bundle_cpus(), read from the cluster once

    def resource(self) -> str:
        """``GPU`` when the workers use GPUs and the cluster offers enough of them and no logical slots, else
        ``gpu_slot`` (read once)."""
        if self.resource_name is None:
            gpu = False
            if self.uses_gpus():
                import ray
                res = ray.cluster_resources()
                gpu = res.get("GPU", 0) >= self.config.cluster.gpus and not res.get("gpu_slot")
            self.resource_name = "GPU" if gpu else "gpu_slot"
        return self.resource_name

    def start(self, address: Optional[str]) -> None:
        """Connect to the Ray cluster at ``address``, or start an embedded one with the job's slots, and check that
        it offers ``cluster.gpus`` of them."""
        import ray
        G = self.config.cluster.gpus
        # The metrics agent is not needed here and, on a loaded small machine, its start-up can time out.
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        if not ray.is_initialized():
            if address:
                ray.init(address=address, namespace="bidirl", log_to_driver=False)
            else:
                workers_at_driver_priority()
                # each of the G bundles reserves BUNDLE_CPU logical CPUs: enough of them for every bundle
                for attempt in range(3):
                    try:
                        ray.init(num_cpus=max(4, os.cpu_count() or 1, math.ceil(BUNDLE_CPU * G) + 1),
                                 **self.local_slots(G), include_dashboard=False, log_to_driver=False,
                                 namespace="bidirl")
                        break
                    except Exception as exc:
                        # on a loaded machine the local node may miss Ray's fixed 30 s registration deadline
                        if "timed out during startup" not in str(exc):
                            raise
                        ray.shutdown()
                        if attempt == 2:
                            raise ClusterError("the local Ray node did not start in 3 tries (it must register "
                                               "within 30 s; this machine is too loaded now): retry when it is "
                                               "less busy, or start Ray yourself (ray start --head) and pass "
                                               "--address auto") from None
        have = ray.cluster_resources().get(self.resource(), 0)
        if have < G:
            raise ClusterError(f"the Ray cluster offers {have:g} '{self.resource()}' resources but cluster.gpus "
                               f"is {G}; start Ray with resources={{'{self.resource()}': {G}}} or lower cluster.gpus")

    def local_slots(self, gpus: int) -> dict:
        """``ray.init`` arguments that give an embedded local Ray its GPU slots: on a machine with enough CUDA
        devices, for workers that use GPUs, those as ``GPU`` resources; otherwise logical ``gpu_slot`` units."""
        if self.uses_gpus():
            import torch
            if torch.cuda.is_available() and torch.cuda.device_count() >= gpus:
                return {"num_gpus": int(gpus)}
        return {"resources": {"gpu_slot": float(gpus)}}

    def bundle_cpus(self) -> float:
        """Logical CPUs each GPU slot's bundle reserves: ``cluster.cpus_per_gpu`` (:func:`gpu_bundle_cpus`, over
        the connected cluster's GPU nodes) when the slots are real GPUs, :data:`BUNDLE_CPU` on logical slots."""
        if self._bundle_cpus is None:
            import ray
            self._bundle_cpus = BUNDLE_CPU if self.resource() != "GPU" else gpu_bundle_cpus(
                self.config.cluster.cpus_per_gpu,
                [(n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")])
        return self._bundle_cpus

    def reserve(self, timeout: float) -> None:
        """One placement group of ``G`` bundles: ``[0, g_r)`` the rollout pool, ``[g_r, G)`` the trainer pool."""
        import ray
        from ray.util.placement_group import placement_group

        G, res = self.config.cluster.gpus, self.resource()
        cpus = self.bundle_cpus()
        self.pg = placement_group([{res: 1.0, "CPU": cpus}] * G, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except Exception as exc:
            fix = " or lower cluster.cpus_per_gpu" if res == "GPU" else ""
            raise ClusterError(f"could not reserve {G} GPU slots of 1 {res} + {cpus:g} CPUs each within "
                               f"{timeout:.0f} s ({exc}); check the cluster's free resources{fix}") from None

    def release(self) -> None:
        """Remove the placement group (its actors end with it)."""
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            finally:
                self.pg = None

    def at(self, bundle: int, share: float = 0.5, cpus: Optional[float] = None) -> dict:
        """Actor options that place it on ``bundle`` holding ``share`` of its GPU slot and, unless ``cpus`` says
        otherwise, the same share of the bundle's CPUs (:meth:`bundle_cpus`)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        cpus = share * self.bundle_cpus() if cpus is None else cpus
        opts = {"num_cpus": cpus, "resources": {self.resource(): share},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}
        if self.resource() == "GPU":          # Ray places GPU shares through num_gpus
            opts["num_gpus"] = opts.pop("resources")["GPU"]
        return opts
