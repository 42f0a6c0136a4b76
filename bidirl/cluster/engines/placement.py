"""The engine backend's workers: where they sit, how they start, and how a lost one comes back (§3.2, "Failures").

Every worker is started once and kept, each holding half of its bundle: ``rollout_pool/rollouter/<i>`` and
``trainer_pool/rollouter/<i>`` one :class:`RolloutActor` (vLLM) each; ``trainer_pool/trainer`` and
``rollout_pool/trainer`` a *gang* of :class:`TrainerActor` ranks, one per GPU slot of the pool (``d`` replicas of
ρ_t ranks; one process group per gang, gloo on CPU, NCCL on GPU; the model sharded with FSDP2 within a replica and
replicated across replicas). Auxiliary workers start offloaded. A run given kept workers (``KeptWorkers``) takes
them and resets each to a fresh engine's state instead. A resumed run's primary gang loads the checkpoint's trainer
state; a restarted primary gang its recovery point and the steps since (:mod:`.trainer_recovery`).
"""

from __future__ import annotations

import time

from bidirl.cluster.errors import ClusterError
from bidirl.cluster.recovery import root_cause
from bidirl.core import protocol as P

PRIMARY_TRAINER, AUX_TRAINER = P.PRIMARY_TRAINER, P.AUX_TRAINER


class EnginePlacement:
    """The workers of one engine run (module doc). ``backend``: the
    :class:`~bidirl.cluster.engines.backend.EngineBackend`."""

    def __init__(self, backend):
        self.backend, self.pool = backend, backend.pool

    def place(self):
        """Start every worker (or adopt the kept ones) and wait until they are ready; auxiliaries offloaded; in a
        resumed run the primary gang loads the checkpoint (:meth:`resume`)."""
        d = self.pool
        if d.workers is not None:
            self.adopt()
        else:
            for w in d.topology.workers:
                self.spawn(w)
            self.wait_ready()
            self.join_gangs()
            self.passivate()
        self.resume()

    def adopt(self):
        """Take the kept workers of an earlier run (``workers``) and reset each to a fresh engine's state."""
        d = self.pool
        import ray
        kept = d.workers
        d.actors = dict(kept.actors)
        d.gangs = {g: list(r) for g, r in kept.gangs.items()}
        try:
            ray.get([a.reset.remote(reward_fn=d.reward) for a in d.actors.values()]     # the rollouters
                    + [a.reset.remote() for g in d.gangs.values() for a in g], timeout=d.start_timeout)
        except Exception as exc:
            raise ClusterError(f"the kept workers could not be reset: {root_cause(exc)}; release them "
                               "(Workers.release) and start new ones") from None
        for w in d.topology.workers:
            d.versions[w] = 0
        self.passivate()

    def bundles(self, worker: str) -> list:
        """The placement-group bundles a worker's actors sit on: a rollouter's first slot, one per gang rank."""
        d = self.pool
        env = d.plan.envelope
        g_r = env.rollout_gpus
        if worker in d.gangs:
            # a trainer gang has one rank per GPU slot of its pool: d replicas of ρ_t ranks (FSDP2, see join_gangs)
            ranks = d.topology.gang_size(worker) * env.trainer_layout
            first = g_r if P.is_primary(worker) else 0
            return [first + j for j in range(ranks)]
        i = int(worker.rsplit("/", 1)[1])
        return [(0 if P.worker_pool(worker) == P.ROLLOUT_POOL else g_r) + i * env.rollout_layout]

    def spawn(self, worker: str) -> None:
        d = self.pool
        from bidirl.cluster.engines.workers.actors import RolloutActor, TrainerActor
        from bidirl.cluster.engines.workers.trainer import settings_from

        cfg = d.config
        bundles = self.bundles(worker)
        if worker in d.gangs:
            gpu = d.slots.resource() == "GPU"
            # a gang of several ranks builds the model on the meta device; each rank reads its shards when it joins
            kwargs = dict(lr=cfg.rl.lr, seed=cfg.seed, kl_coef=cfg.rl.kl_coef, clip_eps=cfg.rl.clip_eps,
                          device="cuda" if gpu else "cpu", threads="auto", role=P.worker_role(worker),
                          activation_checkpointing=cfg.rl.activation_checkpointing, gang=len(bundles) > 1,
                          publish_dtype=self.publish_dtype(worker), route_replay=cfg.route_replay,
                          **settings_from(cfg.rl))
            d.gangs[worker] = [TrainerActor.options(**d.slots.at(b)).remote(f"{worker}/{j}", d.model_dir, **kwargs)
                              for j, b in enumerate(bundles)]
        else:
            d.actors[worker] = RolloutActor.options(**d.slots.at(bundles[0])).remote(
                worker, d.model_dir, cfg.seed, reward_fn=d.reward, routes=cfg.route_replay,
                **d.rollout.engine_kwargs())
        d.versions[worker] = 0            # a fresh process holds the model folder's weights

    def publish_dtype(self, worker: str):
        """The wire dtype a trainer gang publishes in (the primary's, with the weight transport on; else None): its
        ranks size their host buffer for the published versions (``TrainerEngine.host_capacity``)."""
        d = self.pool
        return d.sync.dtype if P.is_primary(worker) and d.sync.collective else None

    def handles(self, worker: str) -> list:
        d = self.pool
        return list(d.gangs[worker]) if worker in d.gangs else [d.actors[worker]]

    def discard(self, worker: str) -> None:
        d = self.pool
        import ray
        for actor in self.handles(worker):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.backend.rollouts.forget(worker)
        d.sync.member_lost(worker)
        d.windows.member_lost(worker)

    def restore(self, worker: str, then) -> None:
        """A fresh worker: ready; a gang forms its process group; the primary trainer gets back the version the lost
        gang held (its recovery point and the steps since, replayed: :mod:`.trainer_recovery`); then it is
        offloaded or onloaded as its pool's lease has it (``passive``). Rollouters and the auxiliary gang keep
        the model folder's weights until their next command loads the version it needs."""
        d = self.pool
        handles = self.handles(worker)

        def settle(offloaded: bool = False):
            want = d.passive.get(worker, False)
            if want == offloaded:
                then()
                return
            method = "offload" if want else "onload"
            if want:
                self.backend.loads.forget_discarded([worker])
            d._when_all([(worker, getattr(a, method).remote()) for a in handles], lambda _: settle(want))

        def state():
            if worker != PRIMARY_TRAINER:
                settle()
                return
            calls, version = d.recovery.restore_calls(handles)
            d.versions[worker] = version
            d.sync.publish(handles, version)          # after the replay on each rank (calls run in order)
            # then the local updates the step under way had applied (rl.updates_per_sync): after the publish, so
            # the version's weights are what others load under its name
            calls += d.recovery.partial_calls(handles)
            d._when_all([(worker, c) for c in calls], lambda _: settle())

        def join(_ready):
            if worker not in d.gangs or len(handles) < 2:
                state()
                return
            layout = d.plan.envelope.trainer_layout

            def form(addr):
                d._when_all([(worker, r.init_process_group.remote(i, len(handles), addr, len(handles) // layout))
                             for i, r in enumerate(handles)], lambda _: state())
            d._submit(worker, handles[0].address.remote(), form)
        d._when_all([(worker, a.ready.remote()) for a in handles], join)

    def resume(self) -> None:
        """A resumed run: every rank of the primary gang loads the checkpoint's trainer state (sharded as written),
        publishes that version for the other workers' weight loads, and the checkpoint is the recovery point."""
        d = self.pool
        import ray
        found = d.resumed_from
        if found is None:
            return
        ranks = d.gangs[PRIMARY_TRAINER]
        try:
            ray.get([r.load_train_state.remote(str(found.trainer_dir), found.trainer_version) for r in ranks],
                    timeout=d.start_timeout)
            acks, weights = self.backend.loads.version_calls()
            ray.get(acks, timeout=d.start_timeout)
        except Exception as exc:
            raise ClusterError(f"the primary trainer could not load the checkpoint {found.path}: "
                               f"{root_cause(exc)}") from None
        self.backend.loads.keep_version(found.trainer_version, weights)
        d.recovery.from_checkpoint(found.trainer_dir, found.trainer_version)

    def named_actors(self) -> list:
        d = self.pool
        return list(d.actors.items()) + [(f"{g}/{j}", a) for g, ranks in d.gangs.items()
                                         for j, a in enumerate(ranks)]

    def wait_ready(self):
        """Every worker constructs its engine; the first failure is reported with the worker's name."""
        d = self.pool
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        from tqdm.auto import tqdm

        refs = {a.ready.remote(): name for name, a in self.named_actors()}
        deadline = time.time() + d.start_timeout
        with tqdm(total=len(refs), desc="starting workers", leave=False, disable=not d.progress) as bar:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(1.0, deadline - time.time()))
                if not ready:
                    raise ClusterError(f"workers {sorted(refs.values())} did not start within "
                                       f"{d.start_timeout:.0f} s; check the cluster's free CPUs/GPUs and memory "
                                       "(ray status)")
                for ref in ready:
                    name = refs.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except (RayActorError, RayTaskError, GetTimeoutError) as exc:
                        raise ClusterError(f"worker {name} failed to start: {root_cause(exc)}") from None
                    for sp in reply.spans:
                        d._measure(("start", name.rsplit("/", 1)[0]), sp["end"] - sp["start"])
                        if "kv_cache_tokens" in sp["detail"]:
                            d.kv_allocated[name] = sp["detail"]["kv_cache_tokens"]
                    bar.update(1)
        for name in list(d.actors) + list(d.gangs):
            d.versions[name] = 0

    def join_gangs(self):
        """Each gang of several ranks forms its process group and shards the model with FSDP2: sharded within a
        replica of ρ_t ranks, replicated across its replicas (as the planner sized a replica)."""
        d = self.pool
        import ray
        layout = d.plan.envelope.trainer_layout
        for gang, ranks in d.gangs.items():
            if len(ranks) > 1:
                addr = ray.get(ranks[0].address.remote())
                ray.get([r.init_process_group.remote(i, len(ranks), addr, len(ranks) // layout)
                         for i, r in enumerate(ranks)], timeout=d.start_timeout)

    def passivate(self):
        """Auxiliary workers start passive: their state is offloaded until a switch brings them in."""
        d = self.pool
        import ray
        aux = [d.actors[w] for w in d.topology.aux_rollouters] + d.gangs[AUX_TRAINER]
        self.backend.loads.forget_discarded(d.topology.aux_rollouters)
        ray.get([a.offload.remote() for a in aux], timeout=d.start_timeout)

    def begin(self):
        d = self.pool
        if d.sync.collective and d.gangs[AUX_TRAINER]:
            import ray
            d.windows.pair(*(ray.get([r.shard_signature.remote() for r in d.gangs[g]], timeout=d.start_timeout)
                             for g in (PRIMARY_TRAINER, AUX_TRAINER)))
        d.t0 = time.time() - d.clock_start
        if d.recovery.point[0] == "model":     # version 0 (the model folder's) is what the primary gang publishes first
            d.sync.publish(d.gangs[PRIMARY_TRAINER], 0)
