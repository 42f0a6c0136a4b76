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

How each command runs (:class:`~bidirl.cluster.engines.backend.EngineBackend`, plugged into the pool driver, answers
it by concern: :mod:`.rollouts`, :mod:`.training`, :mod:`.weight_loads`, :mod:`.switching`; the workers' start-up and
restarts in :mod:`.placement`):

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

from dataclasses import dataclass
from typing import Optional

from bidirl.cluster.engines.backend import EngineBackend
from bidirl.cluster.engines.gradient_windows import GradientWindows
from bidirl.cluster.engines.trainer_recovery import TrainerRecovery
from bidirl.cluster.engines.weight_sync import WeightSync
from bidirl.cluster.pool import PoolDriver
from bidirl.core import protocol as P
from bidirl.job import config as cfgmod

PRIMARY_TRAINER, AUX_TRAINER = P.PRIMARY_TRAINER, P.AUX_TRAINER


@dataclass
class EngineDriver(PoolDriver):
    """Run ``config`` with real engine workers. ``model_dir``: a causal-LM checkpoint folder (default: the
    built-in tiny model, created once into the cache); ``report_seconds``: the longest a generating rollouter goes
    without reporting (its spans; the engine does not wait for the report);
    ``out_dir`` (:class:`~bidirl.cluster.pool.PoolDriver`): the run's output folder, with the training statistics
    of each step in its rows. The rollouters' engine settings, KV budget included, come from the plan
    (:attr:`rollout`, resolved before any actor starts).

    The settings, the prompts and reward, the versions each worker holds and the transfers (``sync``, ``windows``,
    ``recovery``) are the driver's; the workers are :class:`~bidirl.cluster.engines.backend.EngineBackend`'s
    (``backend``), plugged into the pool driver."""
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
        self.backend = EngineBackend(self)
        self._rollout = None              # RolloutSetup: now on an embedded Ray, once connected to a named cluster
        self.kv_allocated: dict = {}      # rollouter -> KV tokens its vLLM engine allocated (at start)
        if self.address is None:
            self._resolve_rollout()
        self.gangs.update({PRIMARY_TRAINER: [], AUX_TRAINER: []})
        self.versions: dict = {}          # worker -> weights version it holds
        self.weights: dict = {0: None}    # version -> object ref of the state_dict (None: the checkpoint)
        t = cfg.transport
        self.sync = WeightSync(self, t.weights, t.bucket_mb, t.timeout_s, lambda: self.rollout)
        self.windows = GradientWindows(self, self.sync.bucket_bytes, t.timeout_s)
        self.recovery = TrainerRecovery(self, cfg.recovery.snapshot_every, cfg.recovery.snapshot_dir)
        from bidirl.cluster.engines.route_tally import RouteTally
        self.route_tally = RouteTally(on=cfg.route_replay)      # R3: the chunks whose every token was replayed

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

    @property
    def rollout(self):
        """The rollouters' :class:`~bidirl.cluster.engines.rollout_setup.RolloutSetup` (:meth:`_resolve_rollout`)."""
        return self._resolve_rollout()

    def _resolve_rollout(self):
        """Resolve the rollouters' settings once: in ``__post_init__`` on an embedded Ray (CUDA when
        :meth:`~bidirl.cluster.slots.RaySlots.local_slots` offers GPUs), else once the named cluster is connected (CUDA when it offers ``GPU``
        resources) — before any actor starts either way. Raises ``ConfigError`` (``RolloutSetup.resolve``)."""
        if self._rollout is None:
            from bidirl.cluster.engines.rollout_setup import RolloutSetup
            gpu = ("num_gpus" in self.slots.local_slots(self.config.cluster.gpus) if self.address is None
                   else self.slots.resource() == "GPU")
            from bidirl.core.policies import Policy, get_policy
            policy = self.policy_name if isinstance(self.policy_name, Policy) else get_policy(self.policy_name)
            windows = int(policy.trainer_on_rollout_pool)          # auxiliary windows in the device budget
            self._rollout = RolloutSetup.resolve(self.plan, self.model_dir, self.prompts.max_prompt_len, gpu, windows)
        return self._rollout
