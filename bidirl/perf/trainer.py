"""The trainer stage-time model M_t (paper appendix, "Trainer Model"), vectorised with numpy.

A micro-batch ``b`` of stage ``s`` takes

    t_s(b) = τ_s + overlap(α_s · m_s · F(b), C_s(b), r_s),       C_s(b) = α_comm,s + β_comm,s · n_s(b)

with F(b) from :mod:`bidirl.perf.flops` and the p-norm overlap of :mod:`bidirl.perf.overlap`. A replica's time
is the ordered sum of its micro-batch times, T_t,rep(U_j) = Σ_s Σ_{b ∈ U_j,s} t_s(b), and
M_t(U, d) = max_j T_t,rep(U_j) (replica-max).

**Replica.** A trainer replica is ρ = ``layout`` GPUs running FSDP (full sharding) over the replica. FSDP is
data parallel inside the replica: each GPU runs ``micro_batch_per_device`` samples per micro-batch step, so
one *replica* micro-batch holds ``micro_batch_per_device · ρ`` samples and the replica computes at ρ times
one GPU's FLOP rate (α_s of :func:`bidirl.perf.params.default_trainer_params` includes the 1/ρ).

**Message size n_s(b)** (our choice; the appendix leaves it stage-specific): the bytes one GPU receives or
sends in the FSDP collectives of one micro-batch step — independent of the batch's token counts, since FSDP
moves parameters, not activations:

* ``old_logprob`` / ``ref_logprob``: the forward all-gather of the replica's weights,
  ``W·(ρ−1)/ρ`` with ``W = N_total · b_dtype``;
* ``actor_update``: forward and backward all-gathers plus the reduce-scatter of fp32 gradients,
  ``(2·W + 4·N_total)·(ρ−1)/ρ``.

For ρ = 1 there is no collective (n_s = 0 and α_comm,s = 0 by default). Cross-replica gradient averaging
happens once per optimiser step, outside the micro-batch times (the control plane charges the optimizer step).

**Work distribution U — as the runtime executes it.** The trainer consumes a step's samples in batch order
(the order the groups completed), stage by stage, as *chunks* (§2.1, §5.2): a chunk is one micro-batch on
every device of a gang of d replicas, i.e. ``micro_batch_per_device · ρ · d`` samples; each replica takes its
``micro_batch_per_device · ρ`` samples of the chunk (dealt by :func:`bidirl.perf.balance.serpentine` on their
token counts, as veRL's ``balance_batch``) as one micro-batch. The gang synchronises at every micro-batch
(FSDP's collectives), so a chunk takes its slowest replica's time and

    M_t(U, d) = Σ_s Σ_chunks max_j t_s(b_j),

the appendix's replica-max applied per chunk. This is the same decomposition the coordinator's lazy pull
executes and the simulator times (:meth:`TrainerModel.chunk_time`), so planner and simulator agree on the
trainer stage by construction (``tests/test_fidelity.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Mapping, Optional

import numpy as np

from bidirl.perf.flops import STAGE_MULTIPLIER, STAGES, check_stage, lengths, sample_forward_flops
from bidirl.perf.overlap import overlap
from bidirl.perf.balance import check_replicas


@dataclass(frozen=True)
class TrainerParams:
    """Per-stage parameters of t_s(b): ``tau`` (s), ``alpha`` (s/FLOP), ``r`` (≥ 1), ``alpha_comm`` (s),
    ``beta_comm`` (s/byte). Each is a mapping ``stage -> value`` holding every stage of
    :data:`bidirl.perf.flops.STAGES`."""
    tau: Mapping[str, float]
    alpha: Mapping[str, float]
    r: Mapping[str, float]
    alpha_comm: Mapping[str, float]
    beta_comm: Mapping[str, float]

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


_STAGE_INDEX = {s: i for i, s in enumerate(STAGES)}
_MULT = np.array([STAGE_MULTIPLIER[s] for s in STAGES], dtype=float)


def microbatch_times(params: TrainerParams, stage_idx, flops, message_bytes) -> np.ndarray:
    """t_s(b) for arrays of micro-batches: stage index (into STAGES), forward FLOPs F(b), message bytes n_s(b)."""
    i = np.asarray(stage_idx, dtype=np.int64)
    tau, alpha, r = params.vector("tau")[i], params.vector("alpha")[i], params.vector("r")[i]
    comm = params.vector("alpha_comm")[i] + params.vector("beta_comm")[i] * np.asarray(message_bytes, float)
    return tau + overlap(alpha * _MULT[i] * np.asarray(flops, float), comm, r)


class TrainerModel:
    """M_t for ``model`` on ``hardware`` with ρ = ``layout`` GPUs per replica (``params``: preset-derived
    defaults of :func:`bidirl.perf.params.default_trainer_params` when omitted)."""

    def __init__(self, model, hardware, layout: int = 1, params: Optional[TrainerParams] = None):
        from bidirl.perf.params import default_trainer_params
        self.model, self.hardware = model, hardware
        self.layout = check_replicas(layout, "layout (GPUs per trainer replica)")
        self.params = params if params is not None else default_trainer_params(model, hardware, self.layout)
        if not isinstance(self.params, TrainerParams):
            raise ValueError(f"params must be a TrainerParams, got {type(self.params).__name__}")
        w = model.params_total * model.dtype_bytes
        share = (self.layout - 1) / self.layout
        self._message = {s: (2 * w + 4 * model.params_total) * share if s == "actor_update" else w * share
                         for s in STAGES}

    def __repr__(self) -> str:
        return f"TrainerModel({self.model.name}, {self.hardware.name}, layout={self.layout})"

    # ------------------------------------------------------------------------------------------
    def message_bytes(self, stage: str) -> float:
        """n_s(b): bytes per GPU in the FSDP collectives of one micro-batch of ``stage`` (see module doc)."""
        return self._message[check_stage(stage)]

    def chunk_size(self, micro_batch_per_device: int, d: int) -> int:
        """Samples in one chunk on a gang of ``d`` replicas: one micro-batch per device,
        ``micro_batch_per_device · layout · d``."""
        if isinstance(micro_batch_per_device, bool) or int(micro_batch_per_device) != micro_batch_per_device \
                or micro_batch_per_device < 1:
            raise ValueError(f"micro_batch_per_device must be a whole number ≥ 1, got {micro_batch_per_device!r}")
        return int(micro_batch_per_device) * self.layout * check_replicas(d)

    def microbatch_time(self, stage: str, prompt_lens, response_lens) -> float:
        """t_s(b) of one micro-batch (0 for an empty one)."""
        check_stage(stage)
        p, r = lengths(prompt_lens, response_lens)
        if p.size == 0:
            return 0.0
        f = float(sample_forward_flops(self.model, p, r).sum())
        return float(microbatch_times(self.params, [_STAGE_INDEX[stage]], [f], [self._message[stage]])[0])

    def replica_time(self, microbatches: Iterable) -> float:
        """T_t,rep: the ordered sum of t_s(b) over ``(stage, prompt_lens, response_lens)`` micro-batches."""
        idx, flops, msg = [], [], []
        for item in microbatches:
            try:
                stage, p, r = item
            except (TypeError, ValueError):
                raise ValueError("replica_time expects (stage, prompt_lens, response_lens) triples") from None
            check_stage(stage)
            p, r = lengths(p, r)
            if p.size == 0:
                continue
            idx.append(_STAGE_INDEX[stage])
            flops.append(float(sample_forward_flops(self.model, p, r).sum()))
            msg.append(self._message[stage])
        if not idx:
            return 0.0
        return float(microbatch_times(self.params, idx, flops, msg).sum())

    # ------------------------------------------------------------------------------------------
    def chunk_times(self, stage: str, prompt_lens, response_lens, d: int, chunk_size: int) -> np.ndarray:
        """The time of each chunk when the samples, in this order, are cut into chunks of ``chunk_size`` and each
        chunk runs on a gang of ``d`` replicas (replica-max of one micro-batch per busy replica)."""
        check_stage(stage)
        p, r = lengths(prompt_lens, response_lens)
        d = check_replicas(d)
        size = check_replicas(chunk_size, "chunk_size (samples per chunk)")
        n = p.size
        if n == 0:
            return np.zeros(0)
        chunk = np.arange(n) // size
        counts = np.bincount(chunk)
        busy = np.minimum(d, counts)                          # replicas a chunk keeps busy
        # serpentine inside every chunk at once: heaviest first, then 0, 1, …, d−1, d−1, …, 0, 0, 1, …
        order = np.lexsort((-(p + r), chunk))
        first = np.concatenate(([0], np.cumsum(counts)[:-1]))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - first[chunk[order]]
        width = busy[chunk]
        rounds, pos = np.divmod(rank, width)
        replica = np.where(rounds % 2 == 0, pos, width - 1 - pos)
        key = chunk * d + replica
        flops = np.bincount(key, weights=sample_forward_flops(self.model, p, r), minlength=counts.size * d)
        used = np.flatnonzero(np.bincount(key, minlength=counts.size * d))
        t = microbatch_times(self.params, np.full(used.size, _STAGE_INDEX[stage]), flops[used],
                             np.full(used.size, self._message[stage]))
        out = np.zeros(counts.size)
        np.maximum.at(out, used // d, t)
        return out

    def stage_time(self, prompt_lens, response_lens, d: int, micro_batch_per_device: int,
                   stages=STAGES) -> float:
        """M_t(U, d): every stage's samples, in consumption order, as chunks of one micro-batch per device on
        the gang of ``d`` replicas; chunk times (replica-max) summed (module doc)."""
        stages = tuple(check_stage(s) for s in stages)
        size = self.chunk_size(micro_batch_per_device, d)
        return float(sum(self.chunk_times(s, prompt_lens, response_lens, d, size).sum() for s in stages))

    def chunk_time(self, stage: str, prompt_lens, response_lens, d: int) -> float:
        """One chunk of ``stage`` on a gang of d replicas, each running its share as one micro-batch;
        replica-max (0 for an empty chunk)."""
        p, r = lengths(prompt_lens, response_lens)
        if p.size == 0:
            check_stage(stage)
            check_replicas(d)
            return 0.0
        return float(self.chunk_times(stage, p, r, d, p.size)[0])
