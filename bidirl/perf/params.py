"""Default stage-time model parameters derived from a hardware preset's specifications.

These are priors: :mod:`bidirl.perf.fit` refits them from profiling records (paper §5.1, online
profiler; appendix, "Stage-Time Models": "τ_s, α_s and r_s are calibrated from profiling runs"). Every number
below is either a datasheet value times an achieved-efficiency factor from the hardware preset
(``train_mfu``, ``prefill_mfu``, ``decode_mbu``, whose sources the preset lists) or one of the engine-overhead
*knobs*, which the preset may set and which default to the constants below, each stated as an assumption:
``kernel_overhead_per_layer``, ``scheduler_overhead`` and ``decode_token_overhead``. The efficiency factors
and the overhead knobs together are :data:`KNOBS`: what ``bidirl calibrate`` fits to measured records, so a
calibration made with one model carries over to other models on the same hardware.

Trainer, for a replica of ρ = ``layout`` GPUs (FSDP data parallel inside the replica; each GPU runs
``micro_batch_per_device`` samples, so the replica computes at ρ times one GPU's rate):

* ``alpha_s = 1 / (ρ · peak_flops · train_mfu)`` seconds per FLOP, every stage;
* ``tau_s = m_s · L · kernel_overhead_per_layer`` — eager PyTorch launches ≈20 kernels per layer per pass,
  ≈10 µs each (the default, :data:`KERNEL_OVERHEAD_PER_LAYER`);
* ``alpha_comm_s = k_s · L · collective latency`` with ``k_s`` collectives per layer (1 all-gather for the
  forward stages; all-gather, all-gather, reduce-scatter for the update); 0 for ρ = 1 (no collectives);
* ``beta_comm_s = 1 / ring bandwidth`` (intra-node for ρ ≤ gpus_per_node, else the node's network,
  :func:`ring_bandwidth`);
* ``r_s = 2`` (partial overlap of FSDP prefetch with compute);
* ``beta_mem_s = 0``: seconds per byte of the actor update's saved activations that spill out of the device's
  last-level cache (:func:`bidirl.perf.trainer.spill_bytes`). No datasheet number gives it, so the priors leave it
  out; ``bidirl calibrate`` fits it on profiling records (:func:`bidirl.perf.fit.calibrate_trainer` with
  ``fit_spill_cost``) where the preset states ``cache_bytes``, and writes it to ``stage_params``.

Rollout, for a vLLM replica with tensor parallelism ``tp`` (the decoder only: the vision encoder runs once per
request in prefill, charged apart by :func:`bidirl.perf.flops.prefill_flops_of_sums`):

* ``alpha_pre = 1 / (tp · peak_flops · prefill_mfu)``;
* ``tau_pre = L · kernel_overhead_per_layer + scheduler_overhead`` per prefill wave (prefill is not
  CUDA-graphed);
* ``tau_dec = decoder weight bytes / (tp · memory_bandwidth · decode_mbu) + scheduler_overhead`` — every decode
  iteration streams the weights once; the scheduler/sampler step is the overhead (default
  :data:`SCHEDULER_OVERHEAD`);
* ``beta_tok = (2·N_dec + 2·H·V) / (tp · peak_flops · prefill_mfu) + decode_token_overhead`` — the per-token
  matmul FLOPs of the decoder (``N_dec = N_nonemb − vision params``) and the head, plus the engine's work per
  running sequence and iteration (sampling, logits processors, output handling; default 0);
* ``beta_hist = b_kv(tp) / (memory_bandwidth · decode_mbu) + 4·L·H / (tp · peak_flops · prefill_mfu)`` — every
  context token's KV cache is read once per iteration, plus its attention FLOPs;
* ``c_pre``, ``c_dec``: seconds per prompt / generated token of tensor-parallel communication,
  ``2·L`` all-reduces of ``H·b_dtype`` bytes per token moving ``2(tp−1)/tp`` of the message over the link;
  0 for ``tp = 1``. The appendix names C_pre and C_dec without a form; this package uses
  ``C_pre = c_pre·Σp`` and ``C_dec = c_dec·N_tok`` (see :mod:`bidirl.perf.rollout`).
* ``r = 2``.
* ``gamma_req = 0``: seconds of engine work per request admitted (P_pre's per-request term,
  :func:`bidirl.perf.rollout.request_admission_time`). No datasheet number gives it, so the priors leave it out;
  ``bidirl calibrate`` fits it on profiling records (:func:`bidirl.perf.fit.calibrate_rollout` with
  ``fit_request_cost``) and writes it to the preset's ``stage_params``, the only place it is non-zero.

**Per-model overrides.** Where the knobs cannot express what was measured for one model (e.g. a stage whose
fixed cost is not m_s times the forward's), a hardware preset may carry fitted appendix parameters in its
``stage_params`` block, keyed by model name: ``rollout`` (:class:`~bidirl.perf.rollout.RolloutParams` fields,
for replicas of ``tp`` GPUs) and ``trainer`` (:class:`~bidirl.perf.trainer.TrainerParams` fields, one value
or one per stage, for replicas of ``layout`` GPUs). :func:`default_rollout_params` /
:func:`default_trainer_params` use them for that model and layout, and the knob-derived values
(:func:`knob_rollout_params` / :func:`knob_trainer_params`) for every field they leave out and everywhere
else. :func:`check_stage_params` validates the block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping

import numpy as np

from bidirl.perf.flops import STAGE_MULTIPLIER, STAGES, decoder_params_nonembedding





@dataclass(frozen=True)
class TrainerParams:
    """Per-stage parameters of t_s(b): ``tau`` (s), ``alpha`` (s/FLOP), ``r`` (≥ 1), ``alpha_comm`` (s),
    ``beta_comm`` (s/byte), ``beta_mem`` (s per byte of saved activations beyond the device's cache,
    :func:`bidirl.perf.trainer.spill_bytes`; 0 unless calibrated on records). Each is a mapping
    ``stage -> value`` holding every stage of :data:`bidirl.perf.flops.STAGES`."""
    tau: Mapping[str, float]
    alpha: Mapping[str, float]
    r: Mapping[str, float]
    alpha_comm: Mapping[str, float]
    beta_comm: Mapping[str, float]
    beta_mem: Mapping[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})

    def __post_init__(self):
        for f in fields(self):
            raw = getattr(self, f.name)
            if not isinstance(raw, Mapping):
                raise ValueError(f"TrainerParams.{f.name} must map each stage to a number, got {raw!r}")
            missing = [s for s in STAGES if s not in raw]
            unknown = [s for s in raw if s not in STAGE_MULTIPLIER]
            if missing or unknown:
                raise ValueError(f"TrainerParams.{f.name}: missing stages {missing}, unknown stages {unknown}; "
                                 f"give one value for each of {', '.join(STAGES)}")
            values = {s: float(raw[s]) for s in STAGES}
            low = 1.0 if f.name == "r" else 0.0
            bad = {s: v for s, v in values.items() if not np.isfinite(v) or v < low}
            if bad:
                raise ValueError(f"TrainerParams.{f.name} must be finite and ≥ {low:g}, got {bad}")
            object.__setattr__(self, f.name, values)

    @classmethod
    def uniform(cls, tau: float, alpha: float, r: float, alpha_comm: float, beta_comm: float) -> "TrainerParams":
        """The same values for every stage."""
        return cls(*({s: v for s in STAGES} for v in (tau, alpha, r, alpha_comm, beta_comm)))

    def vector(self, name: str) -> np.ndarray:
        """``name``'s values in :data:`STAGES` order."""
        values = getattr(self, name)
        return np.array([values[s] for s in STAGES], dtype=float)


@dataclass(frozen=True)
class RolloutParams:
    """Rollout model parameters (seconds, seconds per FLOP / token / context token; r ≥ 1)."""
    tau_pre: float
    alpha_pre: float
    tau_dec: float
    beta_tok: float
    beta_hist: float
    r: float = 2.0
    c_pre: float = 0.0
    c_dec: float = 0.0
    gamma_req: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            low = 1.0 if f.name == "r" else 0.0
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not np.isfinite(v) or v < low:
                raise ValueError(f"RolloutParams.{f.name} must be a finite number ≥ {low:g}, got {v!r}")
            object.__setattr__(self, f.name, float(v))


#: seconds of kernel-launch overhead per layer per forward pass (≈20 kernels × ≈10 µs, eager PyTorch)
KERNEL_OVERHEAD_PER_LAYER = 2.0e-4
#: seconds of engine-side work per prefill wave / decode iteration (vLLM scheduler, sampler, graph replay)
SCHEDULER_OVERHEAD = 1.0e-3
#: latency of one NCCL collective inside a node / across nodes (seconds)
COLLECTIVE_LATENCY_INTRA = 3.0e-5
COLLECTIVE_LATENCY_INTER = 1.0e-4
#: tensor-parallel all-reduces per transformer layer per forward pass: one after attention's output projection,
#: one after the MLP's down projection (Megatron-LM's layout, Shoeybi et al. 2019, arXiv:1909.08053 §3, Fig. 3:
#: "two all-reduce operations in the forward path"; vLLM's RowParallelLinear does the same). Each costs
#: :func:`collective_latency` per prefill wave / decode iteration on top of its bytes (``c_pre``/``c_dec``).
TP_ALLREDUCES_PER_LAYER = 2
#: FSDP collectives per layer per micro-batch: forward all-gather; update adds the backward all-gather and
#: the gradient reduce-scatter
COLLECTIVES_PER_LAYER = {"old_logprob": 1, "ref_logprob": 1, "actor_update": 3}
#: default p-norm overlap exponent (appendix: fitted; 1 = no overlap, ∞ = perfect overlap)
DEFAULT_OVERLAP_R = 2.0
#: seconds of engine work per running sequence per decode iteration beyond its FLOPs (0: none assumed)
DECODE_TOKEN_OVERHEAD = 0.0

#: the hardware preset fields the priors are built from (what ``bidirl calibrate`` fits): efficiency factors
#: (fractions of peak, in (0, 1]) and overheads (seconds, ≥ 0), with the defaults a preset may leave out
EFFICIENCY_KNOBS = ("train_mfu", "prefill_mfu", "decode_mbu")
OVERHEAD_KNOBS = {"kernel_overhead_per_layer": KERNEL_OVERHEAD_PER_LAYER, "scheduler_overhead": SCHEDULER_OVERHEAD,
                  "decode_token_overhead": DECODE_TOKEN_OVERHEAD}
KNOBS = EFFICIENCY_KNOBS + tuple(OVERHEAD_KNOBS)
ROLLOUT_LAYOUT_KEY, TRAINER_LAYOUT_KEY = "tp", "layout"


def _check_layout(layout, name):
    if isinstance(layout, bool) or int(layout) != layout or layout < 1:
        raise ValueError(f"{name} must be a whole number of GPUs ≥ 1, got {layout!r}")
    return int(layout)


def link_bandwidth(hw, gpus):
    """The collective bandwidth of a ``gpus``-GPU group: intra-node if it fits in one node, else inter-node (an
    array of group sizes gives one bandwidth each: the planner's scan over candidates)."""
    if np.ndim(gpus):
        return np.where(np.asarray(gpus) <= hw.gpus_per_node, float(hw.intra_node_bandwidth),
                        float(hw.inter_node_bandwidth))
    return hw.intra_node_bandwidth if gpus <= hw.gpus_per_node else hw.inter_node_bandwidth


def ring_bandwidth(hw, gpus: int) -> float:
    """Bus bandwidth of a ring collective (FSDP's all-gathers and reduce-scatters) over ``gpus`` contiguous GPUs:
    the intra-node bandwidth inside a node; across nodes a ring enters and leaves each node once per channel and
    NCCL spreads its channels over the node's NICs, so the slowest link of the ring is the node's network,
    ``gpus_per_node · inter_node_bandwidth`` (the preset's per-GPU share times the node's GPUs), or NVLink if slower:
    ``min(intra, gpus_per_node · inter)`` (NVIDIA nccl-tests ``doc/PERFORMANCE.md``: a collective's bus bandwidth
    is what compares with the hardware's peak link bandwidth). Point-to-point copies that every GPU of a node makes
    at once (weight sync, all-to-alls) get the per-GPU share instead (:func:`link_bandwidth`)."""
    if gpus <= hw.gpus_per_node:
        return float(hw.intra_node_bandwidth)
    return min(float(hw.intra_node_bandwidth), hw.gpus_per_node * float(hw.inter_node_bandwidth))


def collective_latency(hw, gpus: int) -> float:
    return COLLECTIVE_LATENCY_INTRA if gpus <= hw.gpus_per_node else COLLECTIVE_LATENCY_INTER


def tp_allreduce_latency(model, hw, tp: int) -> float:
    """Seconds of all-reduce latency per prefill wave or decode iteration of a ``tp``-way rollout replica:
    :data:`TP_ALLREDUCES_PER_LAYER` · L · :func:`collective_latency` (0 at tp = 1). The bytes of those all-reduces
    are ``c_pre``/``c_dec`` (per token); this is the fixed cost a small decode batch pays whatever its size."""
    if int(tp) <= 1:
        return 0.0
    return TP_ALLREDUCES_PER_LAYER * model.layers * collective_latency(hw, int(tp))


def knob(hw, name: str) -> float:
    """The value of knob ``name`` on ``hw`` (an overhead knob the preset leaves out takes its default)."""
    value = getattr(hw, name, None)
    if value is None:
        if name not in OVERHEAD_KNOBS:
            raise ValueError(f"hardware {getattr(hw, 'name', hw)!r} has no {name!r}")
        return OVERHEAD_KNOBS[name]
    return float(value)


def _override(hw, model, kind: str, layout: int):
    """The ``stage_params`` entry of ``model`` for ``kind`` when it was fitted for ``layout`` GPUs, else None."""
    block = (getattr(hw, "stage_params", None) or {}).get(getattr(model, "name", None)) or {}
    entry = block.get(kind)
    key = ROLLOUT_LAYOUT_KEY if kind == "rollout" else TRAINER_LAYOUT_KEY
    if not entry or int(entry.get(key, 0)) != layout:
        return None
    return {k: v for k, v in entry.items() if k != key}


def default_trainer_params(model, hw, layout: int = 1):
    """:class:`~bidirl.perf.trainer.TrainerParams` for ``model`` on ``hw`` with ρ = ``layout`` GPUs per replica:
    the knob-derived priors, with the preset's ``stage_params`` override for this model and layout applied."""
    rho = _check_layout(layout, "layout")
    base = knob_trainer_params(model, hw, rho)
    over = _override(hw, model, "trainer", rho)
    if not over:
        return base
    maps = {f: dict(getattr(base, f)) for f in TRAINER_FIELDS}
    for f, value in over.items():
        maps[f].update(value if isinstance(value, dict) else {s: value for s in STAGES})
    return TrainerParams(**maps)


def knob_trainer_params(model, hw, layout: int = 1):
    """The trainer priors from the hardware's datasheet numbers and knobs alone (no per-model override)."""
    rho = _check_layout(layout, "layout")
    alpha = 1.0 / (rho * hw.peak_flops * hw.train_mfu)
    lat = collective_latency(hw, rho) if rho > 1 else 0.0
    return TrainerParams(
        tau={s: STAGE_MULTIPLIER[s] * model.layers * knob(hw, "kernel_overhead_per_layer") for s in STAGES},
        alpha={s: alpha for s in STAGES},
        r={s: DEFAULT_OVERLAP_R for s in STAGES},
        alpha_comm={s: COLLECTIVES_PER_LAYER[s] * model.layers * lat for s in STAGES},
        beta_comm={s: 1.0 / ring_bandwidth(hw, rho) for s in STAGES},
    )


def default_rollout_params(model, hw, tp: int = 1):
    """:class:`~bidirl.perf.rollout.RolloutParams` for ``model`` on ``hw`` with tensor parallelism ``tp``: the
    knob-derived priors, with the preset's ``stage_params`` override for this model and ``tp`` applied."""
    import dataclasses
    tp = _check_layout(tp, "tp")
    base = knob_rollout_params(model, hw, tp)
    over = _override(hw, model, "rollout", tp)
    return dataclasses.replace(base, **over) if over else base


def knob_rollout_params(model, hw, tp: int = 1):
    """The rollout priors from the hardware's datasheet numbers and knobs alone (no per-model override)."""
    tp = _check_layout(tp, "tp")
    compute = tp * hw.peak_flops * hw.prefill_mfu
    decoder_params = model.params_total - model.vision_params
    decoder_nonemb = decoder_params_nonembedding(model)
    if tp > 1:
        per_token_bytes = 2 * model.layers * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp
        c_tok = per_token_bytes / link_bandwidth(hw, tp)
    else:
        c_tok = 0.0
    sched = knob(hw, "scheduler_overhead")
    allreduce = tp_allreduce_latency(model, hw, tp)
    return RolloutParams(
        tau_pre=model.layers * knob(hw, "kernel_overhead_per_layer") + sched + allreduce,
        alpha_pre=1.0 / compute,
        tau_dec=decoder_params * model.dtype_bytes / (tp * hw.memory_bandwidth * hw.decode_mbu) + sched + allreduce,
        beta_tok=((2.0 * decoder_nonemb + 2.0 * model.hidden * model.vocab) / compute
                  + knob(hw, "decode_token_overhead")),
        beta_hist=(model.kv_bytes_per_token(tp) / (hw.memory_bandwidth * hw.decode_mbu)
                   + 4.0 * model.layers * model.hidden / compute),
        r=DEFAULT_OVERLAP_R,
        c_pre=c_tok,
        c_dec=c_tok,
    )


# --------------------------------------------------------------------------------------------------
# validation of preset values
# --------------------------------------------------------------------------------------------------

ROLLOUT_FIELDS = ("tau_pre", "alpha_pre", "tau_dec", "beta_tok", "beta_hist", "r", "c_pre", "c_dec", "gamma_req")
TRAINER_FIELDS = ("tau", "alpha", "r", "alpha_comm", "beta_comm", "beta_mem")


def _number(value, where: str, low: float, high: float = float("inf"), low_open: bool = False) -> float:
    import math
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        lo = "(" if low_open else "["
        hi = f"{high:g}]" if math.isfinite(high) else "∞)"
        raise ValueError(f"{where} must be in {lo}{low:g}, {hi}, got {value!r}")
    return float(value)


def check_knob(name: str, value) -> float:
    """``value`` of knob ``name`` as a float; ValueError naming the knob and its valid range."""
    if name in EFFICIENCY_KNOBS:
        return _number(value, name, 0.0, 1.0, low_open=True)
    if name in OVERHEAD_KNOBS:
        return _number(value, name, 0.0)
    raise ValueError(f"unknown knob {name!r}; knobs are {', '.join(KNOBS)}")


def check_stage_params(block) -> dict:
    """The ``stage_params`` block of a hardware preset, validated and normalised (module doc).

    ``{model: {"rollout": {"tp": n, field: value, ...}, "trainer": {"layout": n, field: value or
    {stage: value}}}}``; ValueError naming the offending entry (``stage_params.<model>.<kind>.<field>``)."""
    if not isinstance(block, dict):
        raise ValueError(f"stage_params must map model names to {{rollout: ..., trainer: ...}}, got {block!r}")
    out = {}
    for model, kinds in block.items():
        where = f"stage_params.{model}"
        if not isinstance(model, str) or not isinstance(kinds, dict) or not kinds:
            raise ValueError(f"{where} must map 'rollout' and/or 'trainer' to fitted parameters, got {kinds!r}")
        unknown = set(kinds) - {"rollout", "trainer"}
        if unknown:
            raise ValueError(f"{where}: unknown section(s) {sorted(unknown)}; use 'rollout' and/or 'trainer'")
        out[model] = {kind: _check_entry(entry, f"{where}.{kind}", kind) for kind, entry in kinds.items()}
    return out


def _check_entry(entry, where: str, kind: str) -> dict:
    key = ROLLOUT_LAYOUT_KEY if kind == "rollout" else TRAINER_LAYOUT_KEY
    allowed = ROLLOUT_FIELDS if kind == "rollout" else TRAINER_FIELDS
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping of {', '.join(allowed)} (and {key!r}), got {entry!r}")
    if key not in entry:
        raise ValueError(f"{where}.{key} is missing: say for how many GPUs per replica the values were fitted")
    layout = entry[key]
    if isinstance(layout, bool) or not isinstance(layout, int) or layout < 1:
        raise ValueError(f"{where}.{key} must be a whole number of GPUs ≥ 1, got {layout!r}")
    unknown = set(entry) - set(allowed) - {key}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; valid fields are {', '.join(allowed)}")
    out = {key: layout}
    for field, value in entry.items():
        if field == key:
            continue
        low = 1.0 if field == "r" else 0.0
        if kind == "trainer" and isinstance(value, dict):
            bad = set(value) - set(STAGES)
            if bad or not value:
                raise ValueError(f"{where}.{field}: stages {sorted(bad) or '(none)'} — give one value per stage of "
                                 f"{', '.join(STAGES)}, or one number for all")
            out[field] = {s: _number(v, f"{where}.{field}.{s}", low) for s, v in value.items()}
        else:
            out[field] = _number(value, f"{where}.{field}", low)
    return out
