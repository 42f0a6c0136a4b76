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
from bidirl.perf.overlap import combine, overlap
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


def _serpentine_sums(ranked: np.ndarray, width: int) -> np.ndarray:
    """Each replica's sum when ``ranked`` (heaviest first) is dealt serpentine to ``width`` replicas: rounds of
    ``width`` go 0, 1, …, width−1, then width−1, …, 0. Exact for whole numbers below 2**53 (any order)."""
    rounds = -(-ranked.size // (2 * width))
    padded = np.zeros(rounds * 2 * width)
    padded[:ranked.size] = ranked
    column = padded.reshape(rounds, 2 * width).sum(axis=0)
    return column[:width] + column[:width - 1:-1] if width > 0 else column


def _span_inputs(stage: str, prompt_lens, response_lens, starts, stops, d: int) -> tuple:
    """Checked ``(d, p, r, starts, stops)`` of a span query (:meth:`TrainerModel.span_times` and its bounds)."""
    check_stage(stage)
    d = check_replicas(d)
    p, r = lengths(prompt_lens, response_lens)
    starts, stops = _spans(starts, stops, p.size)
    return d, p, r, starts, stops


def _spans(starts, stops, n: int) -> tuple:
    """``starts``, ``stops`` as int64 arrays of non-empty spans of n samples, or a ValueError saying so."""
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
    if starts.shape != stops.shape or starts.ndim != 1 or np.any(starts < 0) or np.any(stops > n) \
            or np.any(stops <= starts):
        raise ValueError(f"spans must be non-empty [start, stop) ranges with 0 ≤ start < stop ≤ {n}, one per chunk")
    return starts, stops


def _range_max(values: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``max(values[start:stop])`` for each span, from a sparse table (O(n log n) once, O(1) a span)."""
    table = [values]
    while 2 ** len(table) <= values.size:
        half = 2 ** (len(table) - 1)
        table.append(np.maximum(table[-1][:-half], table[-1][half:]))
    level = np.floor(np.log2(stops - starts)).astype(np.int64)
    out = np.empty(starts.size)
    for k in np.unique(level):
        at = level == k
        out[at] = np.maximum(table[k][starts[at]], table[k][stops[at] - 2 ** k])
    return out


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
        self._memo: dict = {}      # (stage, d, prompt lens, response lens) -> one chunk's time (the model is fixed)
        # per stage: τ_s, α_s·m_s, C_s and r_s of t_s(b), as microbatch_times computes them
        self._terms = {s: (self.params.tau[s], self.params.alpha[s] * STAGE_MULTIPLIER[s],
                           self.params.alpha_comm[s] + self.params.beta_comm[s] * self._message[s], self.params.r[s])
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
        return self._grouped_times(stage, p, r, np.arange(p.size) // size, d)

    def _grouped_times(self, stage: str, p: np.ndarray, r: np.ndarray, chunk: np.ndarray, d: int) -> np.ndarray:
        """The time of each chunk of samples ``p``, ``r`` (int64), chunk ``chunk[i]`` of sample i (0, 1, …,
        non-decreasing, every chunk non-empty), each chunk on a gang of ``d`` replicas."""
        n = p.size
        if n == 0:
            return np.zeros(0)
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

    def _one_chunk_time(self, stage: str, p: np.ndarray, r: np.ndarray, d: int) -> float:
        """:meth:`_grouped_times` of one non-empty chunk, without the bookkeeping for many (the same numbers)."""
        n = p.size
        width = min(d, n)
        rank = np.empty(n, dtype=np.int64)
        rank[np.argsort(-(p + r), kind="stable")] = np.arange(n)
        rounds, pos = np.divmod(rank, width)
        replica = np.where(rounds % 2 == 0, pos, width - 1 - pos)
        flops = np.bincount(replica, weights=sample_forward_flops(self.model, p, r), minlength=width)
        tau, alpha, comm, r_s = self._terms[stage]
        t = tau + combine(np.float64(alpha) * flops, np.full(width, comm), np.full(width, r_s))
        return float(t.max())

    def warm_chunk_times(self, stage: str, prompt_lens, response_lens, d: int, chunk_size: int) -> None:
        """Evaluate the chunks of this cut (:meth:`chunk_times`) in one pass and remember each, so that
        :meth:`chunk_time` answers them from the memo (a step's chunks, as lazy pull will cut them)."""
        p, r = lengths(prompt_lens, response_lens)
        times = self.chunk_times(stage, p, r, d, chunk_size).tolist()
        p, r = p.tolist(), r.tolist()
        self._remember(((stage, d, tuple(p[a:a + chunk_size]), tuple(r[a:a + chunk_size])), t)
                       for a, t in zip(range(0, len(p), chunk_size), times))

    def span_times(self, stage: str, prompt_lens, response_lens, starts, stops, d: int) -> list:
        """:meth:`chunk_time` of each chunk ``[start, stop)`` of these samples on a gang of ``d`` replicas, all in
        one vectorised pass (a search's many candidate chunks: the tail split's, for one)."""
        d, p, r, starts, stops = _span_inputs(stage, prompt_lens, response_lens, starts, stops, d)
        if starts.size == 0:
            return []
        size = stops - starts
        chunk = np.repeat(np.arange(starts.size), size)
        idx = np.arange(chunk.size) - np.repeat(np.cumsum(size) - size - starts, size)
        return self._grouped_times(stage, p[idx], r[idx], chunk, d).tolist()

    def span_time_bounds(self, stage: str, prompt_lens, response_lens, starts, stops, d: int) -> list:
        """A lower bound of :meth:`chunk_time` for each chunk ``[start, stop)`` of these samples on ``d``
        replicas, all at once and without dealing any chunk: the busiest replica holds at least the mean of the
        chunk's FLOPs over its busy replicas and at least its heaviest sample, and t_s(b) grows with F(b). The
        bound is lowered by a relative 1e-9, far more than the rounding of either computation, so it never
        exceeds the computed chunk time (what a search may prune with)."""
        d, p, r, starts, stops = _span_inputs(stage, prompt_lens, response_lens, starts, stops, d)
        if starts.size == 0:
            return []
        f = sample_forward_flops(self.model, p, r)
        total = np.concatenate(([0.0], np.cumsum(f)))
        mean = (total[stops] - total[starts]) / np.minimum(d, stops - starts)
        heaviest = _range_max(f, starts, stops)
        tau, alpha, comm, r_s = self._terms[stage]
        busiest = np.maximum(mean, heaviest)
        t = tau + combine(np.float64(alpha) * busiest, np.full(busiest.size, comm), np.full(busiest.size, r_s))
        return (t * (1.0 - 1e-9)).tolist()

    def _remember(self, items) -> None:
        if len(self._memo) > 200_000:
            self._memo.clear()
        self._memo.update(items)

    def stage_time(self, prompt_lens, response_lens, d: int, micro_batch_per_device: int,
                   stages=STAGES) -> float:
        """M_t(U, d): every stage's samples, in consumption order, as chunks of one micro-batch per device on
        the gang of ``d`` replicas; chunk times (replica-max) summed (module doc)."""
        stages = tuple(check_stage(s) for s in stages)
        size = self.chunk_size(micro_batch_per_device, d)
        return float(sum(self.chunk_times(s, prompt_lens, response_lens, d, size).sum() for s in stages))

    def stage_times(self, prompt_lens, response_lens, ds, micro_batch_per_device: int, stages=STAGES) -> np.ndarray:
        """:meth:`stage_time` for every gang size in ``ds`` at once (the planner's every candidate), the same
        numbers.

        Two facts make it cheap. Each sample's FLOPs are whole numbers, so a replica's sum (at most
        ``micro_batch_per_device · layout`` samples) is exact in any order while below 2**53 (otherwise each d is
        evaluated as :meth:`stage_time` does). And a chunk's serpentine
        order is the global order (most tokens first) restricted to the chunk: ranking the samples once, each d
        needs a stable radix sort of chunk ids, not a sort by tokens, and the serpentine deal of a chunk whose
        samples are in that order is a reshape (:func:`_serpentine_sums`). The times of every (d, chunk,
        replica) are then computed in one vectorised pass per stage."""
        stages = tuple(check_stage(s) for s in stages)
        p, r = lengths(prompt_lens, response_lens)
        ds = [check_replicas(d) for d in ds]
        per_replica = self.chunk_size(micro_batch_per_device, 1)       # samples per replica micro-batch
        f = sample_forward_flops(self.model, p, r)
        # a replica never holds more than ``per_replica`` samples of a chunk, so its sums stay below this bound
        if p.size == 0 or not (np.all(f == np.floor(f)) and per_replica * f.max() < 2.0 ** 53) \
                or p.size >= 2 ** 16 * per_replica:
            return np.array([self.stage_time(p, r, d, micro_batch_per_device, stages) for d in ds])
        n = p.size
        order = np.argsort(-(p + r), kind="stable")
        ranked = f[order]
        flops, chunk_starts, d_chunks = [], [], []     # every d's bins; where its chunks' bins start; its chunks
        start = 0
        for d in ds:
            size = per_replica * d
            if size >= n:
                sums = [_serpentine_sums(ranked, min(d, n))]
            else:
                by_chunk = ranked[np.argsort((order // size).astype(np.uint16), kind="stable")]
                full = n // size
                grid = by_chunk[:full * size].reshape(full, per_replica, d)
                sums = list(grid[:, 0::2, :].sum(axis=1) + grid[:, 1::2, ::-1].sum(axis=1))
                if n > full * size:
                    sums.append(_serpentine_sums(by_chunk[full * size:], min(d, n - full * size)))
            for x in sums:
                chunk_starts.append(start)
                start += len(x)
            d_chunks.append(len(sums))
            flops += sums
        flops = np.concatenate(flops)
        ends = np.cumsum(d_chunks)
        totals = []
        for stage in stages:
            tau, alpha, comm, r_s = self._terms[stage]
            t = tau + combine(np.float64(alpha) * flops, np.full(flops.size, comm), np.full(flops.size, r_s))
            chunk_max = np.maximum.reduceat(t, chunk_starts)
            totals.append([chunk_max[a - k:a].sum() for a, k in zip(ends, d_chunks)])
        return np.array([float(sum(by_stage)) for by_stage in zip(*totals)])

    def chunk_time(self, stage: str, prompt_lens, response_lens, d: int) -> float:
        """One chunk of ``stage`` on a gang of d replicas, each running its share as one micro-batch;
        replica-max (0 for an empty chunk). Memoised: the scheduler and the simulator ask for the same chunks."""
        try:
            key = (stage, d, tuple(prompt_lens), tuple(response_lens))
            t = self._memo.get(key)
        except TypeError:           # unhashable (e.g. nested) lengths: validated below
            key, t = None, None
        if t is None:
            check_stage(stage)
            d = check_replicas(d)
            p, r = lengths(prompt_lens, response_lens)
            t = self._one_chunk_time(stage, p, r, d) if p.size else 0.0
            if key is not None:
                self._remember([(key, t)])
        return t
