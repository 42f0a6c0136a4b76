"""Scheduling-aware static planning (paper §4, Algorithm 1).

``plan(config)`` returns the resource envelope E = (g_r, g_t, ρ_r, ρ_t, M_r, M_t) and the whole partition
sweep behind it:

1. **MinFeasibleLayouts** (§4.1): the smallest rollout and trainer replica sizes ρ_r, ρ_t (GPUs per replica;
   powers of two up to a node, then whole nodes) whose per-GPU memory fits — model states, activations and
   KV cache as documented in :mod:`bidirl.perf.memory`, for the workload's longest sequence
   (``prompt_max + max_response_len``). A job that fixes ``cluster.rollout_tensor_parallel`` keeps its ρ_r
   (refused by name when a replica of that size does not fit); the replica counts, and with them the rollouters'
   in-flight cap, follow the replicas the job has. Likewise a job that fixes ``rl.fsdp_size`` (veRL's
   ``actor.fsdp_config.fsdp_size``) keeps its FSDP shard group as ρ_t, refused by name when its states and
   activations do not fit.
2. **BuildStageModels**: the runtime's own stage-time predictor (:class:`~bidirl.perf.predictor.StagePredictor`:
   :class:`~bidirl.perf.rollout.RolloutModel` with tp = ρ_r and the engines' concurrency cap,
   :class:`~bidirl.perf.trainer.TrainerModel` with layout ρ_t), built once.
3. **CandidatePartitions(G, Π)**: every (g_r, g_t) with g_r + g_t = G and both ≥ 1; under
   ``node-aligned`` each pool is a whole number of nodes (any split when G ≤ gpus_per_node).
4. **Compatible(g_r, g_t, ρ_r, ρ_t)** (§4.1): both pools may host both roles, so each holds a whole number
   of replicas of each: ``g % ρ_r == g % ρ_t == 0`` for g ∈ {g_r, g_t}.
5. For each candidate: d_r = ⌊g_r/ρ_r⌋, d_t = ⌊g_t/ρ_t⌋, λ_r = B_p / M_r(B_p, d_r), λ_t = B_p / M_t(U_B, d_t),
   λ_pipe = min(λ_r, λ_t) (§4.2; rates in prompt groups per second). Each stage time holds the step's end as the
   simulator charges it, from the same functions: M_t the trainer's optimizer work of the step on its g_t GPUs
   (:func:`step_optimizer_times`: gradient all-reduces, AdamW steps, offload copies) and the weight sync
   (``JobConfig.weight_sync_time``), M_r the weight sync too, since no rollout replica generates while the new
   weights are on their way. The envelope is the compatible candidate
   with the largest λ_pipe (ties: the first, i.e. the fewest rollout GPUs), or ``cluster.partition`` when
   the job fixes one (it must be a compatible candidate). Incompatible candidates are still evaluated so the
   sweep is complete.

The representative batch is B_p = ``workload.prompts_per_step`` GRPO groups of ``workload.group_size``
requests: the job's first step as the runtime will see it (:func:`representative_batch`, the same draw the
simulator runs, so one config always plans the same way). M_r deals its groups to the rollout replicas in
group-id order, as the coordinator dispatches them; U_B is the trainer work of the same samples in the order
they are expected to complete (:func:`consumption_order`), ``old_logprob`` (``ref_logprob`` when
``rl.reference_model``) and ``actor_update``, cut into chunks of one micro-batch per device
(:meth:`~bidirl.perf.trainer.TrainerModel.stage_time`). Planner and simulator therefore model one execution;
``bidirl.experiments.fidelity`` measures how far apart they are.

**Complexity** (§4.3): layouts and models are built once; stage times depend on a candidate only through
its replica counts, and only ``min(d, groups)`` (rollout) / ``min(d, samples)`` (trainer) replicas can be busy,
so each distinct capped count is evaluated once and shared by every candidate with that count. Each model
evaluates all its distinct counts together, vectorised a few counts at a time, with the same numbers as one
count at a time (:meth:`~bidirl.perf.rollout.RolloutModel.stage_times`,
:meth:`~bidirl.perf.trainer.TrainerModel.stage_times`). M_r: a replica's features are sums of per-group
sums, a replica holding a single group is timed once for every count, and only the replicas whose requests
overflow the KV cache step through decode, by runs of equal active sets rather than step by step. M_t: the
samples are ranked once; each count's chunks are a radix sort of chunk ids away from their serpentine deals,
and only each chunk's busiest replicas are timed. Each count costs about a vectorised pass over the groups
(rollout; and over the overflowing replicas' requests) or the samples (trainer), and the scan over candidates
is vectorised, O(|S_Π|), as is the step's end (the optimizer work on every candidate's g_t GPUs in one pass).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from bidirl.core.protocol import UPDATE_STAGES, mini_batch_bounds
from bidirl.job import config as cfgmod
from bidirl.job.config import ConfigError, label
from bidirl.perf import memory
from bidirl.perf.flops import STAGES
from bidirl.perf.predictor import StagePredictor
from bidirl.perf.rollout import RolloutModel
from bidirl.perf.trainer import TrainerModel
from bidirl.perf.workload import GroupLengths

#: the keys of ``bidirl plan --json`` fixed by DESIGN.md (extend, never rename)
ENVELOPE_KEYS = ("rollout_gpus", "trainer_gpus", "rollout_layout", "trainer_layout", "rollout_replicas",
                 "trainer_replicas", "pipeline_rate")
CANDIDATE_KEYS = ("rollout_gpus", "trainer_gpus", "compatible", "rollout_time", "trainer_time", "rollout_rate",
                  "trainer_rate", "pipeline_rate")
GiB = float(1 << 30)


@dataclass(frozen=True)
class Envelope:
    """The selected resource envelope E = (g_r, g_t, ρ_r, ρ_t, M_r, M_t) with its predicted rates."""
    rollout_gpus: int
    trainer_gpus: int
    rollout_layout: int
    trainer_layout: int
    rollout_replicas: int
    trainer_replicas: int
    pipeline_rate: float
    rollout_time: float
    trainer_time: float
    rollout_rate: float
    trainer_rate: float
    rollout_model: RolloutModel = field(repr=False, compare=False, default=None)
    trainer_model: TrainerModel = field(repr=False, compare=False, default=None)
    #: EP degrees (MoE; 1 for a dense model): the GPUs of a replica over which its routed experts are sharded
    #: (``bidirl.perf.expert_parallel``; ``cluster.rollout_expert_parallel``, ``rl.expert_parallel``)
    rollout_expert_parallel: int = 1
    trainer_expert_parallel: int = 1
    #: seconds per step M_t holds besides its chunks: the step's optimizer work on the trainer's GPUs
    #: (:meth:`~bidirl.perf.predictor.StagePredictor.step_optimizer_time`) — and, in both M_r and M_t, the weight
    #: sync that ends the step (``JobConfig.weight_sync_time``), which neither pool works through
    optimizer_time: float = 0.0
    sync_time: float = 0.0

    @property
    def label(self) -> str:
        return label(self.rollout_gpus, self.trainer_gpus)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ENVELOPE_KEYS}
        out.update(label=self.label, rollout_time=self.rollout_time, trainer_time=self.trainer_time,
                   rollout_rate=self.rollout_rate, trainer_rate=self.trainer_rate,
                   rollout_expert_parallel=self.rollout_expert_parallel,
                   trainer_expert_parallel=self.trainer_expert_parallel, optimizer_time=self.optimizer_time,
                   sync_time=self.sync_time)
        return _jsonable(out)


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` returns: the envelope, the sweep (one row per candidate) and the planning inputs."""
    config: Any
    envelope: Envelope
    sweep: pd.DataFrame = field(repr=False)
    memory: dict = field(repr=False)            # role -> MemoryNeed at the chosen layout
    batch: tuple = field(repr=False)            # (prompt_lens, response_lens) of the representative batch
    stages: tuple = STAGES
    fixed: bool = False                         # True when cluster.partition chose the envelope
    #: the trainer EP degrees the planner weighed (:func:`choose_expert_parallel`): ``{ep: (M_t, λ_pipe)}`` at the
    #: best compatible candidate of each; one entry for a dense model or a job that fixes ``rl.expert_parallel``
    expert_parallel_options: dict = field(repr=False, default_factory=dict)

    @property
    def choice(self) -> str:
        return self.envelope.label

    def compatible_partitions(self) -> list:
        """``[(label, (rollout_gpus, trainer_gpus))]`` of the hot-switch compatible candidates, in sweep order."""
        ok = self.sweep[self.sweep["compatible"].astype(bool)]
        return [(str(lbl), (int(a), int(b))) for lbl, a, b in zip(ok["label"], ok["rollout_gpus"], ok["trainer_gpus"])]

    def index_of(self, partition) -> Optional[int]:
        """The sweep row (position) of ``(rollout_gpus, trainer_gpus)``, or None if it is not a candidate."""
        if partition is None:
            return None
        g_r = self.sweep["rollout_gpus"].to_numpy()
        g_t = self.sweep["trainer_gpus"].to_numpy()
        hit = np.flatnonzero((g_r == partition[0]) & (g_t == partition[1]))
        return int(hit[0]) if hit.size else None

    def candidate(self, index: int) -> tuple:
        """``(rollout_gpus, trainer_gpus, compatible)`` of sweep row ``index``."""
        row = self.sweep.iloc[int(index)]
        return int(row["rollout_gpus"]), int(row["trainer_gpus"]), bool(row["compatible"])

    def to_dict(self) -> dict:
        """The ``bidirl plan --json`` object (DESIGN.md keys first, then extensions)."""
        cfg = self.config
        cands = []
        for row in self.sweep.itertuples(index=False):
            d = {k: getattr(row, k) for k in CANDIDATE_KEYS}
            d.update(label=row.label, rollout_replicas=row.rollout_replicas,
                     trainer_replicas=row.trainer_replicas, chosen=row.chosen)
            cands.append(d)
        p, r = self.batch
        return _jsonable({
            "envelope": self.envelope.to_dict(),
            "candidates": cands,
            "chosen_by": "cluster.partition" if self.fixed else "planner",
            "rate_unit": "prompt groups per second",
            "time_unit": "seconds per step",
            "inputs": {"model": cfg.model, "hardware": cfg.hardware, "gpus": cfg.cluster.gpus,
                       "gpus_per_node": cfg.cluster.gpus_per_node, "placement": cfg.cluster.placement,
                       "dataset": cfg.workload.dataset, "prompts_per_step": cfg.workload.prompts_per_step,
                       "group_size": cfg.workload.group_size, "max_response_len": cfg.workload.max_response_len,
                       "micro_batch_per_device": cfg.rl.micro_batch_per_device, "stages": list(self.stages),
                       "rollout_tensor_parallel": cfg.cluster.rollout_tensor_parallel,
                       "max_tokens_per_micro_batch": cfg.rl.max_tokens_per_micro_batch,
                       "sequence_parallel": cfg.rl.sequence_parallel, "updates_per_sync": cfg.rl.updates_per_sync,
                       "seed": cfg.seed},
            "representative_batch": {"requests": int(p.size), "mean_prompt_len": float(p.mean()),
                                     "mean_response_len": float(r.mean()),
                                     "max_response_len": int(r.max()), "tokens": int(p.sum() + r.sum())},
            "memory_gib_per_gpu": {role: {**{k: v / GiB for k, v in need.parts.items()},
                                          "total": need.total / GiB, "usable": need.usable / GiB,
                                          "layout": need.layout}
                                   for role, need in self.memory.items()},
            "expert_parallel_options": [{"trainer_expert_parallel": ep, "trainer_time": t, "pipeline_rate": lam}
                                        for ep, (t, lam) in sorted(self.expert_parallel_options.items())],
        })

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


# --------------------------------------------------------------------------------------------------
# Algorithm 1's steps
# --------------------------------------------------------------------------------------------------

def candidate_partitions(gpus: int, placement: str, gpus_per_node: int) -> list:
    """CandidatePartitions(G, Π): ``[(g_r, g_t), ...]`` in increasing g_r."""
    if placement not in ("node-aligned", "any"):
        raise ConfigError("cluster.placement", f"{placement!r} is not a placement", "use node-aligned or any")
    if placement == "any" or gpus <= gpus_per_node:
        return [(g, gpus - g) for g in range(1, gpus)]
    return [(g, gpus - g) for g in range(gpus_per_node, gpus, gpus_per_node)]


def compatible(rollout_gpus: int, trainer_gpus: int, rollout_layout: int, trainer_layout: int) -> bool:
    """Compatible(g_r, g_t, ρ_r, ρ_t): each pool holds whole replicas of both roles (§4.1)."""
    return all(g % rho == 0 and g > 0 for g in (rollout_gpus, trainer_gpus)
               for rho in (rollout_layout, trainer_layout))


def replica_count(gpus: int, layout: int) -> int:
    """ReplicaCount(g, ρ) = ⌊g / ρ⌋."""
    return int(gpus) // int(layout)


def min_feasible_layouts(cfg, hardware=None) -> tuple:
    """``(ρ_r, ρ_t, {"rollout": MemoryNeed, "trainer": MemoryNeed})`` or ConfigError naming the budget."""
    m, hw, w = cfg.model_spec, hardware or cfg.hardware_spec, cfg.workload
    max_seq = cfg.workload_stats.prompt_max + w.max_response_len
    mb = cfg.rl.micro_batch_per_device
    cands = memory.layout_candidates(cfg.cluster.gpus_per_node, cfg.cluster.gpus)
    gib = lambda x: f"{x / GiB:.1f} GiB"  # noqa: E731
    tokens = memory.micro_batch_tokens(cfg, max_seq)
    act = memory.trainer_activation_bytes(m, tokens, cfg.rl.activation_checkpointing)
    if act > memory.usable_bytes(hw):
        budget = cfg.rl.max_tokens_per_micro_batch
        what = (f"a token-budget micro-batch of {budget} tokens" if budget is not None else
                f"a micro-batch of {mb} samples × {max_seq} tokens"
                + (f" / rl.sequence_parallel {cfg.rl.sequence_parallel}" if cfg.rl.sequence_parallel > 1 else ""))
        key = "rl.max_tokens_per_micro_batch" if budget is not None else "rl.micro_batch_per_device"
        fix = ("lower rl.max_tokens_per_micro_batch (it must still hold the longest sample) or raise "
               "rl.sequence_parallel" if budget is not None else
               "lower rl.micro_batch_per_device, set rl.max_tokens_per_micro_batch (veRL's use_dynamic_bsz: a "
               "token budget per GPU) or raise rl.sequence_parallel, lower workload.max_response_len")
        raise ConfigError(key, f"{what} needs {gib(act)} of activations per GPU, more than the "
                          f"{gib(memory.usable_bytes(hw))} usable on {hw.name}; activations are not sharded by "
                          "FSDP, so a bigger trainer replica does not help", fix + ", or use a GPU with more memory")
    trainer_need = lambda k: memory.trainer_need(m, hw, k, mb, max_seq, tokens=tokens,  # noqa: E731
                                                 checkpointing=cfg.rl.activation_checkpointing)
    fixed_fsdp = cfg.rl.fsdp_size
    if fixed_fsdp is None:
        rho_t, need_t = memory.min_feasible_layout(trainer_need, cands)
    else:                                 # the job's own FSDP shard group: it must fit, it is never replaced
        need_t = trainer_need(fixed_fsdp)
        if not need_t.fits:
            raise ConfigError("rl.fsdp_size",
                              f"a {fixed_fsdp}-GPU FSDP shard group of {m.name} needs {gib(need_t.total)} per GPU "
                              f"(model states {gib(need_t.parts['model_states'])} sharded over {fixed_fsdp} GPUs, "
                              f"activations {gib(need_t.parts['activations'])}), more than the "
                              f"{gib(need_t.usable)} usable on {hw.name}",
                              "raise rl.fsdp_size (more GPUs share the states), lower "
                              "rl.max_tokens_per_micro_batch or rl.micro_batch_per_device, or leave it empty for the "
                              "smallest layout that fits")
        rho_t = fixed_fsdp
    fixed_tp = cfg.cluster.rollout_tensor_parallel
    if fixed_tp is None:
        rho_r, need_r = memory.min_feasible_layout(lambda k: memory.rollout_need(m, hw, k, w.group_size, max_seq),
                                                   cands)
    else:                                 # the job's own ρ_r: it must fit, it is never replaced
        need_r = memory.rollout_need(m, hw, fixed_tp, w.group_size, max_seq)
        if not need_r.fits:
            raise ConfigError("cluster.rollout_tensor_parallel",
                              f"a {fixed_tp}-GPU rollout replica of {m.name} needs {gib(need_r.total)} per GPU "
                              f"(weights {gib(need_r.parts['weights'])}, activation reserve "
                              f"{gib(need_r.parts['activation_reserve'])}, one group of {w.group_size} sequences of "
                              f"{max_seq} tokens {gib(need_r.parts['min_kv_cache'])}), more than the "
                              f"{gib(need_r.usable)} usable on {hw.name}",
                              "raise cluster.rollout_tensor_parallel (more GPUs per replica), lower "
                              "workload.group_size or max_response_len, or leave it empty for the smallest layout "
                              "that fits")
        rho_r = fixed_tp
    for role, rho, need in (("trainer", rho_t, need_t), ("rollout", rho_r, need_r)):
        if rho is None:
            raise ConfigError("cluster.gpus",
                              f"one {role} replica of {m.name} does not fit in {cfg.cluster.gpus} {hw.name} GPUs "
                              f"(at {need.layout} GPUs it needs {gib(need.total)} per GPU, {gib(need.usable)} "
                              "usable)",
                              "add GPUs, pick a hardware preset with more memory, or a smaller model")
    if 2 * max(rho_r, rho_t) > cfg.cluster.gpus:
        raise ConfigError("cluster.gpus",
                          f"{cfg.cluster.gpus} GPUs cannot hold a rollout pool and a trainer pool that each fit "
                          f"one replica of both roles (rollout replica {rho_r} GPUs, trainer replica {rho_t} GPUs)",
                          f"use at least {2 * max(rho_r, rho_t)} GPUs, a GPU with more memory, or a smaller model")
    return rho_r, rho_t, {"rollout": need_r, "trainer": need_t}


def representative_batch(cfg) -> tuple:
    """``(prompt_lens, response_lens)``: B_p groups of ``group_size`` requests, laid out group after group in
    group-id order — the first step's groups of the job's workload (:class:`bidirl.perf.workload.GroupLengths`
    with the config's seed), i.e. exactly the work the simulator runs in step 0."""
    w = cfg.workload
    lengths = GroupLengths.of(cfg, cfg.seed)
    groups = [lengths(g) for g in range(w.prompts_per_step)]
    p = np.repeat(np.array([prompt for prompt, _ in groups], dtype=np.int64), w.group_size)
    r = np.array([n for _, targets in groups for n in targets], dtype=np.int64)
    return p, r


def consumption_order(prompt_lens, response_lens, group_size: int) -> np.ndarray:
    """The order in which the trainer will see the batch's samples: groups in the order they are expected to
    complete (a group is done when its longest response is; generation of one step's groups starts together),
    each group's responses in order. Returns sample indices."""
    p, r = np.asarray(prompt_lens), np.asarray(response_lens)
    n_groups = p.size // group_size
    longest = r.reshape(n_groups, group_size).max(axis=1) + p.reshape(n_groups, group_size)[:, 0]
    groups = np.argsort(longest, kind="stable")
    return (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)


# --------------------------------------------------------------------------------------------------

def plan(config, *, progress: bool = False, hardware=None) -> Plan:
    """Algorithm 1 on ``config`` (a JobConfig, a YAML path, an example name or a mapping); see module doc.
    ``hardware`` replaces the config's hardware preset (a :class:`~bidirl.job.presets.HardwareSpec`, e.g. while a
    calibration tries knob values).

    Raises :class:`~bidirl.job.config.ConfigError` when no replica fits the budget (``cluster.gpus``), no
    candidate is compatible, or a fixed ``cluster.partition`` is not a compatible candidate.
    """
    cfg = cfgmod.load(config)
    G, gpn, placement = cfg.cluster.gpus, cfg.cluster.gpus_per_node, cfg.cluster.placement
    if G < 2:
        raise ConfigError("cluster.gpus", f"{G} GPU cannot be split into a rollout and a trainer pool",
                          "use at least 2 GPUs")
    rho_r, rho_t, needs = min_feasible_layouts(cfg, hardware)
    ep_r, ep_ts = expert_parallel_layouts(cfg, rho_r, rho_t)
    predictors = {ep: StagePredictor.from_config(cfg, rho_r, rho_t, hardware, expert_parallel=ep) for ep in ep_ts}
    rollout = predictors[ep_ts[0]].rollout
    p, r = representative_batch(cfg)
    stages = cfg.rl.stages
    w = cfg.workload
    n_groups, n_samples = w.prompts_per_step, p.size

    cands = candidate_partitions(G, placement, gpn)
    g_r = np.array([c[0] for c in cands], dtype=np.int64)
    g_t = np.array([c[1] for c in cands], dtype=np.int64)
    d_r, d_t = g_r // rho_r, g_t // rho_t
    ok = ((g_r % rho_r == 0) & (g_r % rho_t == 0) & (g_t % rho_r == 0) & (g_t % rho_t == 0))
    sp = cfg.rl.sequence_parallel             # both pools host trainers: whole sequence-parallel groups in each
    ok &= (g_r % sp == 0) & (g_t % sp == 0)

    # stage times per distinct (capped) replica count, shared by every candidate with that count; each model
    # evaluates all its counts in one vectorised pass (the same numbers as one count at a time)
    cap_r, cap_t = np.minimum(d_r, n_groups), np.minimum(d_t, n_samples)
    uniq_r, uniq_t = np.unique(cap_r[cap_r > 0]), np.unique(cap_t[cap_t > 0])
    # rollout: groups dispatched in group-id order; trainer: samples consumed in completion order
    g = w.group_size
    order = consumption_order(p, r, g)
    with _progress(progress, 1 + len(ep_ts)) as tick:
        times_r = rollout.stage_times(p, r, uniq_r.tolist(), g)
        tick()
        times_t = {}
        for ep in ep_ts:
            times_t[ep] = trainer_stage_times(cfg, predictors[ep].trainer, p[order], r[order], uniq_t.tolist(), stages)
            tick()
    # the step's end, charged as the simulator charges it (§4.2): the trainer's optimizer work on its g_t GPUs, then
    # the weight sync, during which the trainer waits for it and no rollout replica generates (the coordinator
    # starts nothing on the rollouters while the new weights are on their way), so it is in M_r and M_t both
    sync = cfg.weight_sync_time(hardware, rollout_layout=rho_r)
    optimizer_times = {ep: step_optimizer_times(cfg, predictors[ep], g_t) for ep in ep_ts}
    t_r = _per_candidate(cap_r, uniq_r, times_r) + sync
    with np.errstate(divide="ignore"):
        lam_r = np.where(np.isfinite(t_r) & (t_r > 0), n_groups / t_r, np.where(t_r == 0, math.inf, 0.0))
    rates = {}                                 # ep -> (t_t, λ_t, λ_pipe) per candidate
    for ep in ep_ts:
        t_t = _per_candidate(cap_t, uniq_t, times_t[ep]) + optimizer_times[ep] + sync
        with np.errstate(divide="ignore"):
            lam_t = np.where(np.isfinite(t_t) & (t_t > 0), n_groups / t_t, np.where(t_t == 0, math.inf, 0.0))
        rates[ep] = (t_t, lam_t, np.minimum(lam_r, lam_t))
    ep_t, options = choose_expert_parallel(rates, ok, cands, cfg.cluster.partition)
    opt_t = optimizer_times[ep_t]
    t_t, lam_t, lam = rates[ep_t]
    trainer = predictors[ep_t].trainer

    labels = [label(a, b) for a, b in cands]
    if cfg.cluster.partition is not None:
        want = (cfg.cluster.partition.rollout, cfg.cluster.partition.trainer)
        alternatives = ", ".join(lbl for lbl, good in zip(labels, ok) if good)
        if want not in cands:
            raise ConfigError("cluster.partition",
                              f"{label(*want)} is not a {placement} partition of {G} GPUs with {gpn} per node",
                              f"use a compatible one: {alternatives or 'none exists'}, or set cluster.placement: any")
        idx = cands.index(want)
        if not ok[idx]:
            raise ConfigError("cluster.partition",
                              f"{label(*want)} is not hot-switch compatible: each pool must hold whole replicas of "
                              f"both roles (rollout replica {rho_r} GPUs, trainer replica {rho_t} GPUs)",
                              f"use one of {alternatives}" if alternatives else
                              "no partition of this budget is compatible; change cluster.gpus")
        fixed = True
    else:
        if not ok.any():
            step = int(np.lcm(rho_r, rho_t))
            raise ConfigError("cluster.gpus",
                              f"no {placement} partition of {G} GPUs is hot-switch compatible with rollout "
                              f"replicas of {rho_r} GPUs and trainer replicas of {rho_t} GPUs",
                              f"use a budget that splits into two multiples of {step} GPUs"
                              + (" or set cluster.placement: any" if placement == "node-aligned" else ""))
        idx = int(np.argmax(np.where(ok, lam, -math.inf)))
        fixed = False

    chosen = np.zeros(len(cands), dtype=bool)
    chosen[idx] = True
    sweep = pd.DataFrame({
        "rollout_gpus": g_r, "trainer_gpus": g_t, "label": labels, "compatible": ok,
        "rollout_replicas": d_r, "trainer_replicas": d_t,
        "rollout_time": t_r, "trainer_time": t_t, "optimizer_time": opt_t, "sync_time": np.full(len(cands), sync),
        "rollout_rate": lam_r, "trainer_rate": lam_t, "pipeline_rate": lam, "chosen": chosen,
    })
    env = Envelope(rollout_gpus=int(g_r[idx]), trainer_gpus=int(g_t[idx]), rollout_layout=rho_r,
                   trainer_layout=rho_t, rollout_replicas=int(d_r[idx]), trainer_replicas=int(d_t[idx]),
                   pipeline_rate=float(lam[idx]), rollout_time=float(t_r[idx]), trainer_time=float(t_t[idx]),
                   rollout_rate=float(lam_r[idx]), trainer_rate=float(lam_t[idx]),
                   rollout_model=rollout, trainer_model=trainer, rollout_expert_parallel=ep_r,
                   trainer_expert_parallel=ep_t, optimizer_time=float(opt_t[idx]), sync_time=float(sync))
    return Plan(cfg, env, sweep, needs, (p, r), stages, fixed, options)


def expert_parallel_layouts(cfg, rho_r: int, rho_t: int) -> tuple:
    """``(ep_r, [ep_t, …])``: the rollout replica's EP degree and the trainer EP degrees the planner weighs
    (:mod:`bidirl.perf.expert_parallel`). ``cluster.rollout_expert_parallel`` (veRL's rollout
    ``expert_parallel_size``) must be 1 or ρ_r — at data parallel 1 it changes no modelled time or memory, so empty
    is 1; ``rl.expert_parallel`` fixes the trainer's, refused by name when it cannot shard the experts of a ρ_t
    replica; empty: every degree that can (:func:`~bidirl.perf.expert_parallel.expert_parallel_sizes`)."""
    from bidirl.perf import expert_parallel as ep_mod
    m, gpn = cfg.model_spec, cfg.cluster.gpus_per_node
    ep_r = cfg.cluster.rollout_expert_parallel or 1
    allowed = ep_mod.rollout_expert_parallel_sizes(m, rho_r)
    if ep_r not in allowed:
        raise ConfigError("cluster.rollout_expert_parallel",
                          f"{ep_r} is not an EP degree of a {rho_r}-GPU rollout replica of {m.name}: vLLM shards the "
                          "experts over the whole tensor-parallel engine (veRL: expert_parallel_size = "
                          "tensor_model_parallel_size × data_parallel_size, data parallel 1 here)",
                          f"use one of {', '.join(map(str, allowed))}, or leave it empty")
    fixed = cfg.rl.expert_parallel
    if fixed is None:
        return ep_r, ep_mod.expert_parallel_sizes(m, rho_t, gpn)
    problem = ep_mod.ep_problem(m, rho_t, fixed, gpn)
    if problem:
        raise ConfigError("rl.expert_parallel", f"an EP group of {fixed} GPUs cannot shard the experts of a "
                          f"{rho_t}-GPU trainer replica: {problem}",
                          f"use one of {', '.join(map(str, ep_mod.expert_parallel_sizes(m, rho_t, gpn)))}, or leave "
                          "it empty for the planner's choice")
    return ep_r, [fixed]


def choose_expert_parallel(rates: dict, ok: np.ndarray, cands: list, partition) -> tuple:
    """``(ep_t, {ep: (M_t, λ_pipe)})``: the trainer EP degree whose best compatible candidate (or the fixed
    ``cluster.partition``) has the largest pipeline rate; where the rollout bounds the pipeline and the rates tie,
    the faster trainer (more idle trainer time to lend, §3), then the smallest degree; ``rates[ep] = (t_t, λ_t,
    λ_pipe)`` per candidate. EP does not change which candidates are
    compatible (an EP group lies inside its replica), so every degree is weighed on the same candidates."""
    options = {}
    for ep, (t_t, _, lam) in rates.items():
        if partition is not None and (partition.rollout, partition.trainer) in cands:
            i = cands.index((partition.rollout, partition.trainer))
        elif ok.any():
            i = int(np.argmax(np.where(ok, lam, -math.inf)))
        else:
            i = 0
        options[int(ep)] = (float(t_t[i]), float(lam[i]))
    best = max(sorted(options), key=lambda ep: (options[ep][1], -options[ep][0], -ep))
    return best, options


def trainer_stage_times(cfg, trainer: TrainerModel, prompt_lens, response_lens, ds, stages) -> np.ndarray:
    """M_t of samples in consumption order on gangs of each size in ``ds``: micro-batches of
    ``rl.micro_batch_per_device`` samples per device, or with ``rl.max_tokens_per_micro_batch`` token-budget
    micro-batches (:meth:`~bidirl.perf.trainer.TrainerModel.packed_stage_time`).

    With optimizer mini-batches (``rl.mini_batch_prompts``) the update stage is cut as the chunk queue cuts it
    (§5.2): one segment per mini-batch, in batch order (:func:`~bidirl.core.protocol.mini_batch_bounds`), each
    mini-batch's samples cut into chunks on their own, so each mini-batch ends on a partial chunk (every stage's,
    in the reproducible mode, whose grid cells never span two mini-batches: ``rl.reproducible``); and each
    optimizer update that falls between two mini-batches of a local update is a barrier the next mini-batch's
    chunks wait for; those, like the step's own optimizer step, are :func:`step_optimizer_times`' (M_t is this plus
    that plus the weight sync)."""
    mini = cfg.rl.mini_batch_prompts
    p, r = np.asarray(prompt_lens), np.asarray(response_lens)
    if mini is None or mini >= cfg.prompts_per_local_update:
        return _chunk_stage_times(cfg, trainer, p, r, ds, stages)
    # the reproducible mode's grid cells never span two mini-batches in any stage (TrainerStep._cell_bounds)
    cut = stages if cfg.rl.reproducible_on else tuple(s for s in stages if s in UPDATE_STAGES)
    whole = tuple(s for s in stages if s not in cut)
    out = _chunk_stage_times(cfg, trainer, p, r, ds, whole) if whole else np.zeros(len(ds))
    if cut:
        # the mini-batches divide every local update, so cutting the step's samples cuts each local update's
        for lo, hi in mini_batch_bounds(p.size, mini * cfg.workload.group_size):
            out = out + _chunk_stage_times(cfg, trainer, p[lo:hi], r[lo:hi], ds, cut)
    return out


def step_optimizer_times(cfg, predictor: StagePredictor, trainer_gpus) -> np.ndarray:
    """The trainer's optimizer work of one step on each of ``trainer_gpus`` (g_t): its ``rl.updates_per_sync``
    local updates' optimizer time (:meth:`~bidirl.perf.predictor.StagePredictor.step_optimizer_time`: per optimizer
    update — one per mini-batch — the gradient all-reduce across the g_t/ρ_t replicas and the AdamW step over each
    GPU's shard, plus the offload copies and the driver's data path once per local update). The simulator's
    ``OptimizerStep`` commands of one step take the same seconds (``Assembly.optimizer_step_time``), the updates
    between two mini-batches as the barriers the next mini-batch's chunks wait for, the last one before the sync."""
    gpus = np.asarray(trainer_gpus, dtype=np.int64)
    return np.broadcast_to(predictor.step_optimizer_time(gpus, cfg.rl.updates_per_sync), gpus.shape).astype(float)


def _chunk_stage_times(cfg, trainer: TrainerModel, p, r, ds, stages) -> np.ndarray:
    """The chunk times of ``stages`` over samples ``p``, ``r`` cut into chunks from the first, per gang size."""
    budget = cfg.rl.max_tokens_per_micro_batch
    if budget is None:
        return trainer.stage_times(p, r, ds, cfg.rl.micro_batch_per_device, stages)
    return np.array([trainer.packed_stage_time(p, r, d, budget, stages) for d in ds])


def _per_candidate(caps: np.ndarray, distinct: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Each candidate's stage time from the times of the distinct replica counts (inf with no replica)."""
    out = np.full(caps.size, math.inf)
    busy = caps > 0
    out[busy] = np.asarray(times, dtype=float)[np.searchsorted(distinct, caps[busy])]
    return out


@contextlib.contextmanager
def _progress(enabled: bool, total: int):
    """A tqdm bar over the stage models (``tick()`` after each), or nothing."""
    if not enabled:
        yield lambda: None
        return
    from tqdm.auto import tqdm
    with tqdm(total=total, desc="stage times", unit="model") as bar:
        yield lambda: bar.update(1)


def predict_stage_times(plan: Plan, prompt_lens, response_lens, consumed=None) -> tuple:
    """``(M_r, M_t)`` in seconds of one batch on the envelope's replicas, with the planner's models.

    ``prompt_lens`` / ``response_lens`` hold ``group_size`` requests per group, laid out group after group in the
    order the groups are dispatched to the rollout replicas (group-id order); ``consumed`` is the order in which
    the trainer sees the samples (indices; default :func:`consumption_order`). Both hold the step's end as the
    envelope charges it: M_r the weight sync, M_t the step's optimizer work and the weight sync."""
    env, cfg = plan.envelope, plan.config
    p, r = np.asarray(prompt_lens), np.asarray(response_lens)
    order = consumption_order(p, r, cfg.workload.group_size) if consumed is None else np.asarray(consumed)
    t_r = env.rollout_model.stage_time(p, r, env.rollout_replicas, cfg.workload.group_size) + env.sync_time
    t_t = float(trainer_stage_times(cfg, env.trainer_model, p[order], r[order], [env.trainer_replicas],
                                    plan.stages)[0]) + env.optimizer_time + env.sync_time
    return float(t_r), float(t_t)


# --------------------------------------------------------------------------------------------------
# the real runtime's rollout memory (§4.1's memory model, both roles of a GPU: §3.2)
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVBudget:
    """The KV cache of each rollout GPU in an engine run: ``bytes`` (vLLM's ``kv_cache_memory_bytes``) and the
    ``tokens`` they hold in whole blocks of ``block_tokens``, at ``bytes_per_token`` (b_kv of the checkpoint at
    the engine's dtype and tensor parallelism). ``source``: ``"config"`` (``cluster.rollout_kv_cache_gib``) or
    ``"planner"`` (:func:`rollout_kv_budget`); ``terms``: the bytes the budget was derived from."""
    bytes: int
    tokens: int
    block_tokens: int
    bytes_per_token: int
    source: str
    terms: dict = field(default_factory=dict)

    @property
    def gib(self) -> float:
        return self.bytes / GiB

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "gib": self.gib, "tokens": self.tokens, "block_tokens": self.block_tokens,
                "bytes_per_token": self.bytes_per_token, "source": self.source, "terms": dict(self.terms)}


def rollout_kv_budget(plan: Plan, *, device: str, kv_shape: tuple, dtype_bytes: int, max_prompt_len: int,
                      max_seqs: int, windows: int = 1) -> KVBudget:
    """The KV budget of each rollout GPU of an engine run of ``plan`` (one rollout replica per GPU,
    ``plan.envelope.rollout_layout`` = 1), on ``device`` (``"cuda"`` or ``"cpu"``), for a checkpoint whose
    attention is ``kv_shape`` = (layers, KV heads, head dim) computed in ``dtype_bytes``-byte values, prompts
    of at most ``max_prompt_len`` tokens and engines running at most ``max_seqs`` sequences (vLLM's
    ``max_num_seqs``).

    ``cluster.rollout_kv_cache_gib`` when the job sets it; otherwise the memory model's: the least of

    * what both roles of one GPU leave (:func:`bidirl.perf.memory.colocated_kv_limit`: usable memory less the
      rollout weights, the activation reserve and the trainer rank beside it while it loads), and
    * what the rollouter can ever fill: ``min(max_seqs, ⌊(1 + s)·B_p⌋·group_size)`` sequences (at most
      ``⌊(1 + s)·B_p⌋`` groups are admitted and not yet consumed, ``bidirl.core.staleness``) of
      ``max_prompt_len + workload.max_response_len`` tokens, each in whole blocks,

    rounded down to whole blocks. Raises :class:`ConfigError` when the budget cannot hold one sequence of
    prompt + ``max_response_len`` tokens or when a configured budget does not fit beside the trainer, and
    :class:`DeviceMemoryError` when what an active trainer rank keeps beside its switched-out rollouter does not fit
    one GPU (:func:`check_device_budget`, with ``windows`` auxiliary windows per step).
    """
    cfg, env = plan.config, plan.envelope
    m, hw, w = cfg.model_spec, cfg.hardware_spec, cfg.workload
    tp, key = env.rollout_layout, "cluster.rollout_kv_cache_gib"
    layers, kv_heads, head_dim = kv_shape
    per_token = memory.attention_kv_bytes(layers, kv_heads, head_dim, dtype_bytes, tp)
    block = memory.KV_BLOCK_TOKENS[device]
    max_seq = int(max_prompt_len) + w.max_response_len
    one = memory.sequence_blocks(max_seq, block) * block
    gib = lambda x: f"{x / GiB:.4g} GiB"  # noqa: E731
    # the trainer rank beside the rollouter: loading (unsharded fp32 weights, the reference in the compute dtype);
    # on CPU the switched-out trainer's host buffer shares the same memory, so its model states count as well
    reference = (2 if device == "cuda" else 4) if cfg.rl.kl_coef > 0 else 0
    beside = memory.trainer_load_bytes(m, reference)
    if device == "cpu":
        beside = max(beside, memory.trainer_state_bytes(m, env.trainer_layout))
    usable = memory.usable_bytes(hw)
    weights, reserve = memory.rollout_weight_bytes(m, tp), memory.rollout_reserve_bytes(m, tp)
    limit = memory.colocated_kv_limit(m, hw, tp, beside)
    split = (f"the usable {gib(usable)} per GPU of {hw.name} ({hw.memory_bytes / GiB:g} GiB × memory_utilization "
             f"{hw.memory_utilization:g}) less {m.name}'s rollout weights {gib(weights)}, the activation reserve "
             f"{gib(reserve)} and the trainer rank beside it while it loads {gib(beside)}")
    check_device_budget(plan, device=device, windows=windows)     # an active trainer rank beside its sleeping rollouter
    terms = {"usable": usable, "rollout_weights": weights, "activation_reserve": reserve, "trainer_beside": beside,
             "colocated_limit": limit}
    shape = (f"{per_token:,} bytes per token ({layers} layers × {max(1, kv_heads // tp)} KV heads × {head_dim} × 2 "
             f"(keys, values) × {dtype_bytes} bytes) in blocks of {block}")
    if cfg.cluster.rollout_kv_cache_gib is not None:
        nbytes, source = int(cfg.cluster.rollout_kv_cache_gib * GiB), "config"
        if nbytes > limit:
            raise ConfigError(key, f"{cfg.cluster.rollout_kv_cache_gib:g} GiB per rollout GPU does not fit beside the "
                              f"trainer on the same GPU: at most {gib(max(0.0, limit))} is left, {split}",
                              f"set at most {max(0.0, limit) / GiB:.4g}, or leave it empty for the planner's budget")
    else:
        in_flight = math.floor((1 + cfg.rl.staleness) * w.prompts_per_step) * w.group_size
        cap = min(int(max_seqs), in_flight) * one * per_token
        terms.update(concurrency_cap=cap, sequences=min(int(max_seqs), in_flight))
        nbytes, source = int(max(0.0, min(limit, cap))), "planner"
    tokens = memory.kv_cache_tokens(nbytes, per_token, block)
    if source == "planner":
        nbytes = tokens * per_token                      # whole blocks: what vLLM will use of it
    if tokens < one:
        need = one * per_token
        problem = ("" if source == "config" else "(empty: the planner's budget) ") + (
                   f"a KV cache of {gib(nbytes)} ({nbytes:,} bytes) per rollout GPU holds {tokens:,} tokens of this "
                   f"model — {shape} — fewer than the {one:,} tokens one sequence takes (prompt {max_prompt_len} + "
                   f"workload.max_response_len {w.max_response_len} = {max_seq} tokens, in whole blocks)")
        if source == "config" or need <= limit:
            fix = (f"set {key} to at least {need / GiB:.4g} GiB (up to {max(0.0, limit) / GiB:.4g} fits beside the "
                   "trainer), leave it empty for the planner's budget, or lower workload.max_response_len")
        else:
            fix = (f"the planner's budget is {split}: use a hardware preset with more memory per GPU, a smaller "
                   "model, or lower workload.max_response_len")
        raise ConfigError(key, problem, fix)
    return KVBudget(int(nbytes), int(tokens), int(block), int(per_token), source, terms)


# --------------------------------------------------------------------------------------------------
# the engine run's device budget: everything a trainer-pool GPU slot holds (§3.2, §4.1)
# --------------------------------------------------------------------------------------------------

class DeviceMemoryError(ConfigError):
    """A trainer-pool GPU slot of an engine run would run out of memory: ``budget`` is the
    :class:`~bidirl.perf.memory.DeviceBudget`, ``terms`` the terms without any one of which it would fit (empty
    when no single term is enough), ``term`` the one named first (a term a job setting changes, when one does:
    :data:`_PREFERRED`; else the largest), ``over_by`` the bytes beyond the usable memory at the peak, ``phase`` the
    phase of the rank's cycle that peaks."""

    def __init__(self, field: str, problem: str, fix: str, budget, term: str, terms: list):
        super().__init__(field, problem, fix)
        self.budget, self.term, self.terms = budget, term, list(terms)
        self.over_by, self.phase = budget.over_by, budget.peak_phase


#: per term of the device budget: the setting to change and the sentence that says how
_TERM_FIXES = {
    "weights": ("hardware", "a GPU with more memory or a smaller model (the fp32 weights are sharded over the "
                "trainer replica)"),
    "gradients": ("hardware", "a GPU with more memory or a smaller model (the fp32 gradient is sharded over the "
                  "trainer replica)"),
    "optimizer_state": ("hardware", "a GPU with more memory or a smaller model (AdamW's moments are sharded over the "
                        "trainer replica), or rl.optimizer_offload: true when a chunk peaks (the moments then stay "
                        "in host memory between optimizer steps)"),
    "reference": ("rl.kl_coef", "set rl.kl_coef: 0 and rl.reference_model: false (no reference model is loaded)"),
    "published_versions": ("transport.weights", "set transport.weights: object_store (no versions kept on the "
                           "device; the weights go through Ray's object store)"),
    "window_shards": ("scheduler.policy", "run a policy that does not lend the rollout pool to training (rot-only or "
                      "no-borrow: no auxiliary windows to keep until the optimizer step)"),
    "order_buffers": ("rl.reproducible", "set rl.reproducible: false (chunk gradients then add in the order they "
                      "finish: one window shard instead of one shard per auxiliary chunk), or a policy that does not "
                      "lend the rollout pool to training"),
    "apply_sum": ("scheduler.policy", "run a policy that does not lend the rollout pool to training (rot-only or "
                  "no-borrow: the optimizer step then sums no window beside the gradient)"),
    "optimizer_step": ("hardware", "a GPU with more memory, or more GPUs per trainer replica (AdamW's temporaries: "
                       "on CUDA a copy of the rank's second moments, torch's foreach path; on CPU two copies of the "
                       "largest parameter's shard)"),
    "activations": ("rl.micro_batch_per_device", "lower rl.micro_batch_per_device or workload.max_response_len "
                    "(activations are not sharded)"),
    "fsdp_unsharded": ("hardware", "a GPU with more memory, or a smaller model (FSDP2 unshards the embedding and two "
                       "blocks whatever the replica's size)"),
    "transport_buckets": ("transport.bucket_mb", "lower transport.bucket_mb (a bucket is gathered, cut and sent "
                          "beside training), or set transport.weights: object_store"),
    "rollout_beside": ("hardware", "a GPU with more memory, or a smaller model (the trainer pool's switched-out "
                       "rollouter keeps its activation reserve on the same GPU)"),
    "offload_buffer": ("hardware", "more memory for the CPU slot (hardware's memory_bytes): a CPU engine keeps its hot "
                       "switch's host buffer, the size of its state, in the same memory"),
}


#: the terms a job's settings change, named first when several would each make a budget fit
_PREFERRED = ("published_versions", "window_shards", "order_buffers", "apply_sum", "reference", "activations",
              "transport_buckets")


def device_budget(plan: "Plan", *, device: str, windows: int = 1, layout: Optional[int] = None):
    """The :class:`~bidirl.perf.memory.DeviceBudget` of a primary trainer rank of an engine run of ``plan`` on
    ``device`` (``"cuda"`` or ``"cpu"``), receiving ``windows`` auxiliary windows per step (0 under a policy
    without Trainer-on-RolloutPool), at the plan's trainer layout ρ_t (or ``layout``)."""
    cfg = plan.config
    w = cfg.workload
    max_seq = cfg.workload_stats.prompt_max + w.max_response_len
    # the engines' own default: checkpointing on for trainers on CUDA, off on CPU (RLConfig.activation_checkpointing)
    checkpointing = cfg.rl.activation_checkpointing
    if checkpointing is None:
        checkpointing = device == "cuda"
    return memory.device_budget(cfg.model_spec, cfg.hardware_spec, layout or plan.envelope.trainer_layout,
                                micro_batch_per_device=cfg.rl.micro_batch_per_device, max_seq_len=max_seq,
                                tokens=memory.micro_batch_tokens(cfg, max_seq), checkpointing=checkpointing,
                                device=device,
                                kl_coef=cfg.rl.kl_coef, weights_transport=cfg.transport.weights,
                                bucket_bytes=cfg.transport.bucket_mb * 2 ** 20, windows=windows,
                                gang_ranks=plan.envelope.trainer_gpus, param_offload=cfg.rl.param_offload,
                                optimizer_offload=cfg.rl.optimizer_offload,
                                order_chunks=order_chunks(plan) if windows else 0)


def order_chunks(plan: "Plan") -> int:
    """The auxiliary update chunks one local update may hand the primary gang in the reproducible mode (each kept
    as its own shard until its place in the ordered sum, ``perf.memory``'s ``order_buffers``): every cell of the
    update's grid but the primary's first — the scheduler gives the primaries work first, and the auxiliaries may
    take all the rest. 0 outside the mode."""
    cfg = plan.config
    if not cfg.rl.reproducible_on:
        return 0
    env, w = plan.envelope, cfg.workload
    samples = w.prompts_per_step * w.group_size // max(1, cfg.rl.updates_per_sync)
    cell = cfg.rl.micro_batch_per_device * env.trainer_layout * env.trainer_replicas
    return max(0, -(-samples // cell) - 1)


def check_device_budget(plan: "Plan", *, device: str, windows: int = 1):
    """Refuse an engine run whose trainer-pool GPU slot cannot hold what the engines keep there
    (:func:`device_budget`) before any actor starts: a :class:`DeviceMemoryError` naming the terms without any one
    of which it would fit, by how much it does not, the phase that peaks and what to change. Returns the budget."""
    budget = device_budget(plan, device=device, windows=windows)
    if budget.fits:
        return budget
    cfg = plan.config
    hw, m, rho = cfg.hardware_spec, cfg.model_spec, plan.envelope.trainer_layout
    gib = lambda x: f"{x / GiB:.2f} GiB"  # noqa: E731
    terms, blocking = budget.terms(), budget.blocking_terms()
    held = ", ".join(f"{t} {gib(terms[t])}" for t in budget.phases()[budget.peak_phase] if terms[t] > 0)
    problem = (f"a trainer rank of {m.name} ({rho} GPUs per trainer replica) on {hw.name} needs {gib(budget.peak)} "
               f"at its {budget.peak_phase} peak, {gib(budget.over_by)} more than the usable {gib(budget.usable)} "
               f"({hw.memory_bytes / GiB:g} GiB × memory_utilization {hw.memory_utilization:g}); ")
    if blocking:
        named = min(blocking, key=lambda t: (_PREFERRED.index(t) if t in _PREFERRED else len(_PREFERRED), -terms[t]))
        problem += ("it would fit without any one of "
                    + ", ".join(f"{t} ({gib(terms[t])})" for t in blocking) + f"; it holds {held}")
    else:
        named = "optimizer_state"
        problem += f"no single term is enough: it holds {held}"
    fixes = [named] + [t for t in blocking if t != named and t in _PREFERRED]
    fix = "; ".join(f"{t}: {_TERM_FIXES[t][1]}" for t in fixes)
    larger = next((k for k in memory.layout_candidates(cfg.cluster.gpus_per_node, cfg.cluster.gpus) if k > rho
                   and device_budget(plan, device=device, windows=windows, layout=k).fits), None)
    if larger is not None:
        at = device_budget(plan, device=device, windows=windows, layout=larger).peak
        fix += (f" (a trainer replica of {larger} GPUs would fit, {gib(at)} per GPU; the planner sizes it at {rho} "
                "GPUs by its §4.1 model, which counts model states and activations only)")
    raise DeviceMemoryError(_TERM_FIXES[named][0], f"{named} does not fit: {problem}", fix, budget, named, blocking)
