"""Real engines plugged into the pool driver: the :class:`~bidirl.cluster.backend.WorkerBackend` of engine runs.

:class:`EngineBackend` answers the pool driver's calls by concern, each a module of its own:

* the workers' life — placement, start-up, kept workers, a lost worker's restart (:mod:`.placement`);
* the rollouters' work (:mod:`.rollouts`) and the trainer gangs' (:mod:`.training`);
* the state moved — versions and weight loads (:mod:`.weight_loads`, over :mod:`.weight_sync`), a pool's hot switch
  (:mod:`.switching`), auxiliary windows (:mod:`.gradient_windows`) and a lost primary gang's recovery
  (:mod:`.trainer_recovery`);

and keeps here what the run records around them: the kept workers' shape, the checkpoint's identity and trainer
state, the summary and the end of the run.
"""

from __future__ import annotations

from typing import Optional

from bidirl.cluster.backend import WorkerBackend
from bidirl.cluster.engines.placement import EnginePlacement
from bidirl.cluster.engines.rollouts import EngineRollouts
from bidirl.cluster.engines.switching import EngineSwitch
from bidirl.cluster.engines.training import EngineTraining
from bidirl.cluster.engines.weight_loads import WeightLoads
from bidirl.cluster.recovery import root_cause
from bidirl.core import protocol as P

PRIMARY_TRAINER = P.PRIMARY_TRAINER


class EngineBackend(WorkerBackend):
    """The engine workers of one run under ``pool`` (an :class:`~bidirl.cluster.engines.driver.EngineDriver`, whose
    settings, versions and transfers it reads): module doc."""

    uses_gpus = True

    def __init__(self, pool):
        super().__init__(pool)
        self.placement = EnginePlacement(self)
        self.loads = WeightLoads(self)
        self.rollouts = EngineRollouts(self)
        self.training = EngineTraining(self)
        self.switching = EngineSwitch(self)

    # ---- the interface, by concern ------------------------------------------------------------
    def place(self) -> None:
        self.placement.place()

    def spawn(self, worker: str) -> None:
        self.placement.spawn(worker)

    def discard(self, worker: str) -> None:
        self.placement.discard(worker)

    def restore(self, worker: str, then) -> None:
        self.placement.restore(worker, then)

    def begin(self) -> None:
        self.placement.begin()

    def generate(self, cmd: P.Generate) -> None:
        self.rollouts.generate(cmd)

    def interrupt(self, cmd: P.Interrupt) -> None:
        self.rollouts.interrupt(cmd)

    def start_step(self, cmd: P.StartStep) -> None:
        self.training.start_step(cmd)

    def run_chunk(self, cmd: P.RunChunk) -> None:
        self.training.run_chunk(cmd)

    def merge_gradients(self, cmd: P.MergeGradients) -> None:
        self.training.merge_gradients(cmd)

    def optimizer_step(self, cmd: P.OptimizerStep) -> None:
        self.training.optimizer_step(cmd)

    def switch(self, cmd: P.Switch) -> None:
        self.switching.switch(cmd)

    def sync_weights(self, cmd: P.SyncWeights) -> None:
        self.loads.sync_weights(cmd)

    def refresh_weights(self, cmd: P.RefreshWeights) -> None:
        self.loads.refresh(cmd)

    def is_death(self, exc: Exception) -> bool:
        """A receiver whose weight transfer broke off holds half-loaded weights: it is restarted like a lost
        process (``WeightSync``), not treated as an engine error that ends the run."""
        return self.pool.sync.is_transfer_error(exc)

    # ---- the timeline -------------------------------------------------------------------------
    def wall(self, t: float) -> float:
        """A worker's wall-clock time on the run's timeline."""
        return t - self.pool.t0

    def record_spans(self, reply, kind: str, lane: Optional[str] = None, step=None, **detail):
        """Put an actor reply's self-recorded spans on the timeline (on ``lane``, default the worker's)."""
        for sp in reply.spans:
            self.pool.span(lane or sp["worker"], kind, self.wall(sp["start"]), self.wall(sp["end"]),
                           dict(sp["detail"], **detail), step=step)

    # ---- what the run records around its workers ----------------------------------------------
    def shape(self) -> dict:
        from bidirl.cluster.engines.workers.trainer import settings_from
        d, cfg = self.pool, self.pool.config
        return dict(model_dir=str(d.model_dir), **d.rollout.shape(), seed=cfg.seed, lr=cfg.rl.lr,
                    kl_coef=cfg.rl.kl_coef, clip_eps=cfg.rl.clip_eps,
                    activation_checkpointing=cfg.rl.activation_checkpointing,
                    publish_dtype=self.placement.publish_dtype(PRIMARY_TRAINER), route_replay=cfg.route_replay,
                    **settings_from(cfg.rl))

    def identity(self) -> dict:
        """The model folder's identity, and the prompt file's SHA-256 and rows (group ``g`` is row ``g mod rows``)
        or the built-in task's seed."""
        from bidirl.rl.model_folder import model_identity
        from bidirl.runtime.checkpoints import file_sha256
        d = self.pool
        source = d.prompts.source
        path = getattr(source, "path", None)
        data = ({"task": type(source).__name__, "seed": d.config.seed} if path is None
                else {"file_sha256": file_sha256(path), "rows": int(source.size)})
        return {"model": dict(model_identity(d.model_dir), name=d.config.model), "data": data}

    def save_trainer_state(self, folder) -> bool:
        """Every primary rank writes its shards of weights and AdamW state (``torch.distributed.checkpoint``)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        from bidirl.runtime.checkpoints import CheckpointSkipped
        d = self.pool
        if PRIMARY_TRAINER in d.failed:
            raise CheckpointSkipped("the primary trainer is being restarted")
        ranks = d.gangs[PRIMARY_TRAINER]
        try:
            ray.get([r.save_train_state.remote(str(folder)) for r in ranks], timeout=d.stall_timeout)
        except (RayActorError, RayTaskError, GetTimeoutError) as exc:
            # a rank died (recovered through its next call) or could not write: this boundary has no checkpoint
            raise CheckpointSkipped(f"the primary trainer could not save its state: {root_cause(exc)}") from None
        return True

    def close(self) -> None:
        """Keep the final weights for the run's result, then end the transfers and the recovery snapshots."""
        import ray
        d = self.pool
        last = max(d.weights)
        if d.final_weights is None and d.weights.get(last) is not None:
            try:
                d.final_weights = ray.get(d.weights[last], timeout=60)
            except Exception:
                d.final_weights = None
        elif d.final_weights is None and d.sync.collective and d.finished and PRIMARY_TRAINER not in d.failed:
            # the run's result holds the final weights: gathered once from the primary gang (onloaded for it)
            ranks = d.gangs.get(PRIMARY_TRAINER) or []
            try:
                ray.get([r.onload.remote() for r in ranks], timeout=d.start_timeout)
                d.final_weights = ray.get([r.weights.remote() for r in ranks], timeout=d.start_timeout)[0]
            except Exception:
                d.final_weights = None
        d.sync.shutdown()
        d.windows.shutdown()
        d.recovery.cleanup()

    def run_state(self) -> dict:
        return {"route_replay": self.pool.route_tally.state()}

    def take_run_state(self, state: dict) -> None:
        tally = self.pool.route_tally
        if "route_replay" in state:
            tally.restore(state["route_replay"])
        elif tally.on:
            raise ValueError("the checkpoint has no route replay counts (written before R3 was counted), and this run "
                             "replays routes; resume it with rl.route_replay: false or start the run anew")

    def summarize(self, out: dict) -> None:
        d = self.pool
        costs = out["costs"]
        out["startup"] = costs.pop("start", {})             # seconds to construct each kind of worker
        out["weight_sync"] = costs.pop("weight_sync", {}).get("rollout")
        out["weight_transport"] = d.sync.summary(out["weight_sync"])
        out["recovery"] = d.recovery.summary()
        out["aux_gradients"] = (d.windows.summary() if d.sync.collective
                                else {"path": "object store", "windows": None, "senders": None, "transfers": None,
                                      "bytes": None})
        out["emulated"] = False
        out["reward"] = [s["reward"] for s in d.step_stats]
        out["train"] = list(d.step_stats)
        gaps = [s["logprob_diff_max"] for s in d.step_stats if s["logprob_diff_max"] is not None]
        out["logprob_diff_max"] = max(gaps) if gaps else None
        plain = [s["logprob_diff_max_no_r3"] for s in d.step_stats if s.get("logprob_diff_max_no_r3") is not None]
        out["logprob_diff_max_no_r3"] = max(plain) if plain else None
        out["route_replay"] = d.route_tally.summary()
        out["model_dir"] = d.model_dir
        out["rollout_engine"] = dict(d.rollout.summary(), kv_cache_tokens_allocated=dict(d.kv_allocated))
        out["reward_function"] = d.reward.name
        out["data_file"] = d.config.workload.data_file
