"""The scheduler's decisions as pure functions (paper §5.2): admission gates, dispatch and the tail split.

Each function takes numbers and stage-time predictors (callables) and returns a decision; none reads
coordinator state, so each is tested directly:

* :func:`rollout_dispatch` — Eq. 4, Q_a = round(d_a / (d_p + d_a) · Q_r);
* :func:`rollout_gate` — Eq. 3, generalised to primaries carrying run-ahead load;
* :class:`RemainingLengths` — the remaining lengths the gate times, and their expected maximum (replica-max);
* :func:`workload_time` — M_t(U, d) over chunk runs, with DrainPrefix (Algorithm 2, line 1);
* :func:`trainer_gate` — Algorithm 2, lines 1-6: T_no, T_joint, T_borrow;
* :func:`window_tail` — what the step waits after T_joint when the window ends with it (JointTailSplit's split);
* :func:`joint_tail_split` — JointTailSplit's search over integer split points.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from bidirl.core.protocol import UPDATE_STAGES, SwitchCosts, chunk_size


# --------------------------------------------------------------------------------------------------
# Rollouter-on-TrainerPool
# --------------------------------------------------------------------------------------------------

def rollout_dispatch(deficit: int, d_p: int, d_a: int) -> int:
    """Eq. 4: the prompt groups the ``d_a`` auxiliary rollouters take of a deficit of ``deficit`` groups."""
    if deficit <= 0 or d_p + d_a <= 0:
        return 0
    return round(d_a / (d_p + d_a) * deficit)


@dataclass(frozen=True)
class RolloutGate:
    """A Rollouter-on-TrainerPool decision: when the batch would be ready with primaries only (T_no) and with the
    auxiliaries after the switch (T_joint), and what the switch costs."""
    admitted: bool
    t_primary: float
    t_joint: float
    q_a: int
    cost: float

    @property
    def gain(self) -> float:
        return self.t_primary - self.t_joint


@dataclass(frozen=True)
class GroupWork:
    """A live rollout group as the Rollouter-on-TrainerPool gate sees it.

    ``worker`` is the rollouter generating it (None: parked with a prefix, waiting to resume); ``progress`` the
    tokens each response holds (the known prefix plus what the worker is estimated to have generated since it
    started); ``prefilling`` whether it has yet to (re)compute its context's KV cache (just sent or resumed);
    ``needed`` whether the next batch waits for it; ``rank`` its place in the migration order (Eq. 4's groups
    leave the primaries in this order).
    """
    group_id: int
    worker: Optional[str]
    prompt_len: int
    progress: tuple
    done: tuple
    needed: bool
    rank: tuple
    prefilling: bool = False


def _mean_above(sample: np.ndarray, g: np.ndarray) -> tuple:
    """``(E[max(R − g, 1) | R > g], n)`` over a sorted ``sample`` for each ``g``: the conditional mean remaining
    length, each sampled remainder at least one token (``nan`` where no sample exceeds ``g``), and how many
    samples exceed ``g``. With whole token counts no remainder is below one token and this is E[R − g | R > g]."""
    suffix = np.concatenate([np.cumsum(sample[::-1])[::-1], [0.0]])      # Σ of sample[k:]
    k = np.searchsorted(sample, g, side="right")                          # first sample > g
    k1 = np.searchsorted(sample, g + 1.0, side="left")                   # first sample ≥ g + 1
    n, n1 = sample.size - k, sample.size - k1
    with np.errstate(invalid="ignore", divide="ignore"):
        total = (k1 - k) + suffix[k1] - n1 * g                            # the ones within a token count 1
        return np.where(n > 0, total / np.maximum(n, 1), np.nan), n


@dataclass(frozen=True)
class RemainingLengths:
    """The remaining length of each response as a distribution, from the same samples as
    :func:`expected_remaining`: an unfinished response at ``g`` tokens still needs ``max(R − g, 1)`` for ``R``
    drawn from the recent sample's lengths above ``g`` (``source`` 0), the prior's where none of the recent ones
    is (1), or exactly one token where neither sample reaches past it (2); a finished one needs nothing (−1).

    ``mean`` is each response's expected remaining length (:func:`expected_remaining`); :meth:`expected_max` is
    the expected *longest* remaining length of a set of responses taken as independent,
    ``E[max_i X_i] = ∫ (1 − Π_i P(X_i ≤ x)) dx``, exact on the samples' support. A prompt group completes with
    its longest response and a replica's decode iterations run until its longest request ends (the appendix's
    replica-max semantics), so that, not the largest mean, is when the work a replica holds is done: the mean
    of a maximum is at least the maximum of the means (Jensen), by more the more responses and the wider the
    sample."""
    progress: np.ndarray
    source: np.ndarray
    first: np.ndarray
    mean: np.ndarray
    samples: tuple

    @classmethod
    def of(cls, progress: Sequence[int], done: Sequence[bool], sample: np.ndarray,
           prior: Optional[np.ndarray] = None) -> "RemainingLengths":
        recent = np.sort(np.asarray(sample, dtype=float).reshape(-1))
        back = np.sort(np.asarray(prior, dtype=float).reshape(-1)) if prior is not None else np.zeros(0)
        g = np.asarray(progress, dtype=float).reshape(-1)
        finished = np.asarray(done, dtype=bool).reshape(-1)
        if finished.shape != g.shape:
            raise ValueError(f"progress ({g.size}) and done ({finished.size}) must name the same responses")
        source, first, mean = np.full(g.size, -1), np.zeros(g.size, dtype=np.int64), np.zeros(g.size)
        if recent.size:
            mean_above, n = _mean_above(recent, g)
            first = np.searchsorted(recent, g, side="right")
            source = np.where(n > 0, 0, 2)
            if back.size and (n == 0).any():
                past = n == 0
                from_prior, n_prior = _mean_above(back, g[past])
                mean_above[past] = from_prior
                first[past] = np.searchsorted(back, g[past], side="right")
                source[past] = np.where(n_prior > 0, 1, 2)
            mean = np.where(source == 2, 1.0, mean_above)
            source[finished] = -1
            mean[finished] = 0.0
        return cls(g, source, first, mean, (recent, back))

    def expected_max(self, index: Sequence[int]) -> float:
        """E[max remaining length] over the responses ``index`` (finished ones contribute 0; none: 0): the
        integral of ``1 − P(max ≤ x)`` over :meth:`max_distribution`; nothing is sampled."""
        values, cdf = self.max_distribution(index)
        return _mean_of_steps(values, cdf)

    def max_distribution(self, index: Sequence[int]) -> tuple:
        """``(values, cdf)``: the distinct values the longest remaining length of the responses ``index`` can take,
        ascending, and ``P(max ≤ value)`` at each (the last is 1); empty when every response is finished.

        Each response's distribution is a step function with a jump of ``1/n_i`` at each of its ``n_i`` sampled
        remainders, so ``Π_i P(X_i ≤ x)`` changes only there: every jump of every response is one event, sorted
        once, and the product is carried through them in logs (a response's j-th jump multiplies it by
        ``j/(j − 1)``, its first one ends a zero factor)."""
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        idx = idx[self.source[idx] >= 0]
        if idx.size == 0:
            return np.zeros(0), np.zeros(0)
        # responses read from the same sample at the same progress share one distribution: once, with its
        # multiplicity as the power of its factor (the responses a worker started together stay level)
        kinds, first_of, times = np.unique(np.stack([self.source[idx], self.progress[idx]]), axis=1,
                                           return_index=True, return_counts=True)
        rep = idx[first_of]
        values, ranks, powers, log_total = [], [], [], 0.0                        # log_total: Σ_i log n_i
        for src, sample in enumerate(self.samples):
            sel, mult = rep[kinds[0] == src], times[kinds[0] == src]
            if sel.size == 0:
                continue
            n = sample.size - self.first[sel]
            rank = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)      # 0 … n_i − 1 within each
            at = np.repeat(self.first[sel], n) + rank
            values.append(np.maximum(sample[at] - np.repeat(self.progress[sel], n), 1.0))
            ranks.append(rank)
            powers.append(np.repeat(mult, n))
            log_total += float(np.sum(mult * np.log(n)))
        ones = int((self.source[idx] == 2).sum())
        values.append(np.ones(1 if ones else 0))
        ranks.append(np.zeros(1 if ones else 0, dtype=np.int64))
        powers.append(np.full(1 if ones else 0, ones))
        v, r, m = np.concatenate(values), np.concatenate(ranks), np.concatenate(powers)
        order = np.argsort(v, kind="stable")
        v, r, m = v[order], r[order], m[order]
        step = np.where(r > 0, m * np.log1p(1.0 / np.maximum(r, 1)), 0.0)        # log((j + 1) / j)^m, j = r
        zeros = idx.size - np.cumsum(np.where(r == 0, m, 0))
        log_cdf = np.cumsum(step) - log_total
        last = np.append(v[1:] != v[:-1], True)                                   # after every tie at a value
        cdf = np.where(zeros[last] == 0, np.exp(np.minimum(log_cdf[last], 0.0)), 0.0)
        cdf[-1] = 1.0                                                             # every jump taken: certain
        return v[last], cdf


def _mean_of_steps(values: np.ndarray, cdf: np.ndarray) -> float:
    """E[X] of a non-negative X taking the ascending ``values`` with ``P(X ≤ values[k]) = cdf[k]`` (the last 1):
    ``∫ (1 − P(X ≤ x)) dx``, a sum over the gaps between the values."""
    if values.size == 0:
        return 0.0
    return float(values[0] + np.sum(np.diff(values) * (1.0 - cdf[:-1])))


def expected_slowest(values: Sequence[np.ndarray], cdfs: Sequence[np.ndarray]) -> float:
    """E[max_j T_j] of independent non-negative times, each given as ascending ``values[j]`` with
    ``P(T_j ≤ values[j][k]) = cdfs[j][k]`` (the last 1): ``P(max ≤ t) = Π_j P(T_j ≤ t)``, carried through every
    replica's steps in one sort as :meth:`RemainingLengths.max_distribution` carries responses' (a step from
    ``c`` to ``c'`` multiplies the product by ``c'/c``; a replica's first step ends its zero factor)."""
    parts = []
    for v, c in zip(values, cdfs):
        v, c = np.asarray(v, float), np.asarray(c, float)
        if v.size:                                    # the values it cannot be at or below add nothing
            parts.append((v[c > 0], c[c > 0]))
    if not parts:
        return 0.0
    v = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts])
    before = np.concatenate([np.concatenate([[0.0], p[1][:-1]]) for p in parts])
    first = before == 0.0                             # a replica's first step: from 0 (a zero factor) to c
    step = np.log(c) - np.log(np.where(first, 1.0, before))
    order = np.argsort(v, kind="stable")
    v, step, first = v[order], step[order], first[order]
    zeros = len(parts) - np.cumsum(first)
    last = np.append(v[1:] != v[:-1], True)
    cdf = np.where(zeros[last] == 0, np.exp(np.minimum(np.cumsum(step)[last], 0.0)), 0.0)
    cdf[-1] = 1.0
    return _mean_of_steps(v[last], cdf)


def expected_remaining(progress: Sequence[int], done: Sequence[bool], sample: np.ndarray,
                       prior: Optional[np.ndarray] = None) -> np.ndarray:
    """Tokens each response still needs: E[R − g | R > g] over a sample of response lengths R (the recent ones
    the profiler saw), 0 for finished responses.

    The recent sample holds only responses that *finished*; the ones still generating when it was taken are
    missing from it (right-censored), and they are the longest. So a response that has outgrown every recent
    length says nothing the sample can answer: its remaining length is taken from ``prior`` (the job's
    response-length sample, the one the profiler starts from), E_prior[R − g | R > g]. Only where the response
    has outgrown the prior too (or no prior is given) does it need one more token. Before, every response past
    the recent sample's longest was one token from done: on the H100 Qwen3-30B-A3B job (GSM8K, 2,048-token cap)
    the gate predicted 0.24 s for 57 responses at 1,557–1,595 tokens (the recent sample ended at 1,555) that
    took 16.7 s, the M_r(Q_r, d_p) of Eq. 3 the window was refused on. :class:`RemainingLengths` holds the
    same distributions (and their expected maximum)."""
    return RemainingLengths.of(progress, done, sample, prior).mean


def expected_max_remaining(progress: Sequence[int], done: Sequence[bool], sample: np.ndarray,
                           prior: Optional[np.ndarray] = None) -> float:
    """The expected longest remaining length of these responses (:meth:`RemainingLengths.expected_max`): when a
    prompt group with this progress completes, in tokens of its slowest response."""
    lengths = RemainingLengths.of(progress, done, sample, prior)
    return lengths.expected_max(np.arange(lengths.mean.size))


def replica_remaining(means: np.ndarray, longest: float) -> np.ndarray:
    """Remaining lengths that give a replica's request set both expectations it is timed on: its decode
    iterations run until the longest request ends (``longest``, :meth:`RemainingLengths.expected_max`) and it
    decodes the sum of the ``means`` in tokens. The request with the largest mean takes ``longest``; the others
    share what is left of the sum, ``Σ means − longest`` (the expected tokens of every response but the longest),
    in proportion to their means. With one request, or equal certain lengths, these are the means."""
    means = np.asarray(means, dtype=float)
    out = means.copy()
    if means.size == 0 or not means.max() > 0:
        return out
    top = int(np.argmax(means))
    rest = float(means.sum() - means[top])
    out[top] = longest
    if rest > 0:
        left = max(0.0, float(means.sum()) - longest)
        out[np.arange(means.size) != top] *= left / rest
    return out


def rollout_gate(groups: Sequence[GroupWork], primaries: Sequence[str], d_a: int, q_a: int,
                 replica_time: Callable[[np.ndarray, np.ndarray, np.ndarray], float], sample: np.ndarray,
                 costs: SwitchCosts, gated: bool = True,
                 replica_times: Optional[Callable[[list], list]] = None,
                 prior: Optional[np.ndarray] = None) -> RolloutGate:
    """Eq. 3 on the work the batch really waits for.

    ``replica_time(context, remaining, prefill)`` predicts how long one rollout replica needs for a request set:
    each request's context (prompt + tokens held), the tokens it still needs, and whether it must prefill its
    context first (a group that moves or resumes recomputes its KV cache). The gate compares

    * **T_no** — primaries only: on each primary, its needed groups run to completion together with the rest of
      its load (run-ahead groups share every decode iteration, up to the last needed token), parked needed
      groups resume on the least-loaded primary; T_no is the slowest primary's expected time;
    * **T_joint** — the wait beyond the switch pair with the window: after C_in, Q_a needed groups (Eq. 4:
      ``rollout_dispatch``) move to the ``d_a`` auxiliaries in migration order, parked ones first, and resume there
      from their prefixes; the primaries keep the rest. The primaries keep generating during C_in (as Algorithm 2
      drains the trainer's queue), so a share ``f = C_in / T_no`` of the moved work is done before the
      auxiliaries start; and they keep generating through C_out, which starts when the auxiliaries' groups are
      done (the lender takes its pool back then, whether or not the primaries are). The batch is ready at
      ``max(P, C_in + (1 − f) · A + C_out)`` for the primaries' time P on what they keep and the auxiliaries'
      time A, so ``T_joint = E[max(P − C_in − C_out, (1 − f) · A)]``: the switch pair is charged in full where
      the auxiliaries end last, and only its part past the primaries' own work where they do not.

    ``replica_times(request_sets)``, if given, is ``replica_time`` of many replicas in one call (the same
    numbers). Remaining lengths are distributions over ``sample`` (``prior``: the job's response-length sample, for
    responses longer than every recent one; :class:`RemainingLengths`), and a replica's needed work ends when the
    longest of its needed responses does: each request set is timed on that expected maximum and the conditional
    mean tokens (:func:`replica_remaining`), its run-ahead load capped at the same expected maximum, and again at
    the longest remaining length it can take; the secant through the two makes the replica's time a distribution,
    and the batch waits for the slowest replica, E[max_j T_j] (:func:`expected_slowest`): T_no over the primaries,
    T_joint over the primaries and auxiliaries alike, so spreading the same groups over more replicas is not
    mistaken for a gain (with one replica, E[T] is its time at the expected maximum). The window is admitted when
    ``C_in + T_joint + C_out < T_no`` (always, when not ``gated``: the opportunistic ablation). With fresh
    groups only and no other load, and the auxiliaries ending last, this is Eq. 3,
    ``M_r(Q_r, d_p) − M_r(Q_r, d_p + d_a) > C_in + C_out``.
    """
    cost = costs.c_in + costs.c_out
    needed = [g for g in groups if g.needed]
    if not needed or not primaries:
        return RolloutGate(admitted=not gated and bool(needed), t_primary=0.0, t_joint=0.0, q_a=0, cost=cost)
    running = collections.Counter(g.worker for g in groups)
    load = [(running[w], i, w) for i, w in enumerate(primaries)]    # parked needed groups go to the least loaded
    heapq.heapify(load)
    placed = {}
    for g in sorted(needed, key=lambda g: g.rank):
        if g.worker is None:
            n, i, w = load[0]
            heapq.heapreplace(load, (n + 1, i, w))
            placed[g.group_id] = w
    members = {w: [] for w in primaries}          # each primary's groups (its own and those placed on it), in order
    for g in groups:
        owner = g.worker if g.worker is not None else placed.get(g.group_id)
        if owner in members:
            members[owner].append(g)
    # every response's remaining-length distribution in one pass (elementwise: the same as group by group)
    lengths = RemainingLengths.of([h for g in groups for h in g.progress], [d for g in groups for d in g.done],
                                  sample, prior)
    ends = np.cumsum([len(g.progress) for g in groups])
    span = {g.group_id: np.arange(e - len(g.progress), e) for g, e in zip(groups, ends)}

    def requests(need, others=(), prefill_all=False):
        """One replica's request set as a function of its longest needed remaining length ``x``: ``(at, values,
        cdf, x̄)``. ``at(x)`` is the request set with the needed request of the largest mean at ``x``, the other
        needed ones sharing the rest of the expected tokens (:func:`replica_remaining` at the expected maximum
        ``x̄``) and the ``others`` sharing its iterations up to ``x``; ``values``/``cdf`` the distribution of
        ``x`` (:meth:`RemainingLengths.max_distribution`)."""
        idx = np.concatenate([span[g.group_id] for g in need])
        values, cdf = lengths.max_distribution(idx)
        mean = _mean_of_steps(values, cdf)
        spread = replica_remaining(lengths.mean[idx], mean)
        top = int(np.argmax(spread)) if spread.size else 0
        cuts = np.cumsum([len(g.progress) for g in need])[:-1]

        def at(x):
            needs = spread.copy()
            if needs.size:
                needs[top] = x
            shares = np.split(needs, cuts) + [np.minimum(lengths.mean[span[g.group_id]], x) for g in others]
            ctx, rem, pre = [], [], []
            for g, part in zip(list(need) + list(others), shares):
                for held, r in zip(g.progress, part):
                    if r > 0:
                        ctx.append(g.prompt_len + held)
                        rem.append(r)
                        pre.append(prefill_all or g.worker is None or g.prefilling)
            return np.asarray(ctx, float), np.asarray(rem, float), np.asarray(pre, bool)
        return at, values, cdf, mean

    def times(request_sets: list) -> list:
        if replica_times is not None:
            return replica_times(request_sets)
        return [replica_time(*sets) for sets in request_sets]

    def finishes(sets: list) -> tuple:
        """Each replica's time as a distribution ``(values, cdfs)``: its time at its expected longest remaining
        length and at its longest possible one (the replica model's secant between them, exact at both)."""
        if not sets:
            return [], []
        ends = [values[-1] if values.size else mean for _, values, _, mean in sets]
        t = times([at(mean) for at, _, _, mean in sets] + [at(end) for (at, *_), end in zip(sets, ends)])
        at_mean, at_end = t[:len(sets)], t[len(sets):]
        finish, cdfs = [], []
        for (at, values, cdf, mean), end, t1, t2 in zip(sets, ends, at_mean, at_end):
            slope = (t2 - t1) / (end - mean) if end > mean else 0.0
            if values.size == 0 or not slope > 0.0:      # no spread (or a model not rising with it)
                finish.append(np.array([t1]))
                cdfs.append(np.array([1.0]))
            else:
                finish.append(np.maximum(t1 + slope * (values - mean), 0.0))
                cdfs.append(cdf)
        return finish, cdfs

    def primary_sets(moved: set) -> list:
        """Each primary holding needed groups (less the ``moved`` ones): its request set."""
        sets = []
        for w in primaries:
            mine = [g for g in members[w] if g.group_id not in moved]
            need = [g for g in mine if g.needed]
            if need:
                sets.append(requests(need, [g for g in mine if not g.needed]))
        return sets

    t_no = expected_slowest(*finishes(primary_sets(set())))
    q_a = min(q_a, len(needed))
    movers = sorted(needed, key=lambda g: (g.worker is not None, g.rank))[:q_a]
    aux = [requests(movers[k::d_a], prefill_all=True) for k in range(d_a) if movers[k::d_a]] if d_a > 0 else []
    drained = min(1.0, costs.c_in / t_no) if t_no > 0 else 1.0
    # the primaries never stop: their remaining work runs from now, through both switches (the lender's switch
    # out starts when the auxiliaries' groups are done, while the primaries may still decode theirs), so past
    # the switch pair the batch waits max(primary − C_in − C_out, (1 − f) · auxiliary)
    if not aux:                                   # nothing would move: the window cannot shorten the wait
        return RolloutGate(admitted=not gated, t_primary=t_no, t_joint=t_no, q_a=0, cost=cost)
    kept, kept_cdfs = finishes(primary_sets({g.group_id for g in movers}))
    moved, moved_cdfs = finishes(aux)
    t_joint = expected_slowest([np.maximum(f - cost, 0.0) for f in kept] + [(1.0 - drained) * f for f in moved],
                               kept_cdfs + moved_cdfs)
    return RolloutGate(admitted=(t_no - t_joint > cost) if gated else True, t_primary=t_no, t_joint=t_joint,
                       q_a=q_a, cost=cost)


# --------------------------------------------------------------------------------------------------
# Trainer-on-RolloutPool
# --------------------------------------------------------------------------------------------------

def chunk_runs(stages: Sequence[str], size: int, chunk_len: Optional[Callable[[int, int], int]] = None) -> list:
    """``[(first, end)]`` index ranges cutting a stage-ordered unit list into chunks of at most ``size`` units
    that never cross a stage boundary (how lazy pull cuts it). ``chunk_len(first, end)``, when given, is the
    length of the chunk starting at ``first`` in a stage run ending at ``end`` (token-budget micro-batches,
    :func:`~bidirl.core.protocol.packed_chunk_len`) instead of ``size``."""
    runs, i = [], 0
    for _, same in itertools.groupby(stages):
        end = i + len(list(same))
        if chunk_len is None:
            runs += ((a, min(a + size, end)) for a in range(i, end, size))
        else:
            a = i
            while a < end:
                b = min(end, a + chunk_len(a, end))
                runs.append((a, b))
                a = b
        i = end
    return runs


class Workload(NamedTuple):
    """:func:`workload_time`'s answer: ``seconds`` from now until the workload is done, the leading units
    ``drained`` within the drain time, and when, from now, the last of them ends (``drained_at``: the start of
    the first chunk, ``−ran``, when none is)."""
    seconds: float
    drained: int
    drained_at: float


def workload_time(stages: Sequence[str], run_time: Callable[[int, int, int], float], d: int,
                  micro_batch_per_device: int, drain: Optional[float] = None, rho: int = 1,
                  chunk_len: Optional[Callable[[int, int, int], int]] = None, sequence_parallel: int = 1,
                  ran: float = 0.0) -> Workload:
    """M_t(U, d) of units with these ``stages``: chunks of :func:`~bidirl.core.protocol.chunk_size` units (one
    micro-batch on each device of ``d`` replicas of ``rho`` devices), summed, less the ``ran`` seconds the
    replicas have already spent on the leading chunk (one running when the workload is timed).

    ``run_time(first, end, d)`` predicts the chunk of units ``[first, end)`` on ``d`` replicas. With ``drain``,
    ``drained`` counts the leading units the ``d`` replicas finish within ``drain`` seconds (DrainPrefix: the
    work primaries do while auxiliaries are prepared). ``chunk_len(first, end, d)``: token-budget chunk lengths
    (:func:`chunk_runs`).
    """
    total = drained_at = -float(ran)
    drained = 0
    cut = None if chunk_len is None else (lambda a, b: chunk_len(a, b, d))
    for first, end in chunk_runs(stages, chunk_size(micro_batch_per_device, rho, d, sequence_parallel), cut):
        total += run_time(first, end, d)
        if drain is not None and total <= drain:
            drained, drained_at = end, total
    return Workload(total, drained, drained_at)


@dataclass(frozen=True)
class TrainerGate:
    """A Trainer-on-RolloutPool decision (Algorithm 2): T_no, T_joint on the drained workload, T_borrow."""
    admitted: bool
    t_no: float
    t_joint: float
    t_borrow: float
    drained: int
    cost: float

    @property
    def gain(self) -> float:
        return self.t_no - self.t_joint


def window_tail(t_joint: float, d_p: int, d_a: int, c_out: float, c_grad: float, optimizer: float) -> float:
    """What a Trainer-on-RolloutPool window that ends with the step adds after ``T_joint`` (the joint workload on
    ``d_p + d_a`` replicas), the optimizer step excluded (it is paid with or without the window).

    The primaries' side ends with ``g = C_grad + optimizer`` (merge, then the optimizer step), the auxiliaries'
    with the switch back ``C_out``; JointTailSplit (§5.2, Algorithm 2 line 9) minimises the later of the two,
    ``max(x_p + g, x_a + C_out)`` over the primaries' and auxiliaries' shares with ``d_p·x_p + d_a·x_a =
    (d_p + d_a)·T_joint`` (replica-seconds of the joint workload). With the lag ``L = C_out − g``:

    * ``L ≤ 0``: equal shares, ``x = T_joint`` (the runtime's split delays the auxiliaries by ``max(0, L)``,
      :meth:`~bidirl.core.coordinator.Coordinator._yield_lag`); the step waits ``C_grad`` beyond ``T_joint`` (the
      switch back hides behind the merge and optimizer step);
    * ``0 < L`` and ``T_joint ≥ d_p·L/(d_p + d_a)``: the auxiliaries take ``L`` seconds less than the primaries,
      ``x_a = T_joint − d_p·L/(d_p + d_a)``, so the lag is shared by all ``d_p + d_a`` replicas:
      ``C_grad + d_a·L/(d_p + d_a)``. Charging the whole ``L`` (both sides ending together, then the switch back)
      counts ``d_p·L/(d_p + d_a)`` of the switch that the primaries' longer share hides;
    * otherwise the best split leaves the auxiliaries nothing: ``max((d_p + d_a)/d_p·T_joint + g, C_out) −
      optimizer − T_joint`` (the primaries run the whole joint workload).

    The split is taken as continuous; JointTailSplit's is in whole units, at least one per device."""
    g = c_grad + optimizer
    lag = c_out - g
    if lag <= 0:
        return c_grad
    if d_p < 1 or d_a < 0:
        raise ValueError(f"window_tail: d_p ({d_p}) must be ≥ 1 and d_a ({d_a}) ≥ 0")
    if t_joint >= d_p * lag / (d_p + d_a):
        return c_grad + d_a * lag / (d_p + d_a)
    return max((d_p + d_a) / d_p * t_joint + g, c_out) - optimizer - t_joint


def trainer_gate(stages: Sequence[str], run_time: Callable[[int, int, int], float], d_p: int, d_a: int,
                 micro_batch_per_device: int, costs: SwitchCosts, gated: bool = True, rho: int = 1,
                 optimizer: float = 0.0, chunk_len: Optional[Callable[[int, int, int], int]] = None,
                 sequence_parallel: int = 1, ran: float = 0.0) -> TrainerGate:
    """Algorithm 2, lines 1-6: ``U' = DrainPrefix(U, C_in)``, ``T_no = M_t(U, d_p)``,
    ``T_borrow = C_in + M_t(U', d_p + d_a) + C_out + C_grad``; admitted when ``T_borrow < T_no`` (always when
    there is work left, when not ``gated``). C_grad is charged only if U' holds actor-update work.

    One refinement of the paper's sum, because the runtime overlaps them (given ``optimizer``, the predicted
    optimizer step, > 0): when the window ends with the step, the switch back (C_out) follows the auxiliaries'
    last chunk while the primaries' last chunk is followed by the gradient merge and the optimizer step
    (``g = C_grad + optimizer``, paid with or without borrowing), and JointTailSplit (§5.2: the split that
    "minimizes the larger predicted completion time of the two sides") gives the auxiliary side that much less
    work (:meth:`bidirl.core.coordinator.Coordinator._yield_lag`). The step waits for what
    :func:`window_tail` gives, not ``C_out + C_grad`` after ``T_joint``. With ``optimizer`` 0 (not predicted)
    the tail is Algorithm 2's ``C_out + C_grad``. ``stages`` is the stage of each remaining unit in order;
    ``run_time(first, end, d)`` as in :func:`workload_time`.

    Two refinements time the work from now, as the runtime does it:

    * ``ran``: seconds the primaries have already run of U's leading chunk, sent and started before the decision
      (U holds every unfinished unit, a running chunk's too). T_no and the drain leave that part out; counted
      in full, it made T_no exactly that much too long (0.8 s median, up to 5.5 s, on the refused decisions of
      the runs ``bidirl reproduce`` simulates).
    * DrainPrefix takes whole chunks, but when C_in ends the primaries are part-way into the next one
      (``C_in − drained_at`` seconds of it, ``ran`` included when nothing drained), and that work is done: the
      joint workload, which JointTailSplit balances over the ``d_p + d_a`` replicas, is that many primary
      replica-seconds smaller, so T_joint is ``M_t(U', d_p + d_a)`` less ``(C_in − drained_at)·d_p/(d_p + d_a)``.
      Left out, it made T_borrow about half a chunk too long.
    """
    no = workload_time(stages, run_time, d_p, micro_batch_per_device, drain=costs.c_in, rho=rho,
                       chunk_len=chunk_len, sequence_parallel=sequence_parallel, ran=ran)
    t_no, drained = no.seconds, no.drained
    rest = stages[drained:]
    shifted = None if chunk_len is None else (lambda a, b, d: chunk_len(a + drained, b + drained, d))
    t_joint = workload_time(rest, lambda a, b, d: run_time(a + drained, b + drained, d), d_p + d_a,
                            micro_batch_per_device, rho=rho, chunk_len=shifted,
                            sequence_parallel=sequence_parallel).seconds
    if rest:      # the primaries' part of the chunk they run when C_in ends (less than that chunk: it did not drain)
        t_joint = max(0.0, t_joint - (costs.c_in - no.drained_at) * d_p / (d_p + d_a))
    c_grad = costs.c_grad if any(s in UPDATE_STAGES for s in rest) else 0.0
    if optimizer > 0:
        tail = window_tail(t_joint, d_p, d_a, costs.c_out, c_grad, optimizer)
    else:
        tail = costs.c_out + c_grad
    t_borrow = costs.c_in + t_joint + tail
    return TrainerGate(admitted=(t_borrow < t_no) if gated else bool(rest), t_no=t_no, t_joint=t_joint,
                       t_borrow=t_borrow, drained=drained, cost=costs.c_in + tail)


def charge_refreshes(gate: TrainerGate, refreshes: int, seconds: float, d_p: int, d_a: int,
                     gated: bool = True) -> TrainerGate:
    """The trainer gate (Eq. 3) with the auxiliary gang's weight refreshes the window pays
    (:mod:`bidirl.core.aux_weights`): one per optimizer step that kept the version within the window, each
    ``seconds`` (a weight transfer from the primaries). While the auxiliary gang receives weights the primaries keep
    computing, so each refresh takes ``d_a · seconds`` replica-seconds of auxiliary work away from the joint
    workload, which the ``d_p + d_a`` replicas then finish ``d_a · seconds / (d_p + d_a)`` later: T_borrow and the
    window's cost grow by that per refresh. Admission is re-read from the new T_borrow (as :func:`trainer_gate`)."""
    if refreshes < 0 or not seconds >= 0:
        raise ValueError(f"refreshes ({refreshes}) and seconds ({seconds}) must be ≥ 0")
    if refreshes == 0 or seconds == 0:
        return gate
    extra = refreshes * seconds * d_a / (d_p + d_a)
    t_borrow = gate.t_borrow + extra
    return dataclasses.replace(gate, t_borrow=t_borrow, cost=gate.cost + extra,
                               admitted=(t_borrow < gate.t_no) if gated else gate.admitted)


#: candidates of the tail split announced to ``prepare`` at a time (:func:`joint_tail_split`)
TAIL_BLOCK = 64


def joint_tail_split(n: int, d_p: int, d_a: int, ready_p: float, ready_a: float,
                     time_p: Callable[[int], float], time_a: Callable[[int], float],
                     bound_p: Optional[Callable[[int], float]] = None,
                     bound_a: Optional[Callable[[int], float]] = None,
                     prepare: Optional[Callable[[list], None]] = None) -> tuple:
    """JointTailSplit: how many of the ``n`` trailing units the auxiliary side takes.

    Candidates are every integer split where each side gets nothing or at least one unit per device;
    ``time_p(k)`` / ``time_a(k)`` predict a side running its ``k`` units (full chunks of s_max plus at most one
    remainder), starting when it is ready (``ready_*`` seconds from now). The choice minimises the later
    completion (ties: fewer units to the auxiliary side); O(n) candidates. Returns ``(n_a, finish)``; when no
    split is feasible (fewer units than devices on either side) everything stays with the primaries.

    ``bound_p(k)`` / ``bound_a(k)``, if given, are lower bounds of ``time_p(k)`` / ``time_a(k)``: a candidate
    whose bounded completion cannot beat the best so far is passed over without asking ``time_*`` (the same
    choice; only candidates near the optimum are timed).

    ``prepare(splits)``, if given, is told ahead of the scan, a block of :data:`TAIL_BLOCK` candidates at a time,
    which ``n_a`` it is about to time (those the bounds do not already rule out), so a caller can time their
    chunks in one vectorised pass; the scan and its choice are unchanged.
    """
    def at_least(n_a: int) -> float:
        n_p = n - n_a
        return max(ready_p + bound_p(n_p) if n_p else ready_p, ready_a + bound_a(n_a) if n_a else ready_a)

    pruning = bound_p is not None and bound_a is not None
    feasible = [n_a for n_a in range(n + 1) if not ((0 < n_a < d_a) or (0 < n - n_a < d_p))]
    best = None
    for b0 in range(0, len(feasible), TAIL_BLOCK):
        block = feasible[b0:b0 + TAIL_BLOCK]
        if prepare is not None:
            prepare([n_a for n_a in block if best is None or not pruning or at_least(n_a) < best[1] - 1e-12])
        for n_a in block:
            n_p = n - n_a
            if best is not None and pruning and not at_least(n_a) < best[1] - 1e-12:
                continue
            t_p = ready_p + time_p(n_p) if n_p else ready_p
            t_a = ready_a + time_a(n_a) if n_a else ready_a
            finish = max(t_p, t_a)
            if best is None or finish < best[1] - 1e-12:
                best = (n_a, finish)
    if best is None:
        best = (0, ready_p + time_p(n))
    return best
