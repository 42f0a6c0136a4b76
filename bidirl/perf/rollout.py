"""The rollout stage-time model M_r (paper appendix, "Rollout Model"), vectorised with numpy.

For the request set R_j of one replica (prompt lengths p_i, response lengths r_i, B_j = |R_j|):

* KV footprint per token ``b_kv = 2·L·H_kv·d_head·b_dtype / tp`` and KV-limited concurrency
  ``N_max(ℓ) = max(1, ⌊B_kv / (b_kv·ℓ)⌋)`` at average live length ℓ;
* prefill: ``N_pre = min(B_j, N_max(mean p))``, ``W_pre = ⌈B_j / N_pre⌉`` waves,
  ``P_pre = τ_pre·W_pre + α_pre·F_pre`` (F_pre from :func:`bidirl.perf.flops.prefill_flops`);
* decode step t: ``A_t = {i : r_i ≥ t}``, ``ℓ_t = mean_{A_t}(p_i + t − 1)``,
  ``w_t = ⌈|A_t| / min(|A_t|, N_max(ℓ_t))⌉``; features ``W_dec = Σ_t w_t``, ``N_tok = Σ r_i``,
  ``H_dec = Σ (r_i·p_i + r_i(r_i−1)/2)``; ``P_dec = τ_dec·W_dec + β_tok·N_tok + β_hist·H_dec``;
* ``T_r,rep = overlap(P_pre, C_pre, r) + overlap(P_dec, C_dec, r)`` and ``M_r(X, d) = max_j T_r,rep(X_j)``.

The decode features are computed for all t at once: per-length counts (``bincount``) give |A_t| and
Σ_{A_t} p_i as reverse cumulative sums, so the cost is O(n + max r) per replica, with no loop over requests.

**Communication.** The appendix names C_pre and C_dec without a form. Here they are tensor-parallel traffic
proportional to the tokens processed: ``C_pre = c_pre · Σ p_i`` and ``C_dec = c_dec · N_tok`` (both 0 at
tp = 1; defaults in :mod:`bidirl.perf.params`).

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

from bidirl.perf.flops import lengths
from bidirl.perf.overlap import combine, overlap
from bidirl.perf.balance import check_replicas

_BIG = float(2 ** 62)
_BLOCK_CELLS = 4_000_000      # replica × length cells per vectorised block of the decode features


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

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            low = 1.0 if f.name == "r" else 0.0
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not np.isfinite(v) or v < low:
                raise ValueError(f"RolloutParams.{f.name} must be a finite number ≥ {low:g}, got {v!r}")
            object.__setattr__(self, f.name, float(v))


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


def replica_times_from_features(params: RolloutParams, feat: RolloutFeatures) -> np.ndarray:
    """T_r,rep for every replica described by ``feat``."""
    p_pre = params.tau_pre * feat.w_pre + params.alpha_pre * feat.f_pre
    p_dec = params.tau_dec * feat.w_dec + params.beta_tok * feat.n_tok + params.beta_hist * feat.h_dec
    # the parameters were checked when made and the features are non-negative: the overlap without its checks
    r = np.asarray(params.r, dtype=float)
    return (combine(np.asarray(p_pre, dtype=float), np.asarray(params.c_pre * feat.prompt_tokens, dtype=float), r)
            + combine(np.asarray(p_dec, dtype=float), np.asarray(params.c_dec * feat.n_tok, dtype=float), r))


class RolloutModel:
    """M_r for ``model`` on ``hardware`` with tensor parallelism ``tp``.

    ``params`` defaults to :func:`bidirl.perf.params.default_rollout_params`; ``kv_budget_bytes`` (B_kv, per
    GPU) to what :func:`bidirl.perf.memory.kv_budget_bytes` leaves after weights and the activation reserve.
    ``max_seqs`` optionally caps N_max (vLLM's ``max_num_seqs``); the appendix's model has no cap (None).
    """

    def __init__(self, model, hardware, tp: int = 1, params: Optional[RolloutParams] = None,
                 kv_budget_bytes: Optional[float] = None, max_seqs: Optional[int] = None):
        from bidirl.perf.memory import kv_budget_bytes as default_budget
        from bidirl.perf.params import default_rollout_params
        self.model, self.hardware = model, hardware
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
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = np.where(live > 0, np.floor(self.kv_budget_bytes / (self.kv_bytes_per_token * live)), _BIG)
        out = np.clip(raw, 1.0, _BIG)
        if self.max_seqs is not None:
            out = np.minimum(out, self.max_seqs)
        return out

    def n_max(self, live_len):
        """N_max(ℓ) = max(1, ⌊B_kv / (b_kv·ℓ)⌋) (capped by ``max_seqs`` when set); int or int array."""
        out = self._n_max(live_len).astype(np.int64)
        return int(out) if out.ndim == 0 else out

    # ------------------------------------------------------------------------------------------
    def _decode_waves(self, p, r, replica, d, shortcut: bool = True) -> np.ndarray:
        """W_dec per replica. A replica whose requests' final contexts fit the KV budget together
        (Σ (p_i + r_i − 1) ≤ B_kv / b_kv, and at most ``max_seqs`` requests) never splits a step into waves,
        so W_dec = max r_i there exactly; the others (all with ``shortcut=False``) get the per-step sums."""
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
        width = int(rr.max()) + 1
        rows = max(1, _BLOCK_CELLS // width)
        t = np.arange(1, width, dtype=float)
        for j0 in range(0, hard.size, rows):
            j1 = min(hard.size, j0 + rows)
            sel = (rep >= j0) & (rep < j1)
            key = (rep[sel] - j0) * width + rr[sel]
            size = (j1 - j0) * width
            cnt = np.bincount(key, minlength=size).reshape(j1 - j0, width)
            psum = np.bincount(key, weights=pp[sel].astype(float), minlength=size).reshape(j1 - j0, width)
            n_ge = np.cumsum(cnt[:, ::-1], axis=1)[:, ::-1][:, 1:].astype(float)       # |A_t|, t = 1..T
            p_ge = np.cumsum(psum[:, ::-1], axis=1)[:, ::-1][:, 1:]                     # Σ_{A_t} p_i
            active = n_ge > 0
            safe_n = np.where(active, n_ge, 1.0)
            live = (p_ge + n_ge * (t - 1.0)) / safe_n                                     # ℓ_t
            waves = np.ceil(safe_n / np.minimum(safe_n, self._n_max(live)))
            w[hard[j0:j1]] = np.where(active, waves, 0.0).sum(axis=1)
        return w

    def replica_features(self, prompt_lens, response_lens, replica=None, d: int = 1) -> RolloutFeatures:
        """Features of ``d`` replicas; request i runs on replica ``replica[i]`` (all on replica 0 if None)."""
        p, r = lengths(prompt_lens, response_lens)
        d = check_replicas(d)
        replica = np.zeros(p.size, np.int64) if replica is None else np.asarray(replica, np.int64)
        if replica.shape != p.shape or (replica.size and (replica.min() < 0 or replica.max() >= d)):
            raise ValueError("replica must give each request a replica index in [0, d)")
        pf = p.astype(float)
        rf = r.astype(float)
        b = np.bincount(replica, minlength=d).astype(float)
        p_sum = np.bincount(replica, weights=pf, minlength=d)
        p2_sum = np.bincount(replica, weights=pf * pf, minlength=d)
        mean_p = p_sum / np.maximum(b, 1.0)
        n_pre = np.minimum(b, self._n_max(mean_p))
        w_pre = np.where(b > 0, np.ceil(b / np.maximum(n_pre, 1.0)), 0.0)
        m = self.model
        f_pre = 2.0 * m.params_nonembedding * p_sum + 4.0 * m.layers * m.hidden * p2_sum + 2.0 * m.hidden * m.vocab * b
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
        return float(overlap(q.tau_pre * f.w_pre[0] + q.alpha_pre * f.f_pre[0], q.c_pre * f.prompt_tokens[0], q.r))

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
        return combine(np.asarray(q.tau_pre * f.w_pre + q.alpha_pre * f.f_pre, dtype=float),
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
        p, r = lengths(prompt_lens, response_lens)
        d = check_replicas(d)
        g = check_replicas(group_size, "group_size")
        if p.size % g:
            raise ValueError(f"{p.size} requests do not split into groups of group_size={g}; pass whole groups "
                             "laid out group after group, or group_size=1")
        n_groups = p.size // g
        if n_groups == 0:
            return np.zeros(0, np.int64), 0
        d_eff = min(d, n_groups)
        return np.repeat(np.arange(n_groups, dtype=np.int64) % d_eff, g), d_eff

    def replica_times(self, prompt_lens, response_lens, d: int, group_size: int = 1) -> np.ndarray:
        """T_r,rep of each busy replica under :meth:`partition`."""
        replica, d_eff = self.partition(prompt_lens, response_lens, d, group_size)
        if d_eff == 0:
            return np.zeros(0)
        return replica_times_from_features(self.params,
                                           self.replica_features(prompt_lens, response_lens, replica, d_eff))

    def stage_time(self, prompt_lens, response_lens, d: int, group_size: int = 1) -> float:
        """M_r: replica-max over the round-robin partition of the requests (groups whole) on d replicas."""
        t = self.replica_times(prompt_lens, response_lens, d, group_size)
        return float(t.max()) if t.size else 0.0

    def stage_times(self, prompt_lens, response_lens, ds, group_size: int = 1) -> np.ndarray:
        """:meth:`stage_time` for every replica count in ``ds`` at once (the planner's every candidate), the same
        numbers.

        A replica's features are sums over the groups dealt to it (group k to replica k mod d) of per-group
        sums, and those are sums of whole numbers — exact in any order below 2**53 (otherwise each d is
        evaluated as :meth:`stage_time` does). So each d costs one reshape of the per-group sums; the decode
        waves of the replicas whose requests overflow the KV cache come from :meth:`_decode_waves`, and every
        replica of every d is timed in one vectorised pass."""
        p, r = lengths(prompt_lens, response_lens)
        ds = [check_replicas(d) for d in ds]
        self.partition(p, r, 1, group_size)               # checks the layout into whole groups
        g = check_replicas(group_size, "group_size")
        n_groups = p.size // g
        pf, rf = p.astype(float), r.astype(float)
        per_request = np.stack([np.ones(p.size), pf, pf * pf, rf, rf * pf + rf * (rf - 1.0) / 2.0,
                                np.maximum(p + r - 1, 0).astype(float)])
        if n_groups == 0 or np.any(per_request.sum(axis=1) >= 2.0 ** 53):
            return np.array([self.stage_time(p, r, d, g) for d in ds])
        # per group: its sums (one row each) and its longest response; zero rows pad the round-robin deal
        per_group = np.zeros((2 * n_groups, len(per_request) + 1))
        per_group[:n_groups, :-1] = per_request.reshape(len(per_request), n_groups, g).sum(axis=2).T
        per_group[:n_groups, -1] = rf.reshape(n_groups, g).max(axis=1)
        parts, starts, start = [], [], 0
        for d in ds:
            width = min(d, n_groups)
            grid = per_group[:-(-n_groups // width) * width].reshape(-1, width, per_group.shape[1])
            parts.append(np.concatenate([grid[:, :, :-1].sum(axis=0), grid[:, :, -1:].max(axis=0)], axis=1))
            starts.append(start)
            start += width
        b, p_sum, p2_sum, n_tok, h_dec, final, w_max = np.concatenate(parts).T
        mean_p = p_sum / np.maximum(b, 1.0)
        n_pre = np.minimum(b, self._n_max(mean_p))
        w_pre = np.where(b > 0, np.ceil(b / np.maximum(n_pre, 1.0)), 0.0)
        m = self.model
        f_pre = 2.0 * m.params_nonembedding * p_sum + 4.0 * m.layers * m.hidden * p2_sum + 2.0 * m.hidden * m.vocab * b
        easy = final <= self.kv_budget_bytes / self.kv_bytes_per_token
        if self.max_seqs is not None:
            easy &= b <= self.max_seqs
        w_dec = np.where(easy, w_max, 0.0)
        # the counts with a replica that overflows: all their replicas step through decode in one call
        hard = [(min(d, n_groups), first) for d, first, ok in zip(ds, starts, np.logical_and.reduceat(easy, starts))
                if not ok]
        if hard:
            group = np.arange(n_groups, dtype=np.int64)
            replica = np.concatenate([np.repeat(first + group % width, g) for width, first in hard])
            waves = self._decode_waves(np.tile(p, len(hard)), np.tile(r, len(hard)), replica, b.size)
            for width, first in hard:
                w_dec[first:first + width] = waves[first:first + width]
        t = replica_times_from_features(self.params, RolloutFeatures(b, w_pre, f_pre, p_sum, w_dec, n_tok, h_dec))
        return np.maximum.reduceat(t, starts)

    def decode_iteration_times(self, live_sets) -> list:
        """:meth:`decode_iteration_time` of each set of live lengths, in one pass (the same numbers)."""
        sets = [np.asarray(x, dtype=float).reshape(-1) for x in live_sets]
        sizes = np.array([x.size for x in sets], dtype=np.int64)
        if not sets:
            return []
        live = np.concatenate(sets)
        if live.size and (np.any(live < 0) or np.any(~np.isfinite(live))):
            raise ValueError("live_lens must be non-negative context lengths")
        total = np.bincount(np.repeat(np.arange(len(sets)), sizes), weights=live, minlength=len(sets))
        n = sizes.astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):      # empty sets: 0 below
            w = np.ceil(n / np.minimum(n, self._n_max(total / np.maximum(n, 1.0))))
        q = self.params
        return np.where(sizes > 0, q.tau_dec * w + q.beta_tok * n + q.beta_hist * total, 0.0).tolist()

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
