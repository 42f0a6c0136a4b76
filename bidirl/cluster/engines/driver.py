"""The Ray runtime with real engines: vLLM rollouters and torch trainers driven by the coordinator.

The same :class:`~bidirl.core.coordinator.Coordinator` as the simulator and the emulated runtime, fed by
completions of Ray calls with the wall clock (paper §3-§6). Placement follows
:class:`~bidirl.cluster.pool.PoolDriver`: one
placement group over the GPU slots (logical ``gpu_slot`` resources on a CPU machine, ``GPU`` on a GPU
cluster), bundles ``[0, g_r)`` the rollout pool and ``[g_r, G)`` the trainer pool. Every worker is started
once and kept, each holding half of its bundle:

* ``rollout_pool/rollouter/<i>`` and ``trainer_pool/rollouter/<i>``: one :class:`RolloutActor` (vLLM) each;
* ``trainer_pool/trainer`` and ``rollout_pool/trainer``: a *gang* of :class:`TrainerActor` ranks, one per GPU
  slot of the pool (``d`` replicas of ρ_t ranks; one process group per gang, gloo on CPU, NCCL on GPU; the
  model sharded with FSDP2 within a replica and replicated across replicas).

How each command runs:

* ``Generate`` — the groups' prompts come from ``workload.data_file`` (``bidirl.rl.data``: group ``g`` is row
  ``g mod prompt_pool`` or ``g mod`` the file's rows) or, without one, from the built-in ``ArithmeticTask``
  (problem ``g``, or ``g mod workload.prompt_pool``); a rollouter whose weights are older than the command's
  version loads them first. Rollouters run free: a busy rollouter has one ``RolloutActor.stream`` call in flight
  (a Ray streaming generator in the actor's own concurrency group), whose loop steps the engine back to back while
  it holds requests and yields each group as soon as it finishes — the engine never waits for a driver round trip
  between steps — and which ends once the rollouter holds no requests (the next ``Generate`` opens another). Every
  other call on the actor (start, interrupt, weight loads, offload / onload, reset) runs in the order sent and
  pauses the loop after its current step, keeping the engine's requests, so an ``Interrupt`` (sync point, lease
  revocation, migration) waits at most one engine step and the other groups go on generating after it. Each reply
  says whether requests are left and which start it saw, which tells the driver when the rollouter went idle.
  Completed groups carry token ids, log-probs and rewards — scored in the rollout actor by ``rl.reward``
  (``bidirl.rl.rewards``; a reward function that fails stops the run with a ``ClusterError`` naming it and the
  response). Unfinished groups come back as prefixes and resume without regenerating; sampling is position-keyed,
  so a response gets the same tokens whichever steps it shared with others, and a resumed one the tokens it would
  have got.
* ``StartStep`` — the step's groups (their token ids, log-probs and rewards) become the step's samples and
  GRPO advantages.
* ``RunChunk`` — each rank (device) of the gang takes ``per_device`` samples of the chunk: ``old_logprob`` /
  ``ref_logprob`` recompute log-probs, ``actor_update`` computes the chunk's GRPO gradient (step-level
  group-normalised advantages and loss normaliser), summed over the gang by FSDP2. Each rank keeps its shard
  in ``p.grad`` on its device, on an auxiliary gang too: when its window ends (the rollout pool switches back,
  before the gang is offloaded) each auxiliary rank sends its shard to the primary ranks holding it, one
  transfer per rank pair over the weight transport's machinery (:mod:`.gradient_windows`; measured: C_grad).
  With ``transport.weights: object_store`` an auxiliary gang instead gathers each chunk gradient and returns
  it, unsharded, as one object.
* ``MergeGradients`` — waits for windows still in flight (or moves the object-store gradients to every primary
  rank); ``OptimizerStep`` — each primary rank sums all update-chunk gradients and windows and takes one AdamW
  step; the sum equals the in-order sum up to fp32 summation order, so where a chunk ran never changes the
  update (§6.3).
* ``SyncWeights`` — the primary gang sends the new version to the target rollouters over the weight transport
  (:mod:`bidirl.cluster.engines.weight_sync`: buckets in the rollout dtype over a ``torch.distributed`` group per
  transfer, loaded in place by vLLM; Ray carries only metadata), or with ``transport.weights: object_store``
  through Ray's object store. Auxiliary workers and restarted ones receive the version they need the same way
  when they are switched in or next work.
* ``Switch`` — offload the passive role's state, onload the active one, and bring the active one's
  weights to the current version; a rollouter switched in wakes its weights, loads the version, then wakes
  its KV cache (vLLM sleep level 2 and wake by tags, trainer offload on GPU; on CPU the KV cache and the
  trainer's weights and optimizer state are really freed and restored). The measured durations are
  C_in / C_out, fed back to the profiler through ``SwitchFinished``; each phase's too (``costs``).

Every rollouter starts with the settings :class:`~bidirl.cluster.engines.rollout_setup.RolloutSetup` resolves
from the plan before any actor starts: the KV budget of the planner's memory model (or
``cluster.rollout_kv_cache_gib``), tensor parallelism ρ_r, CUDA graphs on GPU, prefix caching.

A busy period of a rollouter that ran only fresh groups becomes a ``RolloutRecord`` (§5.1); chunk times
come with ``ChunkFinished``: the profiler calibrates the stage-time models online from both.

With ``out_dir`` the run writes its output folder (``bidirl.results.tracking``): per-step metrics under veRL's names
to ``metrics.jsonl`` and TensorBoard while it runs, the trace, event log and summary when it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bidirl.cluster.engines.gradient_windows import GradientWindows
from bidirl.cluster.engines.trainer_recovery import TrainerRecovery
from bidirl.cluster.engines.weight_sync import WeightSync
from bidirl.cluster.pool import ClusterError, PoolDriver, root_cause
from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.results.run_result import RunResult
from bidirl.results.trace import EventLog

PRIMARY_TRAINER, AUX_TRAINER = P.PRIMARY_TRAINER, P.AUX_TRAINER


@dataclass
class StepData:
    """One training step's samples and what the trainer stages computed for them (batch order)."""
    step: int
    version: int                # the actor version the step updates (its on-policy samples' version)
    samples: list
    index: dict                 # (group_id, response index) -> position in ``samples``
    advantages: object          # torch tensor [n]
    normalizer: float
    old: list
    ref: list
    stats: list = field(default_factory=list)     # loss statistics of each update-chunk share
    gaps_without_replay: dict = field(default_factory=dict)   # position -> max |Δ log-prob| with R3 off (compared)

    def chunk_inputs(self, share: list, kl: bool) -> tuple:
        """``TrainerActor.chunk_gradient``'s inputs after the chunk id for the samples at positions ``share``:
        samples, advantages, old and (with ``kl``) reference log-probs, the step's loss normaliser."""
        return ([self.samples[k] for k in share], self.advantages[share] if share else [],
                [self.old[k] for k in share], [self.ref[k] for k in share] if kl else None, self.normalizer)


@dataclass
class EngineDriver(PoolDriver):
    """Run ``config`` with real engine workers. ``model_dir``: a causal-LM checkpoint folder (default: the
    built-in tiny model, created once into the cache); ``report_seconds``: the longest a generating rollouter goes
    without reporting (its spans; the engine does not wait for the report);
    ``out_dir`` (:class:`~bidirl.cluster.pool.PoolDriver`): the run's output folder, with the training statistics
    of each step in its rows. The rollouters' engine settings, KV budget included, come from the plan
    (:attr:`rollout`, resolved before any actor starts)."""
    model_dir: Optional[str] = None
    report_seconds: float = 1.0
    start_timeout: float = 600.0
    stall_timeout: float = 300.0

    label = "engines"
    provenance = "measured"

    def __post_init__(self):
        super().__post_init__()
        from bidirl.rl.tiny_model import load_tokenizer

        cfg = self.config
        if cfg.workload.dataset != "arithmetic" and cfg.workload.data_file is None:
            raise cfgmod.ConfigError("workload.dataset", f"engine runs without a data file use the built-in "
                                     f"verifiable task, got {cfg.workload.dataset!r}",
                                     "set workload.dataset: arithmetic, or give workload.data_file (prompts from a "
                                     ".parquet / .jsonl file)")
        if self.model_dir is None:
            if cfg.model not in ("tiny", "tiny-moe"):
                raise cfgmod.ConfigError("model", f"engine runs need model weights; {cfg.model!r} has none here",
                                         "use model: tiny or tiny-moe (built in), or pass model_dir= a causal-LM "
                                         "checkpoint folder")
            from bidirl.rl.bootstrap import ensure_tiny_model
            from bidirl.rl.tiny_model import TinyConfig, TinyMoeConfig
            self.model_dir = str(ensure_tiny_model(cfg=TinyMoeConfig() if cfg.model == "tiny-moe" else TinyConfig()))
        if not self.report_seconds > 0:
            raise ValueError(f"EngineDriver.report_seconds must be > 0, got {self.report_seconds!r}")
        from bidirl.rl.model_folder import causal_lm_config
        causal_lm_config(self.model_dir, "EngineDriver.model_dir")     # a loadable causal LM (vLLM: in the actors)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.prompts, self.reward = self._prompts_and_reward()
        # workload.forced_lengths: every response gets the length the workload model draws for it (as simulated)
        from bidirl.perf.workload import GroupLengths
        self.forced_lengths = GroupLengths.of(cfg, self.seed) if cfg.workload.forced_lengths else None
        self.max_model_len = self.prompts.max_prompt_len + cfg.workload.max_response_len
        self._rollout = None              # RolloutSetup: now on an embedded Ray, once connected to a named cluster
        self.kv_allocated: dict = {}      # rollouter -> KV tokens its vLLM engine allocated (at start)
        if self.address is None:
            self._resolve_rollout()
        self.gangs.update({PRIMARY_TRAINER: [], AUX_TRAINER: []})
        self.versions: dict = {}          # worker -> weights version it holds
        self.weights: dict = {0: None}    # version -> object ref of the state_dict (None: the checkpoint)
        self.period: dict = {}            # rollouter -> its current busy period (for profiling records)
        self.r_report: dict = {}          # rollouter -> number of its latest report applied (see _busy_after)
        self.step_data: Optional[StepData] = None
        self.aux_grads: dict = {}         # chunk id -> object ref of an auxiliary chunk's gradient
        self.step_stats: list = []
        from bidirl.cluster.engines.route_tally import RouteTally
        self.route_tally = RouteTally(on=cfg.route_replay)
        self.final_weights = None
        self._resource_name: Optional[str] = None
        t = cfg.transport
        self.sync = WeightSync(self, t.weights, t.bucket_mb, t.timeout_s, lambda: self.rollout)
        self.windows = GradientWindows(self, self.sync.bucket_bytes, t.timeout_s)
        self.recovery = TrainerRecovery(self, cfg.recovery.snapshot_every, cfg.recovery.snapshot_dir)

    def _prompts_and_reward(self):
        """Which prompt each group gets (``workload.data_file`` or the arithmetic task) and the reward function
        (``rl.reward``), checked here so a bad file, row or function is named before anything starts."""
        from bidirl.rl.data import GroupPrompts, load_dataset, model_max_positions
        from bidirl.rl.rewards import Reward
        from bidirl.rl.tasks import ArithmeticTask

        cfg = self.config
        w = cfg.workload
        try:
            reward = Reward.from_spec(cfg.rl.reward)
        except ValueError as exc:
            raise cfgmod.ConfigError("rl.reward", str(exc), "fix the file or module, or use a built-in reward "
                                     "(exact, last_number, boxed)") from None
        source = load_dataset(w.data_file) if w.data_file is not None else ArithmeticTask(seed=cfg.seed)
        prompts = GroupPrompts.build(source, self.tokenizer, prompt_pool=w.prompt_pool,
                                     max_response_len=w.max_response_len,
                                     max_positions=model_max_positions(self.model_dir),
                                     max_prompt_len=w.max_prompt_len)
        if reward.builtin is not None:
            prompts.check_ground_truths(reward.builtin)
        return prompts, reward

    # ------------------------------------------------------------------------------------------
    # placement and start-up
    # ------------------------------------------------------------------------------------------
    def _resource(self) -> str:
        """``GPU`` on a cluster that offers enough GPUs and no logical slots, else ``gpu_slot`` (read once)."""
        if self._resource_name is None:
            import ray
            res = ray.cluster_resources()
            gpu = res.get("GPU", 0) >= self.config.cluster.gpus and not res.get("gpu_slot")
            self._resource_name = "GPU" if gpu else "gpu_slot"
        return self._resource_name

    def _local_slots(self, gpus: int) -> dict:
        """On a machine with enough CUDA devices the embedded Ray offers them as ``GPU`` resources, so the
        engines run on the GPUs; otherwise logical ``gpu_slot`` units (CPU engines)."""
        import torch
        if torch.cuda.is_available() and torch.cuda.device_count() >= gpus:
            return {"num_gpus": int(gpus)}
        return super()._local_slots(gpus)

    @property
    def rollout(self):
        """The rollouters' :class:`~bidirl.cluster.engines.rollout_setup.RolloutSetup` (:meth:`_resolve_rollout`)."""
        return self._resolve_rollout()

    def _resolve_rollout(self):
        """Resolve the rollouters' settings once: in ``__post_init__`` on an embedded Ray (CUDA when
        :meth:`_local_slots` offers GPUs), else once the named cluster is connected (CUDA when it offers ``GPU``
        resources) — before any actor starts either way. Raises ``ConfigError`` (``RolloutSetup.resolve``)."""
        if self._rollout is None:
            from bidirl.cluster.engines.rollout_setup import RolloutSetup
            gpu = ("num_gpus" in self._local_slots(self.config.cluster.gpus) if self.address is None
                   else self._resource() == "GPU")
            from bidirl.core.policies import Policy, get_policy
            policy = self.policy_name if isinstance(self.policy_name, Policy) else get_policy(self.policy_name)
            windows = int(policy.trainer_on_rollout_pool)          # auxiliary windows in the device budget
            self._rollout = RolloutSetup.resolve(self.plan, self.model_dir, self.prompts.max_prompt_len, gpu, windows)
        return self._rollout

    def _forget_discarded(self, workers) -> None:
        """Rollouters switched out on GPU sleep at level 2 and discard their weights: forget the version they held,
        so the next switch-in (or command) loads the current one (§3.2)."""
        if self.rollout.device == "cuda":
            for w in workers:
                if w not in self.gangs:
                    self.versions[w] = None

    def _at(self, bundle: int, share: float = 0.5, cpus: Optional[float] = None) -> dict:
        opts = super()._at(bundle, share, cpus)
        if self._resource() == "GPU":          # Ray places GPU shares through num_gpus
            opts["num_gpus"] = opts.pop("resources")["GPU"]
        return opts

    def _place(self):
        if self.workers is not None:
            self._adopt()
            return
        for w in self.topology.workers:
            self._spawn(w)
        self._wait_ready()
        self._join_gangs()
        self._passivate()

    def _adopt(self):
        """Take the kept workers of an earlier run (``workers``) and reset each to a fresh engine's state."""
        import ray
        kept = self.workers
        self.actors = dict(kept.actors)
        self.gangs = {g: list(r) for g, r in kept.gangs.items()}
        try:
            ray.get([a.reset.remote(reward_fn=self.reward) for a in self.actors.values()]     # the rollouters
                    + [a.reset.remote() for g in self.gangs.values() for a in g], timeout=self.start_timeout)
        except Exception as exc:
            raise ClusterError(f"the kept workers could not be reset: {root_cause(exc)}; release them "
                               "(Workers.release) and start new ones") from None
        for w in self.topology.workers:
            self.versions[w] = 0
        self._passivate()

    def worker_shape(self) -> dict:
        cfg = self.config
        return dict(super().worker_shape(), model_dir=str(self.model_dir), **self.rollout.shape(),
                    seed=cfg.seed, lr=cfg.rl.lr,
                    kl_coef=cfg.rl.kl_coef, clip_eps=cfg.rl.clip_eps,
                    activation_checkpointing=cfg.rl.activation_checkpointing,
                    publish_dtype=self._publish_dtype(P.PRIMARY_TRAINER), route_replay=cfg.route_replay)

    def _bundles(self, worker: str) -> list:
        """The placement-group bundles a worker's actors sit on: a rollouter's first slot, one per gang rank."""
        env = self.plan.envelope
        g_r = env.rollout_gpus
        if worker in self.gangs:
            # a trainer gang has one rank per GPU slot of its pool: d replicas of ρ_t ranks (FSDP2, see _join_gangs)
            ranks = self.topology.gang_size(worker) * env.trainer_layout
            first = g_r if P.is_primary(worker) else 0
            return [first + j for j in range(ranks)]
        i = int(worker.rsplit("/", 1)[1])
        return [(0 if P.worker_pool(worker) == P.ROLLOUT_POOL else g_r) + i * env.rollout_layout]

    def _spawn(self, worker: str) -> None:
        from bidirl.cluster.engines.workers.actors import RolloutActor, TrainerActor

        cfg = self.config
        bundles = self._bundles(worker)
        if worker in self.gangs:
            gpu = self._resource() == "GPU"
            # a gang of several ranks builds the model on the meta device; each rank reads its shards when it joins
            kwargs = dict(lr=cfg.rl.lr, seed=cfg.seed, kl_coef=cfg.rl.kl_coef, clip_eps=cfg.rl.clip_eps,
                          device="cuda" if gpu else "cpu", threads="auto", role=P.worker_role(worker),
                          activation_checkpointing=cfg.rl.activation_checkpointing, gang=len(bundles) > 1,
                          publish_dtype=self._publish_dtype(worker), route_replay=cfg.route_replay)
            self.gangs[worker] = [TrainerActor.options(**self._at(b)).remote(f"{worker}/{j}", self.model_dir, **kwargs)
                                  for j, b in enumerate(bundles)]
        else:
            self.actors[worker] = RolloutActor.options(**self._at(bundles[0])).remote(
                worker, self.model_dir, cfg.seed, reward_fn=self.reward, routes=cfg.route_replay,
                **self.rollout.engine_kwargs())
        self.versions[worker] = 0            # a fresh process holds the model folder's weights

    def _publish_dtype(self, worker: str):
        """The wire dtype a trainer gang publishes in (the primary's, with the weight transport on; else None): its
        ranks size their host buffer for the published versions (``TrainerEngine.host_capacity``)."""
        return self.sync.dtype if P.is_primary(worker) and self.sync.collective else None

    def _handles(self, worker: str) -> list:
        return list(self.gangs[worker]) if worker in self.gangs else [self.actors[worker]]

    def _discard(self, worker: str) -> None:
        import ray
        for actor in self._handles(worker):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.period.pop(worker, None)
        self.r_report.pop(worker, None)          # a fresh process numbers its reports afresh
        self.sync.member_lost(worker)
        self.windows.member_lost(worker)

    def _restore(self, worker: str, then) -> None:
        """A fresh worker: ready; a gang forms its process group; the primary trainer gets back the version the lost
        gang held (its recovery point and the steps since, replayed: :mod:`.trainer_recovery`); then it is
        offloaded or onloaded as its pool's lease has it (``passive``). Rollouters and the auxiliary gang keep
        the model folder's weights until their next command loads the version it needs."""
        handles = self._handles(worker)

        def settle(offloaded: bool = False):
            want = self.passive.get(worker, False)
            if want == offloaded:
                then()
                return
            method = "offload" if want else "onload"
            if want:
                self._forget_discarded([worker])
            self._when_all([(worker, getattr(a, method).remote()) for a in handles], lambda _: settle(want))

        def state():
            if worker != PRIMARY_TRAINER:
                settle()
                return
            calls, version = self.recovery.restore_calls(handles)
            self.versions[worker] = version
            self._when_all([(worker, c) for c in calls], lambda _: settle())
            self.sync.publish(handles, version)          # after the replay on each rank (calls run in order)

        def join(_ready):
            if worker not in self.gangs or len(handles) < 2:
                state()
                return
            layout = self.plan.envelope.trainer_layout

            def form(addr):
                self._when_all([(worker, r.init_process_group.remote(i, len(handles), addr, len(handles) // layout))
                                for i, r in enumerate(handles)], lambda _: state())
            self._submit(worker, handles[0].address.remote(), form)
        self._when_all([(worker, a.ready.remote()) for a in handles], join)

    def _resume_workers(self) -> None:
        """A resumed run: every rank of the primary gang loads the checkpoint's trainer state (sharded as written),
        publishes that version for the other workers' weight loads, and the checkpoint is the recovery point."""
        import ray
        found = self.resumed_from
        if found is None:
            return
        ranks = self.gangs[PRIMARY_TRAINER]
        try:
            ray.get([r.load_train_state.remote(str(found.trainer_dir), found.trainer_version) for r in ranks],
                    timeout=self.start_timeout)
            acks, weights = self._version_calls()
            ray.get(acks, timeout=self.start_timeout)
        except Exception as exc:
            raise ClusterError(f"the primary trainer could not load the checkpoint {found.path}: "
                               f"{root_cause(exc)}") from None
        self._keep_version(found.trainer_version, weights)
        self.recovery.from_checkpoint(found.trainer_dir, found.trainer_version)

    def _named_actors(self) -> list:
        return list(self.actors.items()) + [(f"{g}/{j}", a) for g, ranks in self.gangs.items()
                                            for j, a in enumerate(ranks)]

    def _all_actors(self) -> list:
        return [a for _, a in self._named_actors()]

    def _wait_ready(self):
        """Every worker constructs its engine; the first failure is reported with the worker's name."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        from tqdm.auto import tqdm

        refs = {a.ready.remote(): name for name, a in self._named_actors()}
        deadline = time.time() + self.start_timeout
        with tqdm(total=len(refs), desc="starting workers", leave=False, disable=not self.progress) as bar:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(1.0, deadline - time.time()))
                if not ready:
                    raise ClusterError(f"workers {sorted(refs.values())} did not start within "
                                       f"{self.start_timeout:.0f} s; check the cluster's free CPUs/GPUs and memory "
                                       "(ray status)")
                for ref in ready:
                    name = refs.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except (RayActorError, RayTaskError, GetTimeoutError) as exc:
                        raise ClusterError(f"worker {name} failed to start: {root_cause(exc)}") from None
                    for sp in reply.spans:
                        self._measure(("start", name.rsplit("/", 1)[0]), sp["end"] - sp["start"])
                        if "kv_cache_tokens" in sp["detail"]:
                            self.kv_allocated[name] = sp["detail"]["kv_cache_tokens"]
                    bar.update(1)
        for name in list(self.actors) + list(self.gangs):
            self.versions[name] = 0

    def _join_gangs(self):
        """Each gang of several ranks forms its process group and shards the model with FSDP2: sharded within a
        replica of ρ_t ranks, replicated across its replicas (as the planner sized a replica)."""
        import ray
        layout = self.plan.envelope.trainer_layout
        for gang, ranks in self.gangs.items():
            if len(ranks) > 1:
                addr = ray.get(ranks[0].address.remote())
                ray.get([r.init_process_group.remote(i, len(ranks), addr, len(ranks) // layout)
                         for i, r in enumerate(ranks)], timeout=self.start_timeout)

    def _passivate(self):
        """Auxiliary workers start passive: their state is offloaded until a switch brings them in."""
        import ray
        aux = [self.actors[w] for w in self.topology.aux_rollouters] + self.gangs[AUX_TRAINER]
        self._forget_discarded(self.topology.aux_rollouters)
        ray.get([a.offload.remote() for a in aux], timeout=self.start_timeout)

    def _begin(self):
        if self.sync.collective and self.gangs[AUX_TRAINER]:
            import ray
            self.windows.pair(*(ray.get([r.shard_signature.remote() for r in self.gangs[g]], timeout=self.start_timeout)
                                for g in (PRIMARY_TRAINER, AUX_TRAINER)))
        self.t0 = time.time() - self.clock_start
        if self.recovery.point[0] == "model":     # version 0 (the model folder's) is what the primary gang publishes first
            self.sync.publish(self.gangs[PRIMARY_TRAINER], 0)

    def train_stats(self) -> list:
        return self.step_stats

    # ------------------------------------------------------------------------------------------
    # bookkeeping
    # ------------------------------------------------------------------------------------------
    def _wall(self, t: float) -> float:
        return t - self.t0

    def _record_spans(self, reply, kind: str, lane: Optional[str] = None, step=None, **detail):
        """Put an actor reply's self-recorded spans on the timeline (on ``lane``, default the worker's)."""
        for sp in reply.spans:
            self.span(lane or sp["worker"], kind, self._wall(sp["start"]), self._wall(sp["end"]),
                      dict(sp["detail"], **detail), step=step)

    # ------------------------------------------------------------------------------------------
    # checkpoints (bidirl.runtime.checkpoints): identity, the driver's state, the trainer's files
    # ------------------------------------------------------------------------------------------
    def _model_identity(self) -> dict:
        from bidirl.rl.model_folder import model_identity
        return dict(model_identity(self.model_dir), name=self.config.model)

    def _data_identity(self) -> dict:
        """The prompt file's SHA-256 and rows (group ``g`` is row ``g mod rows``), or the built-in task's seed."""
        from bidirl.runtime.checkpoints import file_sha256
        source = self.prompts.source
        path = getattr(source, "path", None)
        if path is None:
            return {"task": type(source).__name__, "seed": self.config.seed}
        return {"file_sha256": file_sha256(path), "rows": int(source.size)}

    def checkpoint_state(self) -> dict:
        return dict(super().checkpoint_state(), step_stats=list(self.step_stats), route_replay=self.route_tally.state())

    def restore_state(self, state: dict) -> None:
        super().restore_state(state)
        self.step_stats = list(state["step_stats"])
        if "route_replay" in state:
            self.route_tally.restore(state["route_replay"])
        elif self.route_tally.on:
            raise ValueError("the checkpoint has no route replay counts (written before R3 was counted), and this run "
                             "replays routes; resume it with rl.route_replay: false or start the run anew")

    def save_trainer_state(self, folder) -> bool:
        """Every primary rank writes its shards of weights and AdamW state (``torch.distributed.checkpoint``)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        from bidirl.runtime.checkpoints import CheckpointSkipped
        if PRIMARY_TRAINER in self.failed:
            raise CheckpointSkipped("the primary trainer is being restarted")
        ranks = self.gangs[PRIMARY_TRAINER]
        try:
            ray.get([r.save_train_state.remote(str(folder)) for r in ranks], timeout=self.stall_timeout)
        except (RayActorError, RayTaskError, GetTimeoutError) as exc:
            # a rank died (recovered through its next call) or could not write: this boundary has no checkpoint
            raise CheckpointSkipped(f"the primary trainer could not save its state: {root_cause(exc)}") from None
        return True

    # ------------------------------------------------------------------------------------------
    # rollout
    # ------------------------------------------------------------------------------------------
    def _request(self, task: P.GroupTask):
        from bidirl.cluster.engines.workers.rollout import GroupRequest
        w = self.config.workload
        g = task.group_id
        forced = self.forced_lengths(g)[1] if self.forced_lengths is not None else None
        return GroupRequest(g, self.prompts.prompt_ids(g), w.group_size, w.max_response_len,
                            self.prompts.reward_input(g), resume=task.resume, response_tokens=forced)

    def _weight_loads(self, workers, version: int) -> list:
        """``(worker, ref)`` calls that load actor ``version`` into those of ``workers`` (rollouters, or a
        trainer gang's ranks) that do not hold it yet: one transfer from the primary gang (``WeightSync``), or loads
        from the object store. Calls on one actor run in order, so the work sent after these sees the new weights."""
        calls = []
        need = [w for w in self._alive(workers) if self.versions.get(w) != version]
        for w in need:
            self.versions[w] = version
        if need and self.sync.collective:
            return self.sync.loads(need, version)
        for w in need:
            if w in self.gangs:
                calls += [(w, r.load_state_dict.remote(self.weights[version], version)) for r in self.gangs[w]]
            else:
                calls.append((w, self.actors[w].load_weights.remote(self.weights[version], version)))
        return calls

    def _record_syncs(self, replies, version: int, lane: Optional[str] = None):
        """Lazy weight loads as ``sync`` spans on each worker's lane (``lane``: a gang's, once for its ranks)."""
        self.sync.received(replies)
        for reply in replies[:1] if lane is not None else replies:
            if reply is not None:
                self._record_spans(reply, "sync", lane=lane, version=version)

    def do_Generate(self, cmd: P.Generate):
        w = cmd.worker
        if not self.r_busy.get(w) or w not in self.period:
            self.period[w] = {"since": self.now(), "clean": True, "groups": []}
        if any(t.resume is not None for t in cmd.tasks):
            self.period[w]["clean"] = False
        self._when_all(self._weight_loads([w], cmd.version), lambda replies: self._record_syncs(replies, cmd.version))
        self.r_busy[w] = True
        self._count_start(w)
        requests = [self._request(t) for t in cmd.tasks]
        self._submit(w, self.actors[w].start.remote(requests, self.r_starts[w]), lambda reply: None)
        self._ensure_advance(w)

    def _advance_call(self, worker):
        """The rollouter's stream (``RolloutActor.stream``): it waits for the last start sent, then runs free."""
        return self.actors[worker].stream.remote(self.r_starts.get(worker, 0), self.report_seconds)

    def _advanced(self, worker, reply, starts_before):
        """One reply of a stream: its generate spans, the groups that finished, and whether requests are left."""
        for sp in reply.spans:
            if sp["detail"].get("steps"):
                self.span(worker, "generate", self._wall(sp["start"]), self._wall(sp["end"]), dict(sp["detail"]))
        self._rollout_finished(worker, reply.value["groups"])
        self._busy_after(worker, reply.value)

    def _busy_after(self, worker, report: dict) -> None:
        """Take a rollouter's report (a stream reply's, an interrupt's): it is busy if the report saw requests left
        or a start sent after the one it saw is still to run. The actor numbers its reports (its stream and its
        other calls report in the order they held the engine); one older than the latest applied is stale."""
        if report["report"] <= self.r_report.get(worker, 0):
            return
        self.r_report[worker] = report["report"]
        self._set_busy(worker, bool(report["busy"]) or self.r_starts.get(worker, 0) > report["starts"])

    def _rollout_finished(self, worker, groups):
        period = self.period.get(worker)
        for g in groups:
            if period is not None:
                period["groups"].append(g)
            self.feed(P.GroupFinished(self.now(), worker, g))

    def _set_busy(self, worker, busy: bool):
        """A rollouter went idle: a busy period of fresh groups only becomes a profiling record (§5.1)."""
        was, self.r_busy[worker] = self.r_busy.get(worker), busy
        period = self.period.get(worker)
        if was and not busy and period is not None:
            if period["clean"] and period["groups"]:
                prompt = [g.prompt_len for g in period["groups"] for _ in g.generated]
                resp = [n for g in period["groups"] for n in g.generated]
                self.feed(P.RolloutRecord(self.now(), worker, tuple(prompt), tuple(resp),
                                          self.now() - period["since"]))
            self.period.pop(worker, None)

    def do_Interrupt(self, cmd: P.Interrupt):
        w = cmd.worker
        if w in self.period:
            self.period[w]["clean"] = False

        def done(reply):
            self.feed(P.GenerationStopped(self.now(), w, tuple(reply.value)))
            self._busy_after(w, reply.spans[0]["detail"])
            self._ensure_advance(w)
        ids = list(cmd.group_ids) if cmd.group_ids is not None else None
        self._submit(w, self.actors[w].interrupt.remote(ids), done)

    # ------------------------------------------------------------------------------------------
    # trainer
    # ------------------------------------------------------------------------------------------
    def do_StartStep(self, cmd: P.StartStep):
        """The step's samples, GRPO advantages (normalised per group) and loss normaliser, in batch order (again
        after a rollback: what an earlier attempt of the step left behind is dropped)."""
        from bidirl.rl import grpo
        from bidirl.rl.samples import samples_from_groups
        import torch

        self.aux_grads.clear()
        # a rolled-back step starts over: what its lost attempt left on a living gang is dropped
        self.windows.new_attempt(again=self.step_data is not None and self.step_data.step == cmd.step)
        samples = samples_from_groups(cmd.groups)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        self.step_data = StepData(
            step=cmd.step, version=cmd.version, samples=samples,
            index={(s.group_id, s.index): k for k, s in enumerate(samples)},
            advantages=grpo.group_advantages(rewards, group_size=self.config.workload.group_size).float(),
            normalizer=grpo.loss_normalizer([s.response_len for s in samples], "token-mean"),
            # without an old_logprob stage the rollout's own log-probs are the behaviour policy's (veRL's bypass)
            old=([None] * len(samples) if "old_logprob" in self.config.rl.stages
                 else [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]),
            ref=[None] * len(samples))

    def _run_chunk(self, cmd: P.RunChunk):
        from bidirl.cluster.engines.workers.trainer import forward_ranks, rank_shares
        ch, gang = cmd.chunk, cmd.worker
        data = self.step_data
        idx = [data.index[(g, i)] for g, i in ch.samples]
        ranks = self.gangs[gang]
        layout = self.plan.envelope.trainer_layout
        shares = rank_shares(idx, ch.per_device, len(ranks))      # per_device samples on each rank (device)

        # a gang behind the chunk's version loads it first (an auxiliary gang restarted since it was switched in
        # holds the model folder's weights); calls on one actor run in order
        self._when_all(self._weight_loads([gang], cmd.version),
                       lambda replies: self._record_syncs(replies, cmd.version, lane=gang))

        def finished(replies):
            starts = [sp["start"] for r in replies if r is not None for sp in r.spans]
            ends = [sp["end"] for r in replies if r is not None for sp in r.spans]
            self._chunk_done(cmd, self._wall(min(starts)), self._wall(max(ends)))

        from bidirl.cluster.engines.workers.trainer.replay import fed_tokens
        fed = fed_tokens([data.samples[k] for k in idx])
        if ch.stage in P.FORWARD_STAGES:
            model = "actor" if ch.stage == "old_logprob" else "reference"
            target = data.old if ch.stage == "old_logprob" else data.ref
            live = [(ranks[r], shares[r]) for r in forward_ranks(shares, layout)]   # a replica's ranks gather together
            compare = self.config.rl.route_replay_compare and model == "actor"

            def done(replies):
                for (_, share), reply in zip(live, replies):
                    for k, lp in zip(share, reply.value):
                        target[k] = lp
                    for k, gap in zip(share, reply.spans[0]["detail"].get("gap_without_replay", ())):
                        data.gaps_without_replay[k] = gap
                self.route_tally.chunk(ch.stage, sum(r.spans[0]["detail"].get("replayed_tokens", 0)
                                                     for r in replies), fed)
                finished(replies)
            self._when_all([(gang, r.logprobs.remote([data.samples[k] for k in s], model, compare))
                            for r, s in live], done)
            return

        primary = gang == PRIMARY_TRAINER
        # an auxiliary gang keeps its window's gradient on its devices with the transport (GradientWindows), or
        # hands each chunk's gradient back through the object store without it
        keep = primary or self.sync.collective
        if not primary and keep:
            self.windows.hold(ch.chunk_id)
        refs, grad_ref = [], None
        for rank, (r, s) in enumerate(zip(ranks, shares)):
            reply_ref, flat_ref = r.chunk_gradient.remote(
                ch.chunk_id, *data.chunk_inputs(s, self.config.rl.kl_coef > 0), keep=keep, give=not keep and rank == 0)
            refs.append((gang, reply_ref))
            if not keep and rank == 0:
                grad_ref = flat_ref

        def done(replies):
            data.stats += [r.value for r in replies if r.value.get("samples")]
            self.route_tally.chunk(ch.stage, sum(r.value.get("replayed_tokens", 0) for r in replies), fed)
            if grad_ref is not None:
                self.aux_grads[ch.chunk_id] = grad_ref
            finished(replies)
        self._when_all(refs, done)

    def do_MergeGradients(self, cmd: P.MergeGradients):
        if self.sync.collective:             # the windows were handed over when they ended (GradientWindows)
            self.windows.after_windows(
                lambda: self.feed(P.GradientsMerged(self.now(), cmd.step, self.windows.seconds)))
            return
        start = self.now()
        ranks = self.gangs[PRIMARY_TRAINER]
        grads = [(cid, self.aux_grads.pop(cid)) for cid in cmd.chunk_ids]
        calls = [(PRIMARY_TRAINER, r.receive_gradient.remote(cid, grad)) for cid, grad in grads for r in ranks]

        def done(replies):
            end = self.now()
            self._measure((P.TRAINER_ON_ROLLOUT_POOL, "c_grad"), end - start)
            self.record_merge(cmd, start, end)
            self.feed(P.GradientsMerged(end, cmd.step, end - start))
        self._when_all(calls, done)

    def do_OptimizerStep(self, cmd: P.OptimizerStep):
        ranks = self.gangs[PRIMARY_TRAINER]
        data = self.step_data

        def done(replies):
            out = replies[0].value
            if out["version"] != cmd.version:
                raise ClusterError(f"the primary trainer produced version {out['version']}, the scheduler expected "
                                   f"{cmd.version}; a rank missed an update")
            sp = replies[0].spans[0]
            self.record_optimizer(cmd, self._wall(sp["start"]), self._wall(sp["end"]))
            acks, weights = self._version_calls()

            def kept(_acks):
                # the step counts once the version is out (published, or gathered on the object-store path) and
                # the driver holds what a restarted gang replays it from; a gang that dies before this point
                # rolls the step back
                self._keep_version(cmd.version, weights)
                self.recovery.stepped(data, cmd.version)
                self.step_stats.append(self._step_stats(data, out))
                self.feed(P.OptimizerStepped(self.now(), cmd.step, cmd.version))
            self._when_all([(PRIMARY_TRAINER, a) for a in acks], kept)
        self._when_all([(PRIMARY_TRAINER, r.apply_kept.remote(list(cmd.merge_order), self.windows.windows_for(i)))
                        for i, r in enumerate(ranks)], done)

    def _version_calls(self) -> tuple:
        """Put the primary gang's new version out: (acknowledgement refs, rank 0's full weights ref). With the weight
        transport the ranks publish it (the weights ref is then None); on the object-store path they gather the
        full weights into the object store, owned by the driver. Only the acknowledgements are fetched."""
        publish = self.sync.snapshot_spec()
        calls = [r.put_version.remote(weights=publish is None, publish=publish)        # a collective gather
                 for r in self.gangs[PRIMARY_TRAINER]]
        return [c[0] for c in calls], calls[0][1]

    def _keep_version(self, version: int, weights) -> None:
        self.sync.kept(version, self.versions.get(PRIMARY_TRAINER))
        self.weights[version] = weights if not self.sync.collective else None
        self.versions[PRIMARY_TRAINER] = version

    def _step_stats(self, data: StepData, update: dict) -> dict:
        """Per-step learning metrics (veRL names where the meaning is the same)."""
        import torch
        from bidirl.rl.grpo import token_weighted
        samples = data.samples
        rewards = [s.reward for s in samples]
        response_lens = [s.response_len for s in samples]
        prompt_lens = [len(s.prompt_ids) for s in samples]
        # vLLM's log-probs of sampled tokens against the trainer's recomputation (old_logprob) for responses
        # generated entirely by the weights the trainer held: the weight sync's correctness check.
        gaps = [float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(samples, data.old)
                if s.version == data.version and s.response_len]
        # the same samples' gap with the trainer routing by itself (rl.route_replay_compare; R3 on)
        plain = [g for k, g in data.gaps_without_replay.items()
                 if samples[k].version == data.version and samples[k].response_len]
        max_len = self.config.workload.max_response_len
        return {"step": data.step, "version": update["version"],
                "reward": float(np.mean(rewards)), "reward_max": float(np.max(rewards)),
                "reward_min": float(np.min(rewards)),
                "response_length": float(np.mean(response_lens)), "response_length_max": int(np.max(response_lens)),
                "response_length_min": int(np.min(response_lens)),
                "response_clip_ratio": float(np.mean([n >= max_len for n in response_lens])),
                "prompt_length": float(np.mean(prompt_lens)), "prompt_length_max": int(np.max(prompt_lens)),
                "prompt_length_min": int(np.min(prompt_lens)),
                "loss": float(sum(s["loss"] for s in data.stats)),
                "pg_loss": float(sum(s["pg_loss"] for s in data.stats)), "kl": token_weighted(data.stats, "kl"),
                "clip_frac": token_weighted(data.stats, "clip_frac"), "grad_norm": float(update["grad_norm"]),
                "on_policy_samples": len(gaps), "logprob_diff_max": max(gaps) if gaps else None,
                "logprob_diff_max_no_r3": max(plain) if plain else None}

    # ------------------------------------------------------------------------------------------
    # weights and switching
    # ------------------------------------------------------------------------------------------
    def do_SyncWeights(self, cmd: P.SyncWeights):
        start = self.now()
        calls = self._weight_loads(cmd.targets, cmd.version)

        def done(replies):
            end = self.now()
            per_target = {w: (self._wall(r.spans[0]["start"]), self._wall(r.spans[0]["end"]))
                          for (w, _), r in zip(calls, replies) if r is not None}
            self.sync.received(replies)
            self.record_sync(cmd, start, end, per_target)
            if replies:
                self._measure(("weight_sync", "rollout"), end - start)
            self.feed(P.SyncFinished(end, cmd.version, tuple(cmd.targets), end - start))
        # a target that dies meanwhile drops out: it loads this version when it is back and next generates
        self._when_all(calls, done, tolerate=True)
        self._prune_weights()

    def _prune_weights(self):
        """Drop weight objects no worker holds any more (the newest always stays)."""
        keep = set(self.versions.values()) | {self.version, max(self.weights)}
        for v in [v for v in self.weights if v not in keep]:
            del self.weights[v]

    def do_Switch(self, cmd: P.Switch):
        """Offload the pool's passive role, onload the active one and bring its weights to ``cmd.version`` (§3.2),
        in phases: ``offload`` (the passive role out), ``wake`` (a rollouter's weights, a gang's whole state),
        ``load`` (the version), ``kv`` (a rollouter's KV cache, once its weights are in place). Each phase's
        duration is measured as ``c_in.<phase>`` / ``c_out.<phase>`` beside the whole switch."""
        passive, active = self.switch_sides(cmd)
        start = self.now()
        which = "c_in" if cmd.phase == "in" else "c_out"
        waited = [0.0]       # seconds the load waited for a primary gang being restarted: not a switch's cost

        def calls(method, workers, **rollout_kwargs):
            out = []
            for w in self._alive(workers):
                if w in self.gangs:
                    out += [(w, getattr(r, method).remote()) for r in self.gangs[w]]
                else:
                    out.append((w, getattr(self.actors[w], method).remote(**rollout_kwargs)))
            return out

        def phase(name, pairs, then, applies=None):
            """Run a set of calls; a worker that dies meanwhile only drops out (the coordinator recovers). The
            phase is timed where it ``applies`` (default: it has calls; a load with nothing to load counts 0 s)."""
            if not (pairs if applies is None else applies):
                then()
                return
            t0 = self.now()

            def done(_values):
                self._measure((cmd.direction, f"{which}.{name}"), self.now() - t0)
                then()
            self._when_all(pairs, done, tolerate=True)

        def finish():
            end = self.now()
            self._measure((cmd.direction, which), end - start - waited[0])
            self.record_switch(cmd, start, end)
            self.feed(P.SwitchFinished(end, cmd.pool, cmd.to_role, end - start - waited[0]))

        def wake():
            phase("wake", calls("onload", active, kv=False), load)

        def load():
            # while the primary gang (the sender) is restarted and replays its steps, the load waits for it: that
            # wait is the failure's, and charging it to C_in would make the scheduler stop borrowing
            restarting, t0 = PRIMARY_TRAINER in self.failed or self.sync.publishing is not None, self.now()

            def loaded():
                if restarting:
                    waited[0] += self.now() - t0
                kv()
            phase("load", self._weight_loads(active, cmd.version), loaded, applies=bool(active))

        def kv():
            phase("kv", calls("onload", [w for w in active if w not in self.gangs]), finish)

        def offload():
            nonlocal start
            start = self.now()               # C_out from here: the window's hand-over is C_grad, measured apart
            out = calls("offload", passive)
            self._forget_discarded(passive)
            phase("offload", out, wake)
        if AUX_TRAINER in passive and self.sync.collective:
            self.windows.send(offload)       # the window ends: its gradient goes to the primary gang first
        else:
            offload()

    # ------------------------------------------------------------------------------------------
    def shutdown(self):
        import ray
        last = max(self.weights)
        if self.final_weights is None and self.weights.get(last) is not None:
            try:
                self.final_weights = ray.get(self.weights[last], timeout=60)
            except Exception:
                self.final_weights = None
        elif self.final_weights is None and self.sync.collective and self.finished and PRIMARY_TRAINER not in self.failed:
            # the run's result holds the final weights: gathered once from the primary gang (onloaded for it)
            ranks = self.gangs.get(PRIMARY_TRAINER) or []
            try:
                ray.get([r.onload.remote() for r in ranks], timeout=self.start_timeout)
                self.final_weights = ray.get([r.weights.remote() for r in ranks], timeout=self.start_timeout)[0]
            except Exception:
                self.final_weights = None
        self.sync.shutdown()
        self.windows.shutdown()
        self.recovery.cleanup()
        super().shutdown()

    def summary(self) -> dict:
        out = super().summary()
        costs = out["costs"]
        out["startup"] = costs.pop("start", {})             # seconds to construct each kind of worker
        out["weight_sync"] = costs.pop("weight_sync", {}).get("rollout")
        out["weight_transport"] = self.sync.summary(out["weight_sync"])
        out["recovery"] = self.recovery.summary()
        out["aux_gradients"] = (self.windows.summary() if self.sync.collective
                                else {"path": "object store", "windows": None, "senders": None, "transfers": None,
                                      "bytes": None})
        out["emulated"] = False
        out["reward"] = [s["reward"] for s in self.step_stats]
        out["train"] = list(self.step_stats)
        gaps = [s["logprob_diff_max"] for s in self.step_stats if s["logprob_diff_max"] is not None]
        out["logprob_diff_max"] = max(gaps) if gaps else None
        plain = [s["logprob_diff_max_no_r3"] for s in self.step_stats if s.get("logprob_diff_max_no_r3") is not None]
        out["logprob_diff_max_no_r3"] = max(plain) if plain else None
        out["route_replay"] = self.route_tally.summary()
        out["model_dir"] = self.model_dir
        out["rollout_engine"] = dict(self.rollout.summary(), kv_cache_tokens_allocated=dict(self.kv_allocated))
        out["reward_function"] = self.reward.name
        out["data_file"] = self.config.workload.data_file
        return out

    def result(self, **extra) -> RunResult:
        return super().result(weights=self.final_weights, **extra)

    def _call_failed(self, worker: str, exc: Exception) -> None:
        """A receiver whose weight transfer broke off holds half-loaded weights: it is restarted like a lost
        process (``WeightSync``), not treated as an engine error that ends the run."""
        if self.sync.is_transfer_error(exc):
            self._worker_failed(worker, root_cause(exc))
            return
        super()._call_failed(worker, exc)
