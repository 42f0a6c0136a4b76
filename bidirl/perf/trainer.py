"""The trainer stage-time model M_t (paper appendix, "Trainer Model"), vectorised with numpy.

A micro-batch ``b`` of stage ``s`` takes

    t_s(b) = τ_s + overlap(α_s · m_s · F(b), C_s(b), r_s),       C_s(b) = α_comm,s + β_comm,s · n_s(b)

with F(b) from :mod:`bidirl.perf.flops` and the p-norm overlap of :mod:`bidirl.perf.overlap`, plus, where the
hardware states its last-level cache and the calibration fitted it, the actor update's cost of saved activations
beyond that cache, β_mem,s · :func:`spill_bytes` (0 in every preset not calibrated on records). A replica's time
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

With expert parallelism (``expert_parallel`` > 1, an MoE model) the experts are gathered inside their EDP group
only (:func:`bidirl.perf.expert_parallel.fsdp_message_bytes`).

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

from bidirl.core.protocol import chunk_size, packed_chunk_len, packed_groups
from bidirl.perf.balance import check_replicas, grouped_order, runs_of, stable_order
from bidirl.perf.costs import LOGIT_BYTES
from bidirl.perf.expert_parallel import fsdp_message_bytes
from bidirl.perf.flops import STAGE_MULTIPLIER, STAGES, check_image_tokens, check_stage, lengths, sample_forward_flops
from bidirl.perf.memory import UNCHECKPOINTED_BYTES_PER_HIDDEN
from bidirl.perf.overlap import combine, overlap
from bidirl.perf.params import TrainerParams, default_trainer_params


_STAGE_INDEX = {s: i for i, s in enumerate(STAGES)}
_MULT = np.array([STAGE_MULTIPLIER[s] for s in STAGES], dtype=float)


def microbatch_times(params: TrainerParams, stage_idx, flops, message_bytes, spill=None) -> np.ndarray:
    """t_s(b) for arrays of micro-batches: stage index (into STAGES), forward FLOPs F(b), message bytes n_s(b) and,
    when given, the bytes of saved activations beyond the cache (:func:`spill_bytes`, charged β_mem,s each)."""
    i = np.asarray(stage_idx, dtype=np.int64)
    tau, alpha, r = params.vector("tau")[i], params.vector("alpha")[i], params.vector("r")[i]
    comm = params.vector("alpha_comm")[i] + params.vector("beta_comm")[i] * np.asarray(message_bytes, float)
    t = tau + overlap(alpha * _MULT[i] * np.asarray(flops, float), comm, r)
    if spill is not None:
        t = t + params.vector("beta_mem")[i] * np.asarray(spill, float)
    return t


#: the only stage that keeps activations for a backward pass
SPILL_STAGE = "actor_update"


def saved_activation_bytes_per_token(model) -> float:
    """Bytes the actor update keeps per token for its backward pass without activation checkpointing:
    ``34·L·H`` in 16-bit values (:data:`bidirl.perf.memory.UNCHECKPOINTED_BYTES_PER_HIDDEN`, Korthikanti et al.
    2022, Eq. 1 without the attention-score term) scaled to the model's dtype (``b_w / 2``: fp32 doubles them),
    plus a row of fp32 logits (:data:`bidirl.perf.costs.LOGIT_BYTES` · V)."""
    return UNCHECKPOINTED_BYTES_PER_HIDDEN * model.layers * model.hidden * model.dtype_bytes / 2 \
        + LOGIT_BYTES * model.vocab


def spill_bytes(model, hardware, stage: str, tokens) -> np.ndarray:
    """Bytes of a micro-batch's saved activations that do not fit the device's last-level cache
    (``hardware.cache_bytes``): ``max(0, A(b) − C)`` with ``A(b) = tokens · saved_activation_bytes_per_token``, for
    the actor update only; 0 for the forward-only stages and where the preset states no cache (``cache_bytes`` 0).

    The mechanism: the forward writes each layer's activations in order and the backward reads them in reverse,
    so the byte read k-th-to-last was written k bytes ago; under LRU replacement a read misses exactly when more
    than C bytes were touched since, i.e. the first ``A − C`` bytes written are read back from memory and the
    last C from cache. Each spilled byte costs ``beta_mem`` seconds (a bandwidth term, fitted on records)."""
    tokens = np.asarray(tokens, dtype=float)
    if stage != SPILL_STAGE or not has_cache(hardware):
        return np.zeros_like(tokens)
    return np.maximum(0.0, tokens * saved_activation_bytes_per_token(model) - float(hardware.cache_bytes))


def has_cache(hardware) -> bool:
    """Whether the hardware preset states its last-level cache (``cache_bytes`` > 0), which turns the spill term on."""
    return float(getattr(hardware, "cache_bytes", 0.0) or 0.0) > 0


_BATCH = 1 << 16        # replica micro-batches of the planner's gangs evaluated together (still in cache)
_NEAR = 2.0 ** -20      # replicas this close to a chunk's busiest are timed too (TrainerModel._chunk_maxima)
_ROUNDING = 2.0 ** -40  # a generous bound on the relative rounding error of a computed t_s(b)
_FEW_CHUNKS = 3         # below this many whole chunks, a gang size's chunks are selected one by one


def _dealt(grid: np.ndarray, d: int) -> np.ndarray:
    """Each replica's sum when each row of ``grid`` (samples heaviest first, whole rounds of ``d``) is dealt
    serpentine to ``d`` replicas: rounds go 0, 1, …, d−1, then d−1, …, 0. Exact for whole numbers below 2**53
    (any order)."""
    rounds = grid.shape[1] // d
    if rounds % 2 == 0:                                   # pairs of rounds fold onto each other
        column = grid.reshape(grid.shape[0], rounds // 2, 2 * d).sum(axis=1)
        return column[:, :d] + column[:, :d - 1:-1]
    grid = grid.reshape(grid.shape[0], rounds, d)
    return grid[:, 0::2].sum(axis=1) + grid[:, 1::2, ::-1].sum(axis=1)


class _Deal:
    """The serpentine deal of a step's samples, in consumption order, as chunks on gangs of d replicas
    (:meth:`TrainerModel.stage_times`). ``ranked``: the samples' FLOPs, most tokens first; ``order``: their
    positions in consumption order; ``per_replica``: samples of one replica micro-batch."""

    def __init__(self, ranked: np.ndarray, order: np.ndarray, per_replica: int):
        n = ranked.size
        self.n, self.per_replica = n, per_replica
        self.position = order.astype(np.uint16) if n <= 2 ** 16 else order
        self.ranked = ranked
        self.padded = np.concatenate([ranked, np.zeros(2 * n)])     # zero samples pad a deal's last round
        self.buffer = np.zeros(2 * n)

    def replicas(self, ds: np.ndarray) -> np.ndarray:
        """Replica micro-batches of each gang size in ``ds``, over all its chunks."""
        size = self.per_replica * ds
        return self.n // size * ds + np.minimum(ds, self.n % size)

    def flops(self, ds) -> tuple:
        """``(flops, widths, chunks)``: each replica micro-batch's FLOPs, chunk after chunk and gang size after
        gang size; each chunk's busy replicas; each gang size's chunks.

        Zero samples pad the last chunk's last round when it still keeps d replicas busy, and a last chunk of
        fewer than d samples gives each its own replica. A chunk's samples in rank order are a stable radix sort
        of the chunk ids away (with a few chunks, one selection each)."""
        n, per = self.n, self.per_replica
        parts, widths, chunks = [], [], []
        for d in ds:
            size = per * d
            full, tail = n // size, n % size
            if full == 0:                                       # one chunk: the samples in rank order
                width = min(d, n)
                parts.append(_dealt(self.padded[:-(-n // (2 * width)) * 2 * width].reshape(1, -1), width)[0])
                widths.append(width)
                chunks.append(1)
                continue
            by_chunk, chunk = self.buffer, self.position // size
            if full < _FEW_CHUNKS:
                for c in range(full + (tail > 0)):
                    np.compress(chunk == c, self.ranked, out=by_chunk[c * size:min(n, (c + 1) * size)])
            else:
                np.take(self.ranked, stable_order(chunk), out=by_chunk[:n])
            whole = full + (tail >= d)
            parts.append(_dealt(by_chunk[:whole * size].reshape(whole, size), d).reshape(-1))
            if 0 < tail < d:
                parts.append(by_chunk[full * size:n].copy())
            widths += [d] * whole + ([tail] if 0 < tail < d else [])
            chunks.append(full + (tail > 0))
        return np.concatenate(parts), np.array(widths), np.array(chunks)


class _Busiest:
    """The replica micro-batches of a run of chunks — ``flops``, chunk after chunk, ``widths[k]`` replicas in
    chunk k, and where the cache-spill term needs them their ``tokens`` (else None) — with each chunk's largest
    FLOPs (``top``) and the replicas within a relative ``_NEAR`` of it."""

    def __init__(self, flops: np.ndarray, widths: np.ndarray, tokens: Optional[np.ndarray] = None):
        self.flops, self.widths, self.tokens = flops, widths, tokens
        self.starts = np.cumsum(widths) - widths
        self.top = np.maximum.reduceat(flops, self.starts) if flops.size else np.zeros(0)
        self.low = self.top * (1.0 - _NEAR)
        self.near = flops >= np.repeat(self.low, widths)

    def candidates(self, every: np.ndarray) -> tuple:
        """``(replicas, chunks)``: the replicas near their chunk's busiest or in a chunk flagged in ``every``,
        and their chunks."""
        pick = np.flatnonzero(self.near | np.repeat(every, self.widths) if every.any() else self.near)
        return pick, np.searchsorted(self.starts, pick, side="right") - 1


def _token_ranks(p: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Each sample's place when the samples are ordered by tokens (p + r), most first, ties in order."""
    tokens = p + r
    fewer = tokens.max() - tokens if tokens.size else tokens
    rank = np.empty(p.size, dtype=np.int64)
    rank[stable_order(fewer)] = np.arange(p.size)
    return rank


def _block_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The sum of each consecutive block of ``counts[i]`` values, as ``values[a:b].sum()`` gives it (NumPy's
    pairwise summation): blocks of one length are summed as the rows of one array, which NumPy sums as it sums
    each row alone."""
    ends = np.cumsum(counts)
    out = np.empty(counts.size)
    for c in np.unique(counts).tolist():
        at = np.flatnonzero(counts == c)
        out[at] = values[(ends[at] - c)[:, None] + np.arange(c)].sum(axis=1)
    return out


def _span_inputs(stage: str, prompt_lens, response_lens, starts, stops, d: int, covered: bool = False) -> tuple:
    """Checked ``(d, p, r, starts, stops)`` of a span query (:meth:`TrainerModel.span_times` and its bounds);
    with ``covered``, ``p`` and ``r`` hold only the samples from the first span's start to the last one's stop,
    and the spans are relative to that window."""
    check_stage(stage)
    d = check_replicas(d)
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens ({len(prompt_lens)}) and response_lens ({len(response_lens)}) must have one "
                         "entry per sample")
    starts, stops = _spans(starts, stops, len(prompt_lens))
    lo, hi = (int(starts.min()), int(stops.max())) if covered and starts.size else (0, len(prompt_lens))
    p, r = lengths(prompt_lens[lo:hi], response_lens[lo:hi])
    return d, p, r, starts - lo, stops - lo


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

    def __init__(self, model, hardware, layout: int = 1, params: Optional[TrainerParams] = None,
                 sequence_parallel: int = 1, expert_parallel: int = 1, image_tokens_per_prompt: int = 0):
        self.model, self.hardware = model, hardware
        #: LLM image tokens per sample's prompt (the workload's): the ViT's FLOPs, :func:`bidirl.perf.flops.vit_forward_flops`
        self.image_tokens_per_prompt = check_image_tokens(image_tokens_per_prompt)
        self.layout = check_replicas(layout, "layout (GPUs per trainer replica)")
        #: Ulysses degree k (``rl.sequence_parallel``): a chunk holds 1/k of the samples (data parallel = GPUs / k)
        self.sequence_parallel = check_replicas(sequence_parallel, "sequence_parallel")
        self.params = params if params is not None else default_trainer_params(model, hardware, self.layout)
        if not isinstance(self.params, TrainerParams):
            raise ValueError(f"params must be a TrainerParams, got {type(self.params).__name__}")
        #: EP degree (``rl.expert_parallel``): the experts' FSDP gathers shrink to their EDP group
        #: (:func:`bidirl.perf.expert_parallel.fsdp_message_bytes`; its all-to-alls are in ``params``' α)
        self.expert_parallel = check_replicas(expert_parallel, "expert_parallel")
        self._message = {s: fsdp_message_bytes(model, hardware, self.layout, self.expert_parallel, s) for s in STAGES}
        self._memo: dict = {}      # (stage, d, prompt lens, response lens) -> one chunk's time (the model is fixed)
        # per stage: τ_s, α_s·m_s, C_s and r_s of t_s(b), as microbatch_times computes them
        self._terms = {s: (self.params.tau[s], self.params.alpha[s] * STAGE_MULTIPLIER[s],
                           self.params.alpha_comm[s] + self.params.beta_comm[s] * self._message[s], self.params.r[s])
                       for s in STAGES}
        #: whether any micro-batch pays the cache-spill term β_mem·spill_bytes: then a chunk's time depends on its
        #: replicas' tokens as well as their FLOPs, so the deals carry each replica's tokens and every replica of a
        #: chunk is timed, as chunk_time times it
        self._spills = has_cache(hardware) and \
            any(v > 0 for v in self.params.beta_mem.values())

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
        return chunk_size(int(micro_batch_per_device), self.layout, check_replicas(d), self.sequence_parallel)

    def microbatch_time(self, stage: str, prompt_lens, response_lens) -> float:
        """t_s(b) of one micro-batch (0 for an empty one)."""
        check_stage(stage)
        p, r = lengths(prompt_lens, response_lens)
        if p.size == 0:
            return 0.0
        f = float(sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt).sum())
        spill = spill_bytes(self.model, self.hardware, stage, [float((p + r).sum())])
        return float(microbatch_times(self.params, [_STAGE_INDEX[stage]], [f], [self._message[stage]], spill)[0])

    def replica_time(self, microbatches: Iterable) -> float:
        """T_t,rep: the ordered sum of t_s(b) over ``(stage, prompt_lens, response_lens)`` micro-batches."""
        idx, flops, msg, spill = [], [], [], []
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
            flops.append(float(sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt).sum()))
            msg.append(self._message[stage])
            spill.append(float(spill_bytes(self.model, self.hardware, stage, [float((p + r).sum())])[0]))
        if not idx:
            return 0.0
        return float(microbatch_times(self.params, idx, flops, msg, spill).sum())

    # ------------------------------------------------------------------------------------------
    def chunk_times(self, stage: str, prompt_lens, response_lens, d: int, chunk_size: int) -> np.ndarray:
        """The time of each chunk when the samples, in this order, are cut into chunks of ``chunk_size`` and each
        chunk runs on a gang of ``d`` replicas (replica-max of one micro-batch per busy replica)."""
        check_stage(stage)
        return self._chunk_maxima(stage, self._cut(prompt_lens, response_lens, d, chunk_size))

    def _cut(self, prompt_lens, response_lens, d: int, chunk_size: int) -> "_Busiest":
        """The replica micro-batches of the samples cut into chunks of ``chunk_size`` on gangs of ``d``."""
        p, r = lengths(prompt_lens, response_lens)
        d = check_replicas(d)
        size = check_replicas(chunk_size, "chunk_size (samples per chunk)")
        return self._deal_samples(p, r, np.arange(p.size) // size, d)

    def packed_chunk_ids(self, prompt_lens, response_lens, d: int, max_tokens: int) -> np.ndarray:
        """Each sample's chunk when these samples, in this order, are cut into token-budget chunks on a gang of
        ``d`` replicas: first-fit into one micro-batch of at most ``max_tokens`` tokens on each of its
        ``layout · d`` devices (:func:`bidirl.core.protocol.packed_chunk_len`, as the chunk queue cuts them)."""
        p, r = lengths(prompt_lens, response_lens)
        tokens = (p + r).tolist()
        ids = np.empty(p.size, dtype=np.int64)
        start, k = 0, 0
        groups, budget = packed_groups(self.layout * check_replicas(d), int(max_tokens), self.sequence_parallel)
        while start < p.size:
            n = packed_chunk_len(tokens, start, p.size, groups, budget)
            ids[start:start + n] = k
            start, k = start + n, k + 1
        return ids

    def packed_stage_time(self, prompt_lens, response_lens, d: int, max_tokens: int, stages=STAGES) -> float:
        """M_t(U, d) with token-budget micro-batches (``rl.max_tokens_per_micro_batch``): the samples in
        consumption order cut by :meth:`packed_chunk_ids`, each chunk's samples dealt serpentine to the gang's
        replicas as :meth:`stage_time` deals a chunk; chunk times (replica-max) summed over the stages."""
        stages = tuple(check_stage(s) for s in stages)
        p, r = lengths(prompt_lens, response_lens)
        if p.size == 0:
            return 0.0
        d = check_replicas(d)
        ids = self.packed_chunk_ids(p, r, d, max_tokens)
        cut = self._deal_samples(p, r, ids, d)
        return float(sum(self._chunk_maxima(s, cut).sum() for s in stages))

    def _deal_samples(self, p: np.ndarray, r: np.ndarray, chunk: np.ndarray, d: int) -> "_Busiest":
        """:meth:`_deal_chunks` of these samples, sample i in chunk ``chunk[i]``: their FLOPs, their token ranks
        and, where the cache-spill term needs them, their tokens."""
        return self._deal_chunks(sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt),
                                 _token_ranks(p, r), chunk, d, self._spill_tokens(p, r))

    def _spill_tokens(self, p: np.ndarray, r: np.ndarray) -> Optional[np.ndarray]:
        """Each sample's tokens where the cache-spill term needs them (:meth:`_deal_chunks` carries their sums per
        replica), else None."""
        return (p + r).astype(float) if self._spills else None

    def _deal_chunks(self, flops: np.ndarray, rank: np.ndarray, chunk: np.ndarray, d: int,
                     tokens: Optional[np.ndarray] = None) -> "_Busiest":
        """The replica micro-batches of chunks of samples — their FLOPs ``flops``, their places ``rank`` in the
        order of most tokens first (distinct), sample i in chunk ``chunk[i]`` (0, 1, …, non-decreasing, every
        chunk non-empty) — each chunk dealt serpentine to a gang of ``d`` replicas; with ``tokens`` (the
        samples' tokens, :meth:`_spill_tokens`) each replica's token sum too.

        A replica's sums add its samples in their order, as :meth:`_one_chunk_time` adds them (``np.bincount``
        over the chunk), so each is the same number."""
        counts = np.bincount(chunk) if chunk.size else np.zeros(0, dtype=np.int64)
        busy = np.minimum(d, counts)                          # replicas a chunk keeps busy
        # serpentine inside every chunk at once: heaviest first, then 0, 1, …, d−1, d−1, …, 0, 0, 1, …
        order = grouped_order(chunk, rank)
        width = np.repeat(busy, counts)
        turn = (np.arange(flops.size) - np.repeat(np.cumsum(counts) - counts, counts)) % (2 * width)
        replica = np.empty(flops.size, dtype=np.int64)
        replica[order] = np.repeat(np.arange(counts.size) * d, counts) + np.where(turn < width, turn,
                                                                                  2 * width - 1 - turn)
        busy_replica = np.arange(d) < busy[:, None]
        sums = np.bincount(replica, weights=flops, minlength=counts.size * d).reshape(-1, d)
        held = None if tokens is None else \
            np.bincount(replica, weights=tokens, minlength=counts.size * d).reshape(-1, d)[busy_replica]
        return _Busiest(sums[busy_replica], busy, held)

    def _one_chunk_time(self, stage: str, p: np.ndarray, r: np.ndarray, d: int) -> float:
        """:meth:`chunk_times` of one non-empty chunk, without the bookkeeping for many (the same numbers)."""
        n = p.size
        width = min(d, n)
        rank = np.empty(n, dtype=np.int64)
        rank[np.argsort(-(p + r), kind="stable")] = np.arange(n)
        rounds, pos = np.divmod(rank, width)
        replica = np.where(rounds % 2 == 0, pos, width - 1 - pos)
        flops = np.bincount(replica, weights=sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt), minlength=width)
        tau, alpha, comm, r_s = self._terms[stage]
        t = tau + combine(np.float64(alpha) * flops, np.full(width, comm), np.full(width, r_s))
        if self._spills:
            tokens = np.bincount(replica, weights=(p + r).astype(float), minlength=width)
            t = t + self.params.beta_mem[stage] * spill_bytes(self.model, self.hardware, stage, tokens)
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
        one vectorised pass (a search's many candidate chunks: the tail split's, for one). Reads only the
        samples the spans cover."""
        d, p, r, starts, stops = _span_inputs(stage, prompt_lens, response_lens, starts, stops, d, covered=True)
        if starts.size == 0:
            return []
        size = stops - starts
        chunk = np.repeat(np.arange(starts.size), size)
        idx = np.arange(chunk.size) - np.repeat(np.cumsum(size) - size - starts, size)
        flops, rank = sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt), _token_ranks(p, r)
        tokens = self._spill_tokens(p[idx], r[idx])
        return self._chunk_maxima(stage, self._deal_chunks(flops[idx], rank[idx], chunk, d, tokens)).tolist()

    def span_time_bounds(self, stage: str, prompt_lens, response_lens, starts, stops, d: int) -> list:
        """A lower bound of :meth:`chunk_time` for each chunk ``[start, stop)`` of these samples on ``d``
        replicas, all at once and without dealing any chunk: the busiest replica holds at least the mean of the
        chunk's FLOPs over its busy replicas and at least its heaviest sample, and t_s(b) grows with F(b). The
        bound is lowered by a relative 1e-9, far more than the rounding of either computation, so it never
        exceeds the computed chunk time (what a search may prune with). The cache-spill term (≥ 0) is left out,
        which keeps it a lower bound."""
        d, p, r, starts, stops = _span_inputs(stage, prompt_lens, response_lens, starts, stops, d)
        if starts.size == 0:
            return []
        f = sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt)
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
        cut = self._cut(prompt_lens, response_lens, d, size)
        return float(sum(self._chunk_maxima(s, cut).sum() for s in stages))

    def stage_times(self, prompt_lens, response_lens, ds, micro_batch_per_device: int, stages=STAGES) -> np.ndarray:
        """:meth:`stage_time` for every gang size in ``ds`` at once (the planner's every candidate), the same
        numbers.

        Three facts make it cheap. Each sample's FLOPs are whole numbers, so a replica's sum (at most
        ``micro_batch_per_device · layout`` samples) is exact in any order while below 2**53 (otherwise each d is
        evaluated as :meth:`stage_time` does). A chunk's serpentine order is the global order (most tokens first)
        restricted to the chunk: ranking the samples once, each d needs a stable radix sort of chunk ids, not a
        sort by tokens, and the serpentine deal of a chunk whose samples are in that order is a reshape
        (:class:`_Deal`). And only a chunk's busiest replicas need timing (:meth:`_chunk_maxima`). The gang sizes
        are evaluated a few at a time (``_BATCH`` replica micro-batches), vectorised within each run."""
        stages = tuple(check_stage(s) for s in stages)
        p, r = lengths(prompt_lens, response_lens)
        ds = [check_replicas(d) for d in ds]
        if self.sequence_parallel > 1 or self._spills:    # fractions of a group's micro-batch, or token sums needed
            return np.array([self.stage_time(p, r, d, micro_batch_per_device, stages) for d in ds])
        per_replica = self.chunk_size(micro_batch_per_device, 1)       # samples per replica micro-batch
        f = sample_forward_flops(self.model, p, r, self.image_tokens_per_prompt)
        # a replica never holds more than ``per_replica`` samples of a chunk, so its sums stay below this bound
        if p.size == 0 or not (np.all(f == np.floor(f)) and per_replica * f.max() < 2.0 ** 53) \
                or p.size >= 2 ** 16 * per_replica:
            return np.array([self.stage_time(p, r, d, micro_batch_per_device, stages) for d in ds])
        order = np.argsort(-(p + r), kind="stable")
        deal = _Deal(f[order], order, per_replica)
        out = np.zeros(len(ds))
        for lo, hi in runs_of(deal.replicas(np.array(ds)), _BATCH):
            flops, widths, chunks = deal.flops(ds[lo:hi])
            busiest = _Busiest(flops, widths)
            by_terms = {}                     # stages with the same t_s(b) share their chunk times
            for stage in stages:              # summed stage after stage, as stage_time does
                if self._terms[stage] not in by_terms:
                    by_terms[self._terms[stage]] = _block_sums(self._chunk_maxima(stage, busiest), chunks)
                out[lo:hi] += by_terms[self._terms[stage]]
        return out

    def _times(self, stage: str, flops: np.ndarray) -> np.ndarray:
        """t_s(b) of micro-batches of ``flops`` FLOPs (a float array), as every chunk time computes it."""
        tau, alpha, comm, r_s = self._terms[stage]
        return tau + combine(np.float64(alpha) * flops, np.full(flops.size, comm), np.full(flops.size, r_s))

    def _chunk_maxima(self, stage: str, busiest: "_Busiest") -> np.ndarray:
        """max_j t_s(b_j) over the replicas of each chunk of ``busiest``: the same numbers as timing every replica.

        With the cache-spill term every replica is timed (:meth:`_spilling_maxima`). Without it, t_s grows with
        F(b), so the busiest replica is the slowest — exactly so as computed when there is no
        communication (τ + α·F rounds monotonically). With communication the p-norm's roundings could reorder
        two replicas whose times are within a rounding of each other, so the replicas within a relative
        ``_NEAR`` of the busiest are timed too, and so is every replica of a chunk whose time barely grows with
        its FLOPs: its time at (1 − _NEAR)·F_max not below its time at F_max by more than ``_ROUNDING`` (far more
        than the error of a few roundings)."""
        if self._spills:
            return self._spilling_maxima(stage, busiest)
        t_top = self._times(stage, busiest.top)
        if self._terms[stage][2] == 0:
            return t_top
        flat = self._times(stage, busiest.low) * (1.0 + _ROUNDING) >= t_top * (1.0 - _ROUNDING)
        pick, chunk = busiest.candidates(flat)
        out = np.full(t_top.size, -np.inf)
        np.maximum.at(out, chunk, self._times(stage, busiest.flops[pick]))
        return out

    def _spilling_maxima(self, stage: str, busiest: "_Busiest") -> np.ndarray:
        """:meth:`_chunk_maxima` with the cache-spill term: a replica's time depends on its tokens as well as its
        FLOPs, so the busiest by FLOPs need not be the slowest; every replica is timed, elementwise as
        :meth:`_one_chunk_time` times it (t_s(b) + β_mem,s · :func:`spill_bytes`), so each chunk's maximum is the
        same number."""
        if busiest.flops.size == 0:
            return np.zeros(0)
        spill = spill_bytes(self.model, self.hardware, stage, busiest.tokens)
        t = self._times(stage, busiest.flops) + self.params.beta_mem[stage] * spill
        return np.maximum.reduceat(t, busiest.starts)

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
