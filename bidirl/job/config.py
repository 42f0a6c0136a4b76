"""Job configuration: what a user describes, validated once, immutable afterwards.

A job is the paper's planning input (§4, Algorithm 1: budget G, placement Π, workload statistics W, model P)
plus the RL and scheduler knobs of §2.2 and §5. It is written in YAML (see ``data/configs/``) or built
directly from the dataclasses below; both go through the same validation.

Every rule violation raises :class:`ConfigError`, which names the field (``cluster.gpus``), says what is
wrong and how to fix it. Unknown keys get a "did you mean" suggestion. Nothing is silently defaulted: a
field that is absent takes the documented default shown in the dataclass, a field that is present and
wrong is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import yaml

from bidirl.core.protocol import DIRECTIONS, SwitchCosts, trainer_stages
from bidirl.core.protocol import POLICY_NAMES as POLICIES
from bidirl.errors import ConfigError
from bidirl.job import presets

Placement = Literal["node-aligned", "any"]


# --------------------------------------------------------------------------------------------------
# Parts of a job
# --------------------------------------------------------------------------------------------------

def label(rollout_gpus: int, trainer_gpus: int) -> str:
    """The one spelling of a rollout/trainer split everywhere (sweep keys, CLI, widgets, figures, notebooks):
    ``8-24`` is 8 rollout GPUs and 24 trainer GPUs, as the paper writes its splits (§7: "the default 8-8
    partition", "a 4-12 rollout/trainer partition"). ``Partition.label`` returns the same."""
    return f"{int(rollout_gpus)}-{int(trainer_gpus)}"


@dataclass(frozen=True)
class Partition:
    """A fixed rollout/trainer split of the GPU budget (overrides the planner's choice)."""
    rollout: int
    trainer: int

    def label(self) -> str:
        """``8-24``: the one spelling of a split, :func:`label`."""
        return label(self.rollout, self.trainer)


@dataclass(frozen=True)
class ClusterConfig:
    """GPU budget G, GPUs per node, placement constraint Π (paper §4.3) and an optional fixed partition.

    ``rollout_kv_cache_gib``: engine runs give each rollout GPU's vLLM engine a KV cache of this many GiB
    (empty: the planner's memory model sizes it for both roles of a GPU, the batch and the lengths;
    ``bidirl.job.planner.rollout_kv_budget``). It must hold one sequence of prompt + ``max_response_len``
    tokens and fit beside the trainer on the same GPU.

    ``cpus_per_gpu``: on real GPUs, the logical CPUs each GPU slot's placement bundle reserves for the two workers
    that share the slot (the pool's primary and the other role's borrowing worker, §3.2; half each), which Ray then
    gives them as their thread count (host work: optimizer bookkeeping, copies, batching, tokenisation). ``auto``:
    each GPU node's CPUs, less ``bidirl.cluster.slots.RESERVED_CPUS`` for the driver and Ray's own processes,
    divided by its GPUs (whole CPUs; the least over the nodes). Logical GPU slots (engines on CPU) keep a small
    fixed share (``bidirl.cluster.slots.BUNDLE_CPU``) whatever it says.

    ``rollout_tensor_parallel`` (veRL's ``actor_rollout_ref.rollout.tensor_model_parallel_size``): ρ_r, the GPUs of
    one rollout replica (vLLM tensor parallelism inside one node). Empty: the planner picks the smallest layout
    whose memory fits (§4.1). It must divide ``gpus_per_node``, the model's attention heads and a fixed
    ``partition``'s pools, and the planner refuses it by name when a replica of that size does not fit memory.

    ``rollout_expert_parallel`` (veRL's ``actor_rollout_ref.rollout.expert_parallel_size``, vLLM's
    ``enable_expert_parallel``; MoE models only): the GPUs of a rollout replica over which its routed experts are
    sharded, 1 or the replica's ρ_r (veRL: tensor × data parallel, data parallel 1 here). Empty: 1 (at data parallel
    1 vLLM's EP changes no modelled time or memory: ``bidirl.perf.expert_parallel``).
    """
    gpus: int = 16
    gpus_per_node: int = 8
    placement: Placement = "node-aligned"
    partition: Optional[Partition] = None
    rollout_kv_cache_gib: Optional[float] = None
    cpus_per_gpu: Union[Literal["auto"], float] = "auto"
    rollout_tensor_parallel: Optional[int] = None
    rollout_expert_parallel: Optional[int] = None


@dataclass(frozen=True)
class ResponseLengths:
    """A job's own response-length distribution, replacing the ``workload.dataset`` preset's (the workload
    statistics W of §4 that the planner and the simulator draw lengths from; ``bidirl.perf.workload``).

    Lengths are ``min(max_response_len, max(1, round(X)))`` with ``X`` log-normal of mean ``mean`` tokens and
    coefficient of variation ``cv`` (the presets' family): ``cv`` around 1 or more gives a long tail — most
    responses short, a few near ``max_response_len``. ``step_noise`` is the relative per-step jitter of the mean
    (empty: the preset's). The prompt lengths stay the preset's.
    """
    mean: float
    cv: float
    step_noise: Optional[float] = None


@dataclass(frozen=True)
class WorkloadConfig:
    """One training step's work (§7.1): B_p prompts, each expanded to a GRPO group of ``group_size``.

    ``prompt_pool``: engine runs draw prompt ``group_id mod prompt_pool`` of the task, i.e. cycle over a
    fixed training set of that many prompts (empty: every group gets a new prompt).

    ``data_file``: engine runs take their prompts from this ``.parquet`` / ``.jsonl`` file (veRL's preprocessed
    layout or ``prompt`` + ``answer``; ``bidirl.rl.data``) instead of the built-in arithmetic task: group ``g``
    gets row ``g mod prompt_pool`` (the first ``prompt_pool`` rows) or ``g mod`` the number of rows. A relative
    path is relative to the directory the run starts in. ``dataset`` still names the workload preset whose
    length statistics the planner and the simulator use.

    ``response_lengths`` replaces the preset's response-length distribution (:class:`ResponseLengths`).
    ``forced_lengths``: engine runs generate every response to exactly the length the workload model draws for
    it — response ``i`` of group ``g`` gets ``GroupLengths(config, seed)(g)[1][i]`` tokens (vLLM ``ignore_eos``,
    as ``bidirl profile`` forces lengths) — so a real run does the work ``bidirl simulate`` and the planner
    predict, request by request. The reward scores the text before a response's first end-of-sequence token.

    ``max_prompt_len`` (veRL's ``data.max_prompt_length``): engine runs size their rollouters — vLLM's
    ``max_model_len`` = ``max_prompt_len + max_response_len``, and the KV budget — for prompts of up to this many
    tokens; a prompt the run can draw that is longer is refused before anything starts, naming its row. Empty: the
    longest prompt the run can draw. Jobs of one model and layout that set the same value can run on the same
    kept engine workers (``bidirl.cluster.kept_workers.KeptWorkers``) whatever their data.

    ``response_length_trend``: the relative change of the mean response length per training step — step ``k``'s
    lengths are drawn with mean ``mean · (1 + trend · k)``, clipped to ``[1, max_response_len]`` (responses that
    grow or shrink over training; ``bidirl.perf.workload``). 0: every step has the same mean (no veRL key).
    """
    dataset: str = "geo3k"
    prompts_per_step: int = 64
    group_size: int = 8
    max_response_len: int = 2048
    steps: int = 20
    prompt_pool: Optional[int] = None
    data_file: Optional[str] = None
    response_lengths: Optional[ResponseLengths] = None
    forced_lengths: bool = False
    max_prompt_len: Optional[int] = None
    response_length_trend: float = 0.0


@dataclass(frozen=True)
class RLConfig:
    """Staleness bound s (§2.2; rule in ``bidirl.core.staleness``), partial rollout, micro-batching.

    ``lr``, ``kl_coef`` (β of the KL to the reference) and ``clip_eps`` (PPO clip range) are the GRPO
    trainer's settings; only runs with engine workers use them (the simulator models time, not learning).
    ``reward`` scores each response in engine runs (``bidirl.rl.rewards``): ``exact``, ``last_number``,
    ``boxed``, or a veRL-style ``compute_score`` function as ``module:function`` or ``path/to/file.py[:function]``.
    ``activation_checkpointing``: recompute the trainer's transformer blocks in the backward pass instead of
    keeping their activations (``null``: on for trainers on CUDA, off on CPU; veRL's
    ``actor_rollout_ref.model.enable_gradient_checkpointing``).

    The trainer's execution settings (each modelled in :mod:`bidirl.perf.trainer` / :mod:`bidirl.perf.memory`;
    docs/architecture.md gives each model and its source):

    * ``max_tokens_per_micro_batch`` (veRL ``actor.use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``): a trainer
      micro-batch on one device packs samples (prompt + response tokens) up to this many tokens instead of
      ``micro_batch_per_device`` samples; empty: micro-batches count samples. With ``sequence_parallel`` = k a
      micro-batch's samples are split over k GPUs, so one sample may hold up to ``k ·`` this many tokens.
    * ``mini_batch_prompts`` (veRL ``actor.ppo_mini_batch_size``): prompts (GRPO groups) per optimizer update;
      empty: one update per local update (the whole step batch when ``updates_per_sync`` is 1). It must divide
      the prompts of a local update.
    * ``updates_per_sync`` (fully-async ``trigger_parameter_sync_step``): streaming consumption — a step (one
      weight version, one weight sync) is split into this many local updates of ``prompts_per_step /
      updates_per_sync`` prompts; the trainer starts each as soon as its prompts are ready.
    * ``recompute_old_logprob``: false is bypass mode — the rollout's log-probs stand in for the old log-probs
      and the ``old_logprob`` stage is not run.
    * ``param_offload`` / ``optimizer_offload`` (veRL ``actor.fsdp_config.param_offload`` /
      ``optimizer_offload``): the trainer's sharded parameters / optimizer state live in host memory between
      uses, costing host↔device copies at the hardware preset's ``host_bandwidth``.
    * ``sequence_parallel`` (veRL ``actor.ulysses_sequence_parallel_size``): Ulysses degree k — each sample's
      tokens are split over k GPUs (activations / k, attention all-to-all per layer); data parallel = trainer
      GPUs / k. It must divide the model's attention heads and ``cluster.gpus_per_node``.
    * ``fsdp_size`` (veRL ``actor.fsdp_config.fsdp_size``): ρ_t, the GPUs of one FSDP shard group — the trainer's
      parameters, gradients and optimizer state are sharded over this many GPUs and replicated across the groups
      (hybrid sharding: veRL builds a (replicate, shard) device mesh when ``fsdp_size`` is smaller than the trainer's
      GPUs). It is the trainer replica of the models: the collectives of a micro-batch, the offload copies
      (``4·N/ρ_t`` and ``8·N/ρ_t`` bytes per GPU) and the model-state memory (``18·N/ρ_t``) follow it. Empty: the
      planner picks the smallest layout that fits (veRL's ``-1``, shard over all trainer GPUs, has no fixed size
      here). It must be one of the planner's layouts (1, 2, 4, … up to ``cluster.gpus_per_node``, then whole
      nodes) and fit in memory; each pool must hold whole shard groups.

    ``reproducible`` (issue 42; ``bidirl.core.schedule``): the same seed gives the same batches, rewards and
    weights bit for bit at any staleness, with borrowing on — each group's batch and the version it is generated
    from fixed by a rule of (step, group, s), every group finished on the version it started on, the trainer's
    chunks cut on a fixed grid and its gradient summed in unit order. ``null`` (the default): on at s = 0, where
    it costs nothing but the order buffers, off otherwise.

    Mixture-of-experts models (docs/architecture.md, "MoE"):

    * ``route_replay`` (R3, Rollout Routing Replay): the rollouters record each token's expert routes and the
      trainer's ``old_logprob`` and update forwards send every token to the experts the rollout sent it to; empty:
      on for an MoE model, off for a dense one (which has no routes: asking for it is an error).
    * ``route_replay_compare``: the ``old_logprob`` stage also runs its forward once without the replay, so the
      run reports the train–inference log-prob gap without R3 beside the gap with it (one more forward pass per
      ``old_logprob`` chunk, not modelled by the simulator).
    * ``expert_parallel`` (Megatron's and veRL's ``expert_model_parallel_size``): the trainer's EP degree — each
      replica's routed experts sharded over groups of this many GPUs (FSDP gathers them only inside their
      expert-data-parallel group; tokens travel to their experts by all-to-all: ``bidirl.perf.expert_parallel``).
      Empty: the planner weighs every degree that divides the replica and the experts and keeps the fastest. It must
      divide the model's experts, and one wider than a node must be whole nodes.
    """
    staleness: float = 1.0
    partial_rollout: bool = True
    micro_batch_per_device: int = 4
    reference_model: bool = True
    lr: float = 1e-6
    kl_coef: float = 0.0
    clip_eps: float = 0.2
    reward: str = "exact"
    recompute_old_logprob: bool = True
    activation_checkpointing: Optional[bool] = None
    max_tokens_per_micro_batch: Optional[int] = None
    mini_batch_prompts: Optional[int] = None
    updates_per_sync: int = 1
    param_offload: bool = False
    optimizer_offload: bool = False
    sequence_parallel: int = 1
    fsdp_size: Optional[int] = None
    reproducible: Optional[bool] = None
    route_replay: Optional[bool] = None
    route_replay_compare: bool = False
    expert_parallel: Optional[int] = None

    @property
    def reproducible_on(self) -> bool:
        """Whether the run is in the reproducible mode: ``reproducible``, or by default s = 0."""
        return self.staleness == 0 if self.reproducible is None else bool(self.reproducible)

    @property
    def stages(self) -> tuple:
        """The trainer stages a step runs (``ref_logprob`` only with a reference model; ``old_logprob`` unless
        ``recompute_old_logprob`` is off and the rollout's own log-probs stand in for it, veRL's bypass mode)."""
        return trainer_stages(self.reference_model, self.recompute_old_logprob)


@dataclass(frozen=True)
class SchedulerConfig:
    """Bidirectional scheduler knobs (§5.2).

    A trainer chunk is one micro-batch on every device of a gang (s_max = ``rl.micro_batch_per_device``
    samples per device, §2.1). ``tail_window`` is the number of combined primary-and-auxiliary chunk rounds at
    which TailWindow fires (the paper: one); ``chunks_in_flight`` how many chunks the scheduler keeps sent to
    each gang (the running one plus those whose inputs are being transferred: the asynchronous chunk pipeline
    of §6). Switch costs and the weight-sync time default to the hardware preset's values (for A6000 the paper's
    measured Table 3) when left empty.
    """
    policy: str = "bidirl"
    tail_window: int = 1
    chunks_in_flight: int = 2
    trainer_on_rollout_pool: Optional[SwitchCosts] = None
    rollout_on_trainer_pool: Optional[SwitchCosts] = None
    weight_sync: Optional[float] = None


@dataclass(frozen=True)
class TransportConfig:
    """How engine runs move actor weights from the trainer to the rollouters (the weight sync of §3.2;
    ``bidirl.cluster.engines.workers.weight_transport``).

    ``weights``: ``collective`` — the primary trainer gang sends the rollout dtype (bf16 on GPU, fp32 on CPU) in
    buckets of ``bucket_mb`` MiB over a ``torch.distributed`` group per transfer (gloo on CPU, NCCL on GPU), and Ray
    carries only metadata; ``object_store`` — the trainer's full fp32 state dict goes through Ray's object store and
    every target deserialises its own copy (for clusters whose workers cannot open TCP connections to each other).
    ``timeout_s``: how long a member of a transfer waits for its peers (at the rendezvous, and for each bucket)
    before the transfer fails and the worker is restarted.
    """
    weights: Literal["collective", "object_store"] = "collective"
    bucket_mb: float = 512.0
    timeout_s: float = 300.0


@dataclass(frozen=True)
class RecoveryConfig:
    """How an engine run gets a lost primary trainer gang back (``bidirl.cluster.engines.trainer_recovery``).

    Every ``snapshot_every`` optimizer steps each primary rank writes its shard of weights and AdamW state to
    ``snapshot_dir`` on its own node's disk (default: the system's temporary folder), in the background; a
    restarted gang reads the last complete snapshot and replays the optimizer steps since from the samples the
    driver kept (at most ``2 · snapshot_every − 1`` steps of training, no generation). Nothing of the training
    state goes through Ray's object store.
    """
    snapshot_every: int = 10
    snapshot_dir: Optional[str] = None


@dataclass(frozen=True)
class JobConfig:
    """A whole job. ``model``, ``hardware`` and ``workload.dataset`` name presets in ``data/presets``;
    ``hardware`` may also be the path of a preset file (``*.yaml``, e.g. written by ``bidirl calibrate``)."""
    model: str = "qwen3-vl-4b"
    hardware: str = "a6000"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    seed: int = 0

    def __post_init__(self):
        validate(self)

    # resolved presets -------------------------------------------------------------------------
    @property
    def model_spec(self) -> "presets.ModelSpec":
        return presets.model(self.model)

    @property
    def hardware_spec(self) -> "presets.HardwareSpec":
        return presets.hardware(self.hardware)

    @property
    def workload_stats(self) -> "presets.WorkloadStats":
        """The dataset preset's length statistics, with ``workload.response_lengths`` in place of its response
        distribution when the job sets one (what every planner, simulator and gate draw comes from)."""
        stats = presets.workload(self.workload.dataset)
        own = self.workload.response_lengths
        if own is None:
            return stats
        return dataclasses.replace(
            stats, response_mean_fraction=own.mean / self.workload.max_response_len, response_cv=own.cv,
            step_noise=stats.step_noise if own.step_noise is None else own.step_noise,
            sources=tuple(x for x in stats.sources if not x.startswith("responses"))
            + (f"responses: the job's workload.response_lengths (log-normal, mean {own.mean:g} tokens, cv {own.cv:g})",))

    @property
    def route_replay(self) -> bool:
        """Whether the trainer replays the rollout's expert routes (``rl.route_replay``; empty: for an MoE model)."""
        return self.model_spec.is_moe if self.rl.route_replay is None else self.rl.route_replay

    @property
    def prompts_per_local_update(self) -> int:
        """Prompts (GRPO groups) of one local update: ``prompts_per_step / rl.updates_per_sync`` (streaming
        consumption; the whole step's batch when ``updates_per_sync`` is 1)."""
        return self.workload.prompts_per_step // self.rl.updates_per_sync

    @property
    def optimizer_updates_per_step(self) -> int:
        """Optimizer updates per step: ``prompts_per_step / rl.mini_batch_prompts`` (one per local update when
        ``mini_batch_prompts`` is empty)."""
        mini = self.rl.mini_batch_prompts or self.prompts_per_local_update
        return self.workload.prompts_per_step // mini

    def switch_costs(self, direction: str) -> SwitchCosts:
        """Configured costs for ``trainer_on_rollout_pool`` / ``rollout_on_trainer_pool``, else the preset's."""
        own = getattr(self.scheduler, direction)
        if own is not None:
            return own
        return self.hardware_spec.switch_costs(direction, self.model_spec)

    def weight_sync_time(self, hardware=None, *, rollout_layout: Optional[int] = None) -> float:
        """Seconds of the weight sync that ends a step: ``scheduler.weight_sync`` when set, else the preset's (or
        ``hardware``'s, another :class:`~bidirl.job.presets.HardwareSpec`) measured one, else the one derived for
        rollout replicas of the layout the job runs (§4.2): ``cluster.rollout_tensor_parallel`` when set, else
        ``rollout_layout``, the planner's ρ_r (``plan(cfg).envelope.rollout_layout``, which this layer cannot
        compute: the planner sits above the config). A caller that leaves ``rollout_layout`` out while the key is
        unset gets a ``TypeError``, never a 1-GPU sync the job does not run; one that passes a layout other than
        the key's gets a ``ValueError``. The simulator charges it per sync and the planner per step, both from
        here."""
        if self.scheduler.weight_sync is not None:
            return self.scheduler.weight_sync
        fixed = self.cluster.rollout_tensor_parallel
        if rollout_layout is not None:
            if isinstance(rollout_layout, bool) or not isinstance(rollout_layout, numbers.Integral) \
                    or rollout_layout < 1:
                raise ValueError(f"rollout_layout must be a GPU count ≥ 1, got {rollout_layout!r}")
            rollout_layout = int(rollout_layout)
        if fixed is not None and rollout_layout is not None and rollout_layout != fixed:
            raise ValueError(f"rollout_layout {rollout_layout} differs from cluster.rollout_tensor_parallel {fixed}: "
                             "the job's own ρ_r is the layout its rollout replicas run")
        layout = fixed if fixed is not None else rollout_layout
        if layout is None:
            raise TypeError("JobConfig.weight_sync_time needs rollout_layout (the planned ρ_r, "
                            "plan(cfg).envelope.rollout_layout) when cluster.rollout_tensor_parallel is unset")
        hw = self.hardware_spec if hardware is None else hardware
        return hw.weight_sync_time(self.model_spec, rollout_tp=layout)

    # conversions ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: Mapping[str, Any]) -> "JobConfig":
        """A copy with dotted-key overrides, e.g. ``{"rl.staleness": 2, "cluster.partition": [4, 12]}``."""
        data = self.to_dict()
        for key, value in overrides.items():
            node = data
            parts = key.split(".")
            for i, part in enumerate(parts[:-1]):
                if node.get(part) is None:
                    node[part] = {}
                elif not isinstance(node[part], dict):
                    raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section",
                                      f"override '{'.'.join(parts[: i + 1])}' itself")
                node = node[part]
            node[parts[-1]] = value
        return from_dict(data)


# --------------------------------------------------------------------------------------------------
# Loading: dict/YAML -> dataclasses, with field-named errors
# --------------------------------------------------------------------------------------------------

def load(source: "str | Path | Mapping[str, Any] | JobConfig") -> JobConfig:
    """A :class:`JobConfig` from a YAML/JSON path, a mapping, or an existing config (returned as is)."""
    if isinstance(source, JobConfig):
        return source
    if isinstance(source, Mapping):
        return from_dict(source)
    path = Path(source)
    if not path.exists():
        named = presets.example_config_path(str(source)) if path.parent == Path(".") else None
        if named is None:
            examples = presets.example_configs()
            close = difflib.get_close_matches(path.stem, examples, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError("", f"config file {str(source)!r} does not exist",
                              f"{hint}pass a YAML path or one of the examples: {', '.join(examples)}")
        path = named
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path} is not valid YAML ({exc})", "fix the syntax at the line shown") from None
    if not isinstance(data, Mapping):
        raise ConfigError("", f"{path} must hold a mapping of sections, not {type(data).__name__}",
                          "start the file with keys such as 'model:' and 'cluster:'")
    return from_dict(data)


def from_dict(data: Mapping[str, Any]) -> JobConfig:
    return _build(JobConfig, data, "")


#: keys an earlier release accepted, with what replaces them
REMOVED_KEYS: dict = {
    "scheduler.max_chunk": "a trainer chunk is one micro-batch on every device of a gang: remove it and set "
                           "rl.micro_batch_per_device (samples per device) instead",
}


def _build(cls, data: Any, path: str):
    if not isinstance(data, Mapping):
        raise ConfigError(path or "(top level)", f"expected a mapping, got {data!r}",
                          f"write it as a section with keys {[f.name for f in fields(cls)]}")
    names = {f.name: f for f in fields(cls)}
    for key in data:
        if _join(path, str(key)) in REMOVED_KEYS:
            raise ConfigError(_join(path, str(key)), "is no longer a setting", REMOVED_KEYS[_join(path, str(key))])
        if key not in names:
            close = difflib.get_close_matches(str(key), list(names), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(_join(path, str(key)), "unknown key", hint)
    for f in fields(cls):
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, f.name), "missing required key", f"add '{f.name}'")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, _join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field is missing
        raise ConfigError(path or "(top level)", str(exc), "add the missing key") from None


def _coerce(tp, value, path):
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X], or a choice of forms (the first that takes the value)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for arg in args[:-1]:
            try:
                return _coerce(arg, value, path)
            except ConfigError:
                pass
        try:
            return _coerce(args[-1], value, path)
        except ConfigError as exc:
            if len(args) == 1:
                raise
            forms = " or ".join(repr(a) for arg in args[:-1] for a in typing.get_args(arg))
            raise ConfigError(path, f"expected {forms} or {exc.problem.removeprefix('expected ')}",
                              f"write {forms}, or {exc.fix.removeprefix('write ')}") from None
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"use one of {list(allowed)}"
            raise ConfigError(path, f"{value!r} is not allowed", hint)
        return value
    if tp is Partition:
        if isinstance(value, (list, tuple)) and len(value) == 2:
            value = {"rollout": value[0], "trainer": value[1]}
        return _build(Partition, value, path)
    if is_dataclass(tp):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(path, f"expected a whole number, got {value!r}", "write an integer such as 8")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(path, f"expected a number, got {value!r}", "write a number such as 1.5")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a name, got {value!r}", "write it as text")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")  # a bug in this module, not user input


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --------------------------------------------------------------------------------------------------
# Validation rules (one function, one rule per block; tests cover each)
# --------------------------------------------------------------------------------------------------

def _positive(path: str, value, allow_zero=False):
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(path, f"must be {'≥ 0' if allow_zero else '> 0'}, got {value}",
                          "use a positive value")


def _check_types(obj, path: str = "") -> None:
    """Configs built from the classes directly get the same type checks as YAML input."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        where = _join(path, f.name)
        if is_dataclass(value):
            _check_types(value, where)
        elif value is not None or type(None) not in typing.get_args(hints[f.name]):
            _coerce(hints[f.name], value, where)


def _check_response_lengths(own: ResponseLengths, max_response_len: int) -> None:
    """``workload.response_lengths``: a mean within ``[1, max_response_len]`` and non-negative spreads."""
    where = "workload.response_lengths"
    if not 1 <= own.mean <= max_response_len:
        raise ConfigError(f"{where}.mean", f"must lie in [1, workload.max_response_len = {max_response_len}] "
                          f"tokens, got {own.mean:g}",
                          "give the mean response length in tokens (lengths are clipped to max_response_len), or "
                          "raise workload.max_response_len")
    _positive(f"{where}.cv", own.cv, allow_zero=True)
    if own.step_noise is not None:
        _positive(f"{where}.step_noise", own.step_noise, allow_zero=True)


def _check_execution_settings(cfg: JobConfig) -> None:
    """The rollout/trainer execution settings of real jobs (issue 37): tensor and sequence parallel degrees,
    token-budget micro-batches, mini-batches and streaming consumption, the length trend. Layout rules that need
    the memory model (does a ρ_r replica fit?) are the planner's (``bidirl.job.planner.min_feasible_layouts``)."""
    c, w, r, m = cfg.cluster, cfg.workload, cfg.rl, cfg.model_spec
    tp = c.rollout_tensor_parallel
    if tp is not None:
        _positive("cluster.rollout_tensor_parallel", tp)
        if c.gpus_per_node % tp:
            raise ConfigError("cluster.rollout_tensor_parallel",
                              f"{tp} GPUs per rollout replica does not divide cluster.gpus_per_node = "
                              f"{c.gpus_per_node} (a tensor-parallel replica lives inside one node)",
                              f"use a divisor of {c.gpus_per_node}, e.g. "
                              f"{max(d for d in range(1, c.gpus_per_node + 1) if c.gpus_per_node % d == 0 and d <= tp)}"
                              ", or leave it empty for the planner's layout")
        if m.heads % tp:
            raise ConfigError("cluster.rollout_tensor_parallel",
                              f"{tp} does not divide {m.name}'s {m.heads} attention heads (vLLM splits the heads "
                              "over the tensor-parallel GPUs)",
                              "use a divisor of the model's attention heads, or leave it empty")
        if c.partition is not None and c.partition.rollout % tp:
            raise ConfigError("cluster.rollout_tensor_parallel",
                              f"the fixed rollout pool of {c.partition.rollout} GPUs is not a whole number of "
                              f"{tp}-GPU rollout replicas",
                              "use a tensor-parallel degree that divides cluster.partition.rollout, or change the "
                              "partition")
    sp = r.sequence_parallel
    _positive("rl.sequence_parallel", sp)
    if sp > 1:
        if c.gpus_per_node % sp:
            raise ConfigError("rl.sequence_parallel",
                              f"a sequence-parallel group of {sp} GPUs does not divide cluster.gpus_per_node = "
                              f"{c.gpus_per_node} (its all-to-all runs inside one node)",
                              "use a divisor of gpus_per_node, or 1")
        if m.heads % sp:
            raise ConfigError("rl.sequence_parallel",
                              f"{sp} does not divide {m.name}'s {m.heads} attention heads (Ulysses gives each GPU "
                              "of the group a share of the heads)",
                              "use a divisor of the model's attention heads, or 1")
        for pool in ("trainer", "rollout"):   # both pools host trainers (the rollout pool's borrowing gang, §3.2)
            gpus = getattr(c.partition, pool) if c.partition is not None else 0
            if gpus % sp:
                raise ConfigError("rl.sequence_parallel",
                                  f"the fixed {pool} pool of {gpus} GPUs is not a whole number of {sp}-GPU "
                                  "sequence-parallel groups (both pools host trainer gangs)",
                                  f"use a degree that divides cluster.partition.{pool}, or change the partition")
    if r.fsdp_size is not None:
        _positive("rl.fsdp_size", r.fsdp_size)
        from bidirl.perf.memory import layout_candidates
        layouts = layout_candidates(c.gpus_per_node, c.gpus)
        if r.fsdp_size not in layouts:
            raise ConfigError("rl.fsdp_size",
                              f"an FSDP shard group of {r.fsdp_size} GPUs is not a trainer layout of "
                              f"{c.gpus} GPUs with {c.gpus_per_node} per node",
                              f"use one of {', '.join(map(str, layouts))}, or leave it empty for the smallest layout "
                              "that fits")
        for pool in ("trainer", "rollout"):   # both pools host trainer replicas (the borrowing gang, §3.2)
            gpus = getattr(c.partition, pool) if c.partition is not None else 0
            if gpus % r.fsdp_size:
                raise ConfigError("rl.fsdp_size",
                                  f"the fixed {pool} pool of {gpus} GPUs is not a whole number of "
                                  f"{r.fsdp_size}-GPU shard groups (both pools host trainer replicas)",
                                  f"use a size that divides cluster.partition.{pool}, or change the partition")
    if r.max_tokens_per_micro_batch is not None:
        _positive("rl.max_tokens_per_micro_batch", r.max_tokens_per_micro_batch)
        longest = cfg.workload_stats.prompt_max + w.max_response_len
        if r.max_tokens_per_micro_batch * sp < longest:
            raise ConfigError("rl.max_tokens_per_micro_batch",
                              f"{r.max_tokens_per_micro_batch} tokens per device"
                              + (f" × rl.sequence_parallel {sp}" if sp > 1 else "")
                              + f" cannot hold the longest sample (prompt up to {cfg.workload_stats.prompt_max} + "
                              f"workload.max_response_len {w.max_response_len} = {longest} tokens)",
                              f"set at least {-(-longest // sp)} (veRL recommends ≥ 2× the longest sample), or "
                              "raise rl.sequence_parallel")
    U = r.updates_per_sync
    _positive("rl.updates_per_sync", U)
    if w.prompts_per_step % U:
        raise ConfigError("rl.updates_per_sync",
                          f"{U} local updates do not split workload.prompts_per_step = {w.prompts_per_step} prompts "
                          "evenly",
                          f"use a divisor of {w.prompts_per_step}, e.g. "
                          f"{max(d for d in range(1, U + 1) if w.prompts_per_step % d == 0)}")
    if r.mini_batch_prompts is not None:
        _positive("rl.mini_batch_prompts", r.mini_batch_prompts)
        local = w.prompts_per_step // U
        if local % r.mini_batch_prompts:
            raise ConfigError("rl.mini_batch_prompts",
                              f"{r.mini_batch_prompts} prompts per optimizer update does not divide the "
                              f"{local} prompts of a local update (workload.prompts_per_step {w.prompts_per_step}"
                              f" / rl.updates_per_sync {U})",
                              f"use a divisor of {local}, or leave it empty for one update per local update")


def _check_expert_parallel(cfg: JobConfig) -> None:
    """``cluster.rollout_expert_parallel`` and ``rl.expert_parallel`` (MoE models only): whole experts per EP rank,
    an EP group wider than a node made of whole nodes. Whether a degree fits its replica needs the replica's layout,
    the planner's (``bidirl.job.planner.expert_parallel_layouts``)."""
    m, gpn = cfg.model_spec, cfg.cluster.gpus_per_node
    for key, ep in (("cluster.rollout_expert_parallel", cfg.cluster.rollout_expert_parallel),
                    ("rl.expert_parallel", cfg.rl.expert_parallel)):
        if ep is None:
            continue
        _positive(key, ep)
        if ep > 1 and not m.is_moe:
            raise ConfigError(key, f"expert parallelism shards a mixture-of-experts model's experts; {cfg.model!r} is "
                              "a dense model", "leave it empty (or 1) for a dense model")
        if ep > 1 and m.experts % ep:
            divisors = [d for d in range(1, m.experts + 1) if m.experts % d == 0 and d <= max(gpn, ep)]
            raise ConfigError(key, f"{ep} does not divide {m.name}'s {m.experts} experts (each EP rank holds whole "
                              "experts)", f"use a divisor of {m.experts}, e.g. {max(divisors)}, or leave it empty")
        if ep > gpn and ep % gpn:
            raise ConfigError(key, f"an EP group of {ep} GPUs spans nodes but is not whole nodes of "
                              f"cluster.gpus_per_node = {gpn}", f"use a divisor of {gpn} or a multiple of it")
        if key == "cluster.rollout_expert_parallel" and ep > gpn:
            raise ConfigError(key, f"a rollout replica is one tensor-parallel engine inside a node ({gpn} GPUs); an EP "
                              f"group of {ep} GPUs does not fit it", f"use 1 or the rollout replica's GPUs (≤ {gpn})")


#: execution settings the models, the planner and the simulator (and emulated runs) honour but engine runs do not
#: carry out yet: key -> (its defaults, why an engine run cannot). Bypass (``rl.recompute_old_logprob: false``)
#: runs in the engine driver, token-budget micro-batches and parameter / optimizer offload in the trainer engine
#: (``bidirl.cluster.engines.workers.trainer``: ``micro_batches``, ``state_offload``), optimizer mini-batches
#: (``rl.mini_batch_prompts``) in the chunk queue and the trainer gangs (one optimizer step per mini-batch), and
#: streaming consumption (``rl.updates_per_sync``: each local update its own ``(step, local)`` identity, one weight
#: version and sync per step), so they are not here.
ENGINE_PENDING = {
    "cluster.rollout_tensor_parallel": ((None, 1), "an engine run places each rollouter on one GPU slot, and vLLM's "
                                        "CPU build runs one worker per engine (distributed_executor_backend 'uni': "
                                        "no tensor parallel on CPU)"),
    "rl.sequence_parallel": ((1,), "the trainer engine has no Ulysses all-to-all: each rank holds whole samples"),
    "rl.fsdp_size": ((None,), "the engine run's trainer gangs shard over the planner's layout; an explicit shard-group "
                     "size is not passed to the engines yet"),
    "rl.expert_parallel": ((None, 1), "the trainer engine shards every parameter with FSDP2 (no expert-parallel "
                           "groups or token all-to-alls)"),
    "cluster.rollout_expert_parallel": ((None, 1), "an engine run places each rollouter on one GPU slot (no "
                                        "expert-parallel group to shard over)"),
}


def check_engine_run(cfg: JobConfig) -> None:
    """Refuse, naming the key and why, a setting an engine run would not carry out (:data:`ENGINE_PENDING`): a run
    that ignored it would measure another job than the one configured."""
    if cfg.model_spec.is_moe and cfg.transport.weights == "collective":
        raise ConfigError("transport.weights", "the weight transport sends the trainer's published shards under the "
                          "model's parameter names, and an MoE model's are its fused expert tensors, which the "
                          "checkpoint layout the rollouters receive names per expert",
                          "set transport.weights: object_store for an MoE engine run (the trainer's state dict, "
                          "split per expert, goes through Ray's object store)")
    data = cfg.to_dict()
    for key, (defaults, why) in ENGINE_PENDING.items():
        section, name = key.split(".")
        value = data[section][name]
        if value not in defaults:
            raise ConfigError(key, f"is {value!r}, which engine runs do not carry out yet: {why} (the planner, the "
                              "stage models, `bidirl simulate` and `bidirl run --emulate` do)",
                              f"leave it at {defaults[0]!r} for an engine run, or use --emulate / bidirl simulate")


def validate(cfg: JobConfig) -> None:
    """Check cross-field rules; raises :class:`ConfigError` naming the first violated field."""
    _check_types(cfg)
    for name, getter in (("model", presets.model), ("hardware", presets.hardware)):
        try:
            getter(getattr(cfg, name))
        except presets.PresetError as exc:
            raise ConfigError(name, str(exc), exc.fix) from None
    try:
        presets.workload(cfg.workload.dataset)
    except presets.PresetError as exc:
        raise ConfigError("workload.dataset", str(exc), exc.fix) from None

    c = cfg.cluster
    _positive("cluster.gpus", c.gpus)
    _positive("cluster.gpus_per_node", c.gpus_per_node)
    if c.placement == "node-aligned" and c.gpus % c.gpus_per_node and c.gpus > c.gpus_per_node:
        raise ConfigError("cluster.gpus", f"{c.gpus} GPUs is not a whole number of {c.gpus_per_node}-GPU nodes",
                          "use a multiple of gpus_per_node or set placement: any")
    if c.partition is not None:
        p = c.partition
        _positive("cluster.partition.rollout", p.rollout)
        _positive("cluster.partition.trainer", p.trainer)
        if p.rollout + p.trainer != c.gpus:
            raise ConfigError("cluster.partition", f"{p.rollout} + {p.trainer} = {p.rollout + p.trainer} "
                              f"does not sum to cluster.gpus = {c.gpus}",
                              "make rollout + trainer equal the budget, or drop partition to let the planner choose")

    if c.cpus_per_gpu != "auto" and not c.cpus_per_gpu > 0:
        raise ConfigError("cluster.cpus_per_gpu", f"must be > 0 CPUs, got {c.cpus_per_gpu:g}",
                          "give the logical CPUs each GPU's two workers share (e.g. 8), or auto for the node's CPUs "
                          "divided by its GPUs")
    if c.rollout_kv_cache_gib is not None and not c.rollout_kv_cache_gib > 0:
        raise ConfigError("cluster.rollout_kv_cache_gib", f"must be > 0 GiB, got {c.rollout_kv_cache_gib:g}",
                          "give the KV cache of each rollout GPU in GiB (e.g. 0.5), or leave it empty for the "
                          "planner's budget")

    w = cfg.workload
    _positive("workload.prompts_per_step", w.prompts_per_step)
    _positive("workload.group_size", w.group_size)
    _positive("workload.max_response_len", w.max_response_len)
    _positive("workload.steps", w.steps)

    r = cfg.rl
    if r.route_replay and not cfg.model_spec.is_moe:
        raise ConfigError("rl.route_replay", f"route replay (R3) is for mixture-of-experts models; {cfg.model!r} is "
                          "dense (no experts, no routes to replay)",
                          "leave rl.route_replay empty (on for an MoE model, off for a dense one) or set it false")
    if r.route_replay_compare and not cfg.route_replay:
        raise ConfigError("rl.route_replay_compare", "compares the log-prob gap with and without route replay, "
                          "which is off for this job", "turn rl.route_replay on (an MoE model) or drop "
                          "rl.route_replay_compare")
    _positive("rl.staleness", r.staleness, allow_zero=True)
    _positive("rl.micro_batch_per_device", r.micro_batch_per_device)
    _positive("rl.lr", r.lr)
    _positive("rl.kl_coef", r.kl_coef, allow_zero=True)
    _positive("rl.clip_eps", r.clip_eps)
    if r.kl_coef > 0 and not r.reference_model:
        raise ConfigError("rl.kl_coef", f"is {r.kl_coef} but rl.reference_model is false",
                          "set rl.reference_model: true (the KL needs the reference log-probs) or kl_coef: 0")
    if w.prompt_pool is not None:
        _positive("workload.prompt_pool", w.prompt_pool)
    if w.max_prompt_len is not None:
        _positive("workload.max_prompt_len", w.max_prompt_len)
    if w.response_lengths is not None:
        _check_response_lengths(w.response_lengths, w.max_response_len)
    if w.data_file is not None:
        from bidirl.rl.data import DATA_SUFFIXES
        if not w.data_file.strip() or not w.data_file.endswith(DATA_SUFFIXES):
            raise ConfigError("workload.data_file", f"{w.data_file!r} is not a {' or '.join(DATA_SUFFIXES)} file",
                              "name a Parquet file in veRL's layout or a JSONL file with prompt and answer")
    from bidirl.rl.rewards import SPEC_FORMS, parse_reward_spec
    try:
        parse_reward_spec(r.reward)
    except ValueError as exc:
        raise ConfigError("rl.reward", str(exc), SPEC_FORMS) from None

    s = cfg.scheduler
    if s.policy not in POLICIES:
        close = difflib.get_close_matches(s.policy, POLICIES, n=1)
        raise ConfigError("scheduler.policy", f"unknown policy {s.policy!r}",
                          f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(POLICIES)}")
    _positive("scheduler.tail_window", s.tail_window)
    _positive("scheduler.chunks_in_flight", s.chunks_in_flight)
    for direction in DIRECTIONS:
        costs = getattr(s, direction)
        if costs is not None:
            for k in ("c_in", "c_out", "c_grad"):
                _positive(f"scheduler.{direction}.{k}", getattr(costs, k), allow_zero=True)
    if s.weight_sync is not None:
        _positive("scheduler.weight_sync", s.weight_sync, allow_zero=True)
    t = cfg.transport
    if not t.bucket_mb > 0:
        raise ConfigError("transport.bucket_mb", f"must be > 0 MiB, got {t.bucket_mb:g}",
                          "give the bucket size in MiB, e.g. 512 (a tensor larger than a bucket travels alone)")
    if not t.timeout_s > 0:
        raise ConfigError("transport.timeout_s", f"must be > 0 seconds, got {t.timeout_s:g}",
                          "give how long a transfer's members wait for each other, e.g. 300")
    if cfg.recovery.snapshot_every < 1:
        raise ConfigError("recovery.snapshot_every", f"must be ≥ 1 optimizer step, got {cfg.recovery.snapshot_every}",
                          "give how many steps apart the primary trainer's recovery snapshots are, e.g. 10")
    _check_execution_settings(cfg)
    _check_expert_parallel(cfg)
    if cfg.seed < 0:
        raise ConfigError("seed", f"must be ≥ 0, got {cfg.seed}", "use a non-negative integer seed")
