"""The rollout stage-time model M_r (paper appendix, "Rollout Model"), vectorised with numpy.

For the request set R_j of one replica (prompt lengths p_i, response lengths r_i, B_j = |R_j|):

* KV footprint per token ``b_kv = 2·L·H_kv·d_head·b_dtype / tp`` and KV-limited concurrency
  ``N_max(ℓ) = max(1, ⌊B_kv / (b_kv·ℓ)⌋)`` at average live length ℓ;
* prefill: ``N_pre = min(B_j, N_max(mean p))``, ``W_pre = ⌈B_j / N_pre⌉`` waves,
  ``P_pre = τ_pre·W_pre + α_pre·F_pre + γ_req·B_j`` (F_pre from :func:`bidirl.perf.flops.prefill_flops_of_sums`:
  a vision-language model's decoder on every prompt token and its vision encoder once per request over the
  workload's ``image_tokens_per_prompt``; γ_req below);
* decode step t: ``A_t = {i : r_i ≥ t}``, ``ℓ_t = mean_{A_t}(p_i + t − 1)``,
  ``w_t = ⌈|A_t| / min(|A_t|, N_max(ℓ_t))⌉``; features ``W_dec = Σ_t w_t``, ``N_tok = Σ r_i``,
  ``H_dec = Σ (r_i·p_i + r_i(r_i−1)/2)``; ``P_dec = τ_dec·W_dec + β_tok·N_tok + β_hist·H_dec``;
* ``T_r,rep = overlap(P_pre, C_pre, r) + overlap(P_dec, C_dec, r)`` and ``M_r(X, d) = max_j T_r,rep(X_j)``.

The decode features need no loop over steps or requests: N_tok and H_dec are sums, and W_dec is exactly
max r_i for a replica whose requests' final contexts fit the KV budget together; the others take their
requests longest first, so that |A_t| and Σ_{A_t} p_i are prefix counts and sums, constant between two
consecutive response lengths, where w_t is monotone in t (:meth:`RolloutModel._stepped_waves`) — O(n log n)
per replica, whatever the response lengths.

**Communication.** The appendix names C_pre and C_dec without a form. Here they are tensor-parallel traffic
proportional to the tokens processed: ``C_pre = c_pre · Σ p_i`` and ``C_dec = c_dec · N_tok`` (both 0 at
tp = 1; defaults in :mod:`bidirl.perf.params`).

**Per-request admission cost γ_req.** The appendix's P_pre charges a request only its FLOPs (the head's
2·H·V among them). vLLM also pays a fixed host-side cost per request it admits, whatever the model: the
request object and its sampling parameters, the scheduler's bookkeeping and KV-block allocation, the
sampler's per-request state and the output's detokenisation set-up. ``γ_req·B_j`` (seconds per request,
:func:`request_admission_time`) is that term. It is 0 unless calibrated: no datasheet gives it, the
preset-derived priors leave it out (:mod:`bidirl.perf.params`), and ``bidirl calibrate`` fits it on the
profile's fit points (:func:`bidirl.perf.fit.calibrate_rollout` with ``fit_request_cost``). On the shipped
CPU profile (``data/profiles/cpu-tiny``) it is what the 2-token-response points of large batches miss
(``benchmarks/calibration_cpu.md``).

**Partition.** ``stage_time(..., d, group_size)`` keeps GRPO groups whole and deals them to the replicas
round-robin in the order given — group ``i`` to replica ``i mod d`` — which is what the coordinator's dispatch
does: the scheduler assigns prompt groups by data-parallel capacity, not by predicted length, since a
response's length is unknown before generation (§5.2, "Rollout sample granularity" in §8). With
``group_size = 1`` (the default, used by the scheduler for arbitrary request sets) requests are dealt
individually.

**Known artefact of the appendix's model.** N_max uses the *mean* live length, so adding a request whose
live length is below the mean can lower ℓ_t enough to reduce the wave count; with a tight KV budget and
different prompt lengths a longer response can therefore (slightly) lower P_dec. With equal prompt lengths
(one GRPO group) or a KV budget that holds the whole batch, P_dec is monotone in every response length.

:meth:`RolloutModel.decode_iteration_time` is the per-iteration form of P_dec used by the simulator's
continuous-batching engines: stepping every running request one token per iteration reproduces P_dec
exactly (Σ_t of the iteration costs equals τ_dec·W_dec + β_tok·N_tok + β_hist·H_dec).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from bidirl.perf.balance import check_replicas, grouped_order, runs_of, small_keys, stable_order
from bidirl.perf.flops import check_image_tokens, lengths, prefill_flops_of_sums
from bidirl.perf.overlap import combine, overlap
from bidirl.perf.params import RolloutParams, default_rollout_params

_BIG = float(2 ** 62)
_BATCH = 1 << 13      # replicas of the planner's deals evaluated together: vectorised, and still in cache


@dataclass(frozen=True)
class RolloutFeatures:
    """Parameter-free features of each replica's request set (arrays of one entry per replica)."""
    requests: np.ndarray   # B_j
    w_pre: np.ndarray      # W_pre
    f_pre: np.ndarray      # F_pre
    prompt_tokens: np.ndarray  # Σ p_i (drives C_pre)
    w_dec: np.ndarray      # W_dec
    n_tok: np.ndarray      # N_tok
    h_dec: np.ndarray      # H_dec

    def concat(self, other: "RolloutFeatures") -> "RolloutFeatures":
        return RolloutFeatures(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)])
                                 for f in fields(self)))


def request_admission_time(params: RolloutParams, requests):
    """γ_req·B_j: the engine's fixed work for admitting ``requests`` requests (module doc; 0 when uncalibrated)."""
    return params.gamma_req * requests


def replica_times_from_features(params: RolloutParams, feat: RolloutFeatures) -> np.ndarray:
    """T_r,rep for every replica described by ``feat``."""
    p_pre = params.tau_pre * feat.w_pre + params.alpha_pre * feat.f_pre + request_admission_time(params, feat.requests)
    p_dec = params.tau_dec * feat.w_dec + params.beta_tok * feat.n_tok + params.beta_hist * feat.h_dec
    # the parameters were checked when made and the features are non-negative: the overlap without its checks
    r = np.asarray(params.r, dtype=float)
    c_pre = np.asarray(params.c_pre * feat.prompt_tokens, dtype=float) if params.c_pre else 0.0
    c_dec = np.asarray(params.c_dec * feat.n_tok, dtype=float) if params.c_dec else 0.0
    return combine(np.asarray(p_pre, dtype=float), c_pre, r) + combine(np.asarray(p_dec, dtype=float), c_dec, r)


class _RoundRobin:
    """The round-robin deals of n groups — ``per_group``: each group's sums (a row each), ``longest``: its
    longest response — to each of ``widths`` replicas (distinct, ascending, each ≤ n): replica j of width w
    holds groups j, j + w, j + 2w, … < n.

    A replica holding one group is the same in every deal, so those are evaluated once, as the groups
    themselves (:meth:`alone`, :meth:`widest`); :meth:`sums` lists the others — replicas j < min(w, n − w) of
    each width — a few widths at a time (:meth:`batches`)."""

    def __init__(self, per_group: np.ndarray, longest: np.ndarray, widths: np.ndarray):
        self.n, self.widths = longest.size, widths
        self.multi = np.minimum(widths, self.n - widths)        # replicas with two or more groups, per width
        # zero groups pad the last round of a deal
        self.per_group = np.concatenate([per_group, np.zeros_like(per_group)])
        self.longest = np.concatenate([longest, np.zeros_like(longest)])

    def batches(self, replicas: int):
        """``(lo, hi)``: runs of widths whose replicas with two or more groups number about ``replicas``."""
        return runs_of(self.multi, replicas)

    def sums(self, lo: int, hi: int) -> tuple:
        """``(sums, longest, starts)`` of the replicas with two or more groups of ``widths[lo:hi]``, width after
        width: their sums of the per-group rows, the longest response of their groups, and where each width
        with such replicas starts."""
        n, per_group, longest = self.n, self.per_group, self.longest
        multi = self.multi[lo:hi]
        sums, peak = np.empty((int(multi.sum()), per_group.shape[1])), np.empty(int(multi.sum()))
        at = 0
        for w, m in zip(self.widths[lo:hi].tolist(), multi.tolist()):
            if 2 * w < n:                                       # three or more rounds: one reshape
                k = -(-n // w)
                np.add.reduce(per_group[:k * w].reshape(k, w, -1), axis=0, out=sums[at:at + m])
                np.maximum.reduce(longest[:k * w].reshape(k, w), axis=0, out=peak[at:at + m])
            else:                                               # two rounds: groups j and j + w, j < n − w
                np.add(per_group[:m], per_group[w:n], out=sums[at:at + m])
                np.maximum(longest[:m], longest[w:n], out=peak[at:at + m])
            at += m
        return sums, peak, (np.cumsum(multi) - multi)[multi > 0]

    def place(self, lo: int, hi: int, replicas: np.ndarray) -> tuple:
        """``(width, j)`` of replicas listed by ``sums(lo, hi)`` (indices into that listing)."""
        starts = np.cumsum(self.multi[lo:hi]) - self.multi[lo:hi]
        k = np.searchsorted(starts, replicas, side="right") - 1
        return self.widths[lo:hi][k], replicas - starts[k]

    def alone(self) -> tuple:
        """``(sums, longest)`` of every group alone."""
        return self.per_group[:self.n], self.longest[:self.n]

    def widest(self, alone_max: np.ndarray) -> tuple:
        """``(wide, best)``: which widths leave some groups alone — replicas j in [n − w, w) — and the maximum
        of ``alone_max`` (one value per group) over those groups, for each of them."""
        n = self.n
        wide = 2 * self.widths > n
        w = np.arange(n // 2 + 1, n + 1)
        grown = np.maximum.accumulate(np.maximum(alone_max[n - w], alone_max[w - 1]))
        return wide, grown[self.widths[wide] - (n // 2 + 1)]


class RolloutModel:
    """M_r for ``model`` on ``hardware`` with tensor parallelism ``tp``.

    ``params`` defaults to :func:`bidirl.perf.params.default_rollout_params`; ``kv_budget_bytes`` (B_kv, per
    GPU) to what :func:`bidirl.perf.memory.kv_budget_bytes` leaves after weights and the activation reserve.
    ``max_seqs`` optionally caps N_max (vLLM's ``max_num_seqs``); the appendix's model has no cap (None).
    ``image_tokens_per_prompt``: the LLM image tokens in every request's prompt (the workload's; 0 for text), whose
    vision-encoder FLOPs each request's prefill pays once (:func:`bidirl.perf.flops.prefill_flops_of_sums`).
    """

    def __init__(self, model, hardware, tp: int = 1, params: Optional[RolloutParams] = None,
                 kv_budget_bytes: Optional[float] = None, max_seqs: Optional[int] = None,
                 image_tokens_per_prompt: int = 0):
        from bidirl.perf.memory import kv_budget_bytes as default_budget
        self.model, self.hardware = model, hardware
        self.image_tokens_per_prompt = check_image_tokens(image_tokens_per_prompt)
        self.tp = check_replicas(tp, "tp (GPUs per rollout replica)")
        self.params = params if params is not None else default_rollout_params(model, hardware, self.tp)
        if not isinstance(self.params, RolloutParams):
            raise ValueError(f"params must be a RolloutParams, got {type(self.params).__name__}")
        budget = default_budget(model, hardware, self.tp) if kv_budget_bytes is None else kv_budget_bytes
        if isinstance(budget, bool) or not np.isfinite(budget) or budget < 0:
            raise ValueError(f"kv_budget_bytes must be a finite number ≥ 0, got {kv_budget_bytes!r}")
        self.kv_budget_bytes = float(budget)
        self.max_seqs = None if max_seqs is None else check_replicas(max_seqs, "max_seqs")

    def __repr__(self) -> str:
        return f"RolloutModel({self.model.name}, {self.hardware.name}, tp={self.tp})"

    @property
    def kv_bytes_per_token(self) -> float:
        """b_kv = 2·L·H_kv·d_head·b_dtype / tp."""
        return self.model.kv_bytes_per_token(self.tp)

    def _n_max(self, live) -> np.ndarray:
        live = np.asarray(live, dtype=float)
        cap = _BIG if self.max_seqs is None else min(_BIG, self.max_seqs)
        if live.size and live.min() > 0:              # the common case: no empty context, nothing to mask
            return np.clip(np.floor(self.kv_budget_bytes / (self.kv_bytes_per_token * live)), 1.0, cap)
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = np.where(live > 0, np.floor(self.kv_budget_bytes / (self.kv_bytes_per_token * live)), _BIG)
        return np.clip(raw, 1.0, cap)

    def n_max(self, live_len):
        """N_max(ℓ) = max(1, ⌊B_kv / (b_kv·ℓ)⌋) (capped by ``max_seqs`` when set); int or int array."""
        out = self._n_max(live_len).astype(np.int64)
        return int(out) if out.ndim == 0 else out

    # ------------------------------------------------------------------------------------------
    def _step_waves(self, n, p_active, t) -> np.ndarray:
        """w_t = ⌈|A_t| / min(|A_t|, N_max(ℓ_t))⌉ at step ``t`` of a request set whose active requests number
        ``n`` (> 0) with prompts summing to ``p_active``: ℓ_t = (Σ_{A_t} p_i + |A_t|·(t − 1)) / |A_t|."""
        live = (p_active + n * (t - 1.0)) / n
        return np.ceil(n / np.minimum(n, self._n_max(live)))

    def _stepped_waves(self, p, r, counts) -> np.ndarray:
        """W_dec = Σ_t w_t of each of ``len(counts)`` request sets, set i the next ``counts[i]`` requests of
        ``p``, ``r``, longest response first.

        Between two consecutive response lengths of a set, r_(k+1) < t ≤ r_(k), the active set is its k
        longest requests, and ℓ_t — hence N_max(ℓ_t) (non-increasing) and w_t (non-decreasing) — is monotone in
        t, also as computed in floating point (the numerator is a whole number, the rest monotone roundings).
        So a segment whose last step has w_t = 1 adds 1 a step, one whose first and last steps agree adds that
        value a step, and only the rare others are stepped through; a segment with no more active requests than
        N_max(max p + max r − 1) (no context is longer) has w_t = 1 throughout. The sums are whole numbers: the
        same W_dec as summing w_t over every step."""
        ends = np.cumsum(counts)
        starts = ends - counts
        some = counts > 0
        head = starts[some]                                                 # each set's longest request
        rf = r.astype(float)
        n = np.arange(1.0, r.size + 1.0) - np.repeat(starts.astype(float), counts)   # |A_t| on segment k
        total = np.cumsum(p).astype(float)                                  # whole numbers: exact
        p_active = total - np.repeat(total[head] - p[head], counts[some])           # Σ_{A_t} p_i on segment k
        r_next = np.empty(r.size)
        r_next[:-1] = rf[1:]
        r_next[ends[some] - 1] = 0.0
        # the segments with steps and more active requests than N_max at the longest possible context admits
        fits = self._n_max(np.array([float(p.max() + r.max() - 1) if r.size else 0.0]))[0]
        seg = np.flatnonzero((rf > r_next) & (n > fits))
        n, p_active, t_end, t_start = n[seg], p_active[seg], rf[seg], r_next[seg] + 1.0
        w_end = self._step_waves(n, p_active, t_end)
        busy = np.flatnonzero(w_end > 1)
        seg, n, p_active, t_end, t_start, w_end = seg[busy], n[busy], p_active[busy], t_end[busy], t_start[busy], \
            w_end[busy]
        w_start = self._step_waves(n, p_active, t_start)
        excess = np.where(w_start == w_end, (w_end - 1.0) * (t_end - t_start + 1.0), 0.0)
        mixed = np.flatnonzero(w_start != w_end)
        if mixed.size:
            steps = (t_end[mixed] - t_start[mixed] + 1.0).astype(np.int64)
            cell = np.repeat(mixed, steps)
            t = t_start[cell] + (np.arange(cell.size) - np.repeat(np.cumsum(steps) - steps, steps))
            seg = np.concatenate([seg, seg[cell]])
            excess = np.concatenate([excess, self._step_waves(n[cell], p_active[cell], t) - 1.0])
        waves = np.zeros(counts.size)
        waves[some] = rf[head]                                              # one wave a step to begin with
        return waves + np.bincount(np.searchsorted(ends, seg, side="right"), weights=excess, minlength=counts.size)

    def _decode_waves(self, p, r, replica, d, shortcut: bool = True) -> np.ndarray:
        """W_dec per replica. A replica whose requests' final contexts fit the KV budget together
        (Σ (p_i + r_i − 1) ≤ B_kv / b_kv, and at most ``max_seqs`` requests) never splits a step into waves,
        so W_dec = max r_i there exactly; the others (all with ``shortcut=False``) are stepped through
        (:meth:`_stepped_waves`)."""
        w = np.zeros(d)
        if r.size == 0 or int(r.max()) == 0:
            return w
        w_max = np.zeros(d)
        np.maximum.at(w_max, replica, r.astype(float))
        final = np.bincount(replica, weights=np.maximum(p + r - 1, 0).astype(float), minlength=d)
        count = np.bincount(replica, minlength=d)
        kv_tokens = self.kv_budget_bytes / self.kv_bytes_per_token
        easy = (final <= kv_tokens) & shortcut
        if self.max_seqs is not None:
            easy &= count <= self.max_seqs
        w[easy] = w_max[easy]
        hard = np.nonzero(~easy)[0]
        if hard.size == 0:
            return w
        slot = np.full(d, -1, dtype=np.int64)
        slot[hard] = np.arange(hard.size)
        keep = slot[replica] >= 0
        rep, pp, rr = slot[replica[keep]], p[keep], r[keep]
        order = grouped_order(rep, rr.max() - rr)          # replica by replica, longest response first
        w[hard] = self._stepped_waves(pp[order], rr[order], np.bincount(rep, minlength=hard.size))
        return w

    def _prefill_terms(self, b, p_sum, p2_sum, longest_prompt=None) -> tuple:
        """``(W_pre, F_pre)`` of replicas holding ``b`` requests whose prompts sum to ``p_sum`` (squares:
        ``p2_sum``). With ``longest_prompt`` (no prompt is longer): N_max falls as the mean prompt grows, so when
        N_max(longest_prompt) admits every replica's requests at once, W_pre is 1 without evaluating N_max."""
        if longest_prompt is not None and b.max() <= self._n_max(np.array([float(longest_prompt)]))[0]:
            w_pre = np.where(b > 0, 1.0, 0.0)
        else:
            mean_p = p_sum / np.maximum(b, 1.0)
            n_pre = np.minimum(b, self._n_max(mean_p))
            w_pre = np.where(b > 0, np.ceil(b / np.maximum(n_pre, 1.0)), 0.0)
        return w_pre, prefill_flops_of_sums(self.model, b, p_sum, p2_sum, self.image_tokens_per_prompt)

    def replica_features(self, prompt_lens, response_lens, replica=None, d: int = 1) -> RolloutFeatures:
        """Features of ``d`` replicas; request i runs on replica ``replica[i]`` (all on replica 0 if None)."""
        p, r = lengths(prompt_lens, response_lens)
        d = check_replicas(d)
        replica = np.zeros(p.size, np.int64) if replica is None else np.asarray(replica, np.int64)
        if replica.shape != p.shape or (replica.size and (replica.min() < 0 or replica.max() >= d)):
            raise ValueError("replica must give each request a replica index in [0, d)")
        return self._features(p, r, replica, d)

    def _features(self, p, r, replica, d: int) -> RolloutFeatures:
        """:meth:`replica_features` of checked lengths and replicas."""
        pf = p.astype(float)
        rf = r.astype(float)
        b = np.bincount(replica, minlength=d).astype(float)
        p_sum = np.bincount(replica, weights=pf, minlength=d)
        p2_sum = np.bincount(replica, weights=pf * pf, minlength=d)
        w_pre, f_pre = self._prefill_terms(b, p_sum, p2_sum)
        n_tok = np.bincount(replica, weights=rf, minlength=d)
        h_dec = np.bincount(replica, weights=rf * pf + rf * (rf - 1.0) / 2.0, minlength=d)
        return RolloutFeatures(b, w_pre, f_pre, p_sum, self._decode_waves(p, r, replica, d), n_tok, h_dec)

    def decode_features(self, prompt_lens, response_lens) -> tuple:
        """``(W_dec, N_tok, H_dec)`` of one replica's request set."""
        f = self.replica_features(prompt_lens, response_lens)
        return float(f.w_dec[0]), float(f.n_tok[0]), float(f.h_dec[0])

    # ------------------------------------------------------------------------------------------
    def prefill_time(self, prompt_lens) -> float:
        """overlap(P_pre, C_pre, r) for one replica's prompts."""
        p = lengths(prompt_lens)
        f = self.replica_features(p, np.zeros_like(p))
        q = self.params
        return float(overlap(q.tau_pre * f.w_pre[0] + q.alpha_pre * f.f_pre[0]
                             + request_admission_time(q, f.requests[0]), q.c_pre * f.prompt_tokens[0], q.r))

    def decode_time(self, prompt_lens, response_lens) -> float:
        """overlap(P_dec, C_dec, r) for one replica's request set."""
        w, n, h = self.decode_features(prompt_lens, response_lens)
        q = self.params
        return float(overlap(q.tau_dec * w + q.beta_tok * n + q.beta_hist * h, q.c_dec * n, q.r))

    def prefill_times(self, prompt_lens, replica, d: int) -> np.ndarray:
        """:meth:`prefill_time` of each of ``d`` replicas, request i on replica ``replica[i]`` (one pass)."""
        p = lengths(prompt_lens)
        f = self.replica_features(p, np.zeros_like(p), replica, d)
        q = self.params
        return combine(np.asarray(q.tau_pre * f.w_pre + q.alpha_pre * f.f_pre + request_admission_time(q, f.requests),
                                  dtype=float),
                       np.asarray(q.c_pre * f.prompt_tokens, dtype=float), np.asarray(q.r, dtype=float))

    def decode_times(self, prompt_lens, response_lens, replica, d: int) -> np.ndarray:
        """:meth:`decode_time` of each of ``d`` replicas, request i on replica ``replica[i]`` (one pass)."""
        f = self.replica_features(prompt_lens, response_lens, replica, d)
        q = self.params
        return combine(np.asarray(q.tau_dec * f.w_dec + q.beta_tok * f.n_tok + q.beta_hist * f.h_dec, dtype=float),
                       np.asarray(q.c_dec * f.n_tok, dtype=float), np.asarray(q.r, dtype=float))

    def replica_time(self, prompt_lens, response_lens) -> float:
        """T_r,rep = overlap(P_pre, C_pre, r) + overlap(P_dec, C_dec, r)."""
        return float(replica_times_from_features(self.params, self.replica_features(prompt_lens, response_lens))[0])

    def partition(self, prompt_lens, response_lens, d: int, group_size: int = 1) -> tuple:
        """``(replica of each request, d_eff)``: whole groups dealt round-robin to min(d, groups) replicas."""
        p, _ = lengths(prompt_lens, response_lens)
        return self._deal(p.size, check_replicas(d), check_replicas(group_size, "group_size"))

    @staticmethod
    def _deal(requests: int, d: int, g: int) -> tuple:
        """:meth:`partition` of ``requests`` requests in groups of ``g`` (checked counts)."""
        if requests % g:
            raise ValueError(f"{requests} requests do not split into groups of group_size={g}; pass whole groups "
                             "laid out group after group, or group_size=1")
        n_groups = requests // g
        if n_groups == 0:
            return np.zeros(0, np.int64), 0
        d_eff = min(d, n_groups)
        return np.repeat(np.arange(n_groups, dtype=np.int64) % d_eff, g), d_eff

    def replica_times(self, prompt_lens, response_lens, d: int, group_size: int = 1) -> np.ndarray:
        """T_r,rep of each busy replica under :meth:`partition`."""
        p, r = lengths(prompt_lens, response_lens)
        replica, d_eff = self._deal(p.size, check_replicas(d), check_replicas(group_size, "group_size"))
        if d_eff == 0:
            return np.zeros(0)
        return replica_times_from_features(self.params, self._features(p, r, replica, d_eff))

    def stage_time(self, prompt_lens, response_lens, d: int, group_size: int = 1) -> float:
        """M_r: replica-max over the round-robin partition of the requests (groups whole) on d replicas."""
        t = self.replica_times(prompt_lens, response_lens, d, group_size)
        return float(t.max()) if t.size else 0.0

    def stage_times(self, prompt_lens, response_lens, ds, group_size: int = 1) -> np.ndarray:
        """:meth:`stage_time` for every replica count in ``ds`` at once (the planner's every candidate), the same
        numbers.

        A replica's features are sums over the groups dealt to it (group k to replica k mod d) of per-group
        sums, and those are sums of whole numbers — exact in any order below 2**53 (otherwise each d is
        evaluated as :meth:`stage_time` does). Each capped count is evaluated once, its replicas vectorised
        with those of neighbouring counts (:class:`_RoundRobin`); a replica holding a single group is the same
        in every deal and is timed once. Only the replicas whose requests overflow the KV cache step through
        decode (:meth:`_stepped_waves`)."""
        p, r = lengths(prompt_lens, response_lens)
        ds = [check_replicas(d) for d in ds]
        self.partition(p, r, 1, group_size)               # checks the layout into whole groups
        g = check_replicas(group_size, "group_size")
        n_groups = p.size // g
        pf, rf = p.astype(float), r.astype(float)
        per_request = np.stack([np.ones(p.size), pf, pf * pf, rf, rf * pf + rf * (rf - 1.0) / 2.0,
                                np.maximum(p + r - 1, 0).astype(float)], axis=1)
        if n_groups == 0 or np.any(per_request.sum(axis=0) >= 2.0 ** 53):
            return np.array([self.stage_time(p, r, d, g) for d in ds])
        widths = np.minimum(ds, n_groups)
        deal = _RoundRobin(per_request.reshape(n_groups, g, -1).sum(axis=1), rf.reshape(n_groups, g).max(axis=1),
                           np.unique(widths))
        longest_first = stable_order(r.max() - r)
        requests = (p[longest_first], r[longest_first], small_keys(longest_first // g))   # longest response first
        longest_prompt = p.max()
        best = np.full(deal.widths.size, -np.inf)
        for lo, hi in deal.batches(_BATCH):
            sums, peak, starts = deal.sums(lo, hi)
            if starts.size:
                t = self._sums_times(sums, peak, longest_prompt, lambda hard, lo=lo, hi=hi: self._dealt_waves(
                    *requests, *deal.place(lo, hi, hard)))
                best[lo:hi][deal.multi[lo:hi] > 0] = np.maximum.reduceat(t, starts)
        alone = self._sums_times(*deal.alone(), longest_prompt,
                                 lambda hard: self._dealt_waves(*requests, np.full(hard.size, n_groups), hard))
        wide, alone_best = deal.widest(alone)
        best[wide] = np.maximum(best[wide], alone_best)
        return best[np.searchsorted(deal.widths, widths)]

    def _sums_times(self, sums, longest, longest_prompt, waves) -> np.ndarray:
        """T_r,rep of replicas from the sums over their requests — columns: requests, Σ p, Σ p², Σ r,
        Σ (r·p + r(r−1)/2), Σ max(p + r − 1, 0) — and their longest responses (no prompt longer than
        ``longest_prompt``). ``waves(replicas)`` gives W_dec of those (indices, ascending) whose requests overflow
        the KV cache."""
        b, p_sum, p2_sum, n_tok, h_dec, final = np.ascontiguousarray(sums.T)
        easy = final <= self.kv_budget_bytes / self.kv_bytes_per_token
        if self.max_seqs is not None:
            easy &= b <= self.max_seqs
        w_dec = np.where(easy, longest, 0.0)
        hard = np.flatnonzero(~easy)
        if hard.size:
            w_dec[hard] = waves(hard)
        w_pre, f_pre = self._prefill_terms(b, p_sum, p2_sum, longest_prompt)
        return replica_times_from_features(self.params, RolloutFeatures(b, w_pre, f_pre, p_sum, w_dec, n_tok, h_dec))

    def _dealt_waves(self, p, r, group, widths, replicas) -> np.ndarray:
        """W_dec of replica ``replicas[i]`` of the round-robin deal of the groups to ``widths[i]`` replicas, for
        each i (widths ascending, replicas ascending within a width); ``p``, ``r``, ``group``: the requests'
        lengths and groups, longest response first."""
        waves = []
        for w in np.unique(widths).tolist():
            wanted = replicas[widths == w]
            replica = small_keys(group % w)
            if wanted.size < w:                                 # the others sort last and are left out
                slot = np.full(w, wanted.size, dtype=np.int64)
                slot[wanted] = np.arange(wanted.size)
                replica = small_keys(slot[replica])
            counts = np.bincount(replica, minlength=wanted.size)[:wanted.size]
            order = np.argsort(replica, kind="stable")[:counts.sum()]
            waves.append(self._stepped_waves(p[order], r[order], counts))
        return np.concatenate(waves)

    def decode_iteration_time(self, live_lens) -> float:
        """One continuous-batching iteration advancing each running sequence (context ``live_lens``) by one
        token: ``τ_dec·w + β_tok·n + β_hist·Σ live`` with ``w = ⌈n / min(n, N_max(mean live))⌉`` — P_dec's
        per-step term, so summing it over decode steps gives P_dec exactly (0 for no sequences)."""
        live = np.asarray(live_lens, dtype=float).reshape(-1)
        if live.size and (np.any(live < 0) or np.any(~np.isfinite(live))):
            raise ValueError("live_lens must be non-negative context lengths")
        n = live.size
        if n == 0:
            return 0.0
        w = float(np.ceil(n / min(n, float(self._n_max(live.mean())))))
        q = self.params
        return q.tau_dec * w + q.beta_tok * n + q.beta_hist * float(live.sum())
