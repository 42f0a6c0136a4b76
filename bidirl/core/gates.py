"""The scheduler's decisions as pure functions (paper §5.2): admission gates, dispatch and the tail split.

Each function takes numbers and stage-time predictors (callables) and returns a decision; none reads
coordinator state, so each is tested directly:

* :func:`rollout_dispatch` — Eq. 4, Q_a = round(d_a / (d_p + d_a) · Q_r);
* :func:`rollout_gate` — Eq. 3, generalised to primaries carrying run-ahead load;
* :func:`workload_time` — M_t(U, d) over chunk runs, with DrainPrefix (Algorithm 2, line 1);
* :func:`trainer_gate` — Algorithm 2, lines 1-6: T_no, T_joint, T_borrow;
* :func:`joint_tail_split` — JointTailSplit's search over integer split points.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

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
    """``(E[R | R > g], n)`` over a sorted ``sample`` for each ``g``: the conditional mean (``nan`` where no
    sample exceeds ``g``) and how many samples exceed ``g``."""
    suffix = np.concatenate([np.cumsum(sample[::-1])[::-1], [0.0]])      # Σ of sample[k:]
    k = np.searchsorted(sample, g, side="right")                          # first sample > g
    n = sample.size - k
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, suffix[k] / np.maximum(n, 1), np.nan), n


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
    took 16.7 s, the M_r(Q_r, d_p) of Eq. 3 the window was refused on."""
    sample = np.sort(np.asarray(sample, dtype=float))
    g = np.asarray(progress, dtype=float)
    out = np.zeros(g.size)
    if sample.size == 0:
        return out
    mean_above, n = _mean_above(sample, g)
    if prior is not None and np.asarray(prior).size and (n == 0).any():
        past = n == 0
        from_prior, _ = _mean_above(np.sort(np.asarray(prior, dtype=float)), g[past])
        mean_above[past] = from_prior
    mean_above = np.where(np.isnan(mean_above), g + 1.0, mean_above)
    out = np.maximum(mean_above - g, 1.0)
    out[np.asarray(done, dtype=bool)] = 0.0
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
      groups resume on the least-loaded primary; T_no is the slowest primary;
    * **T_joint** — after C_in, Q_a needed groups (Eq. 4: ``rollout_dispatch``) move to the ``d_a`` auxiliaries in
      migration order, parked ones first, and resume there from their prefixes; the primaries keep the rest. The
      primaries keep generating during C_in (as Algorithm 2 drains the trainer's queue), so a share
      ``f = C_in / T_no`` of the work is done before the auxiliaries start and
      ``T_joint = (1 − f) · max(primaries, auxiliaries)``.

    ``replica_times(request_sets)``, if given, is ``replica_time`` of many replicas in one call (the same
    numbers). Remaining lengths are :func:`expected_remaining` over ``sample`` (``prior``: the job's
    response-length sample, for responses longer than every recent one). The window is admitted when
    ``C_in + T_joint + C_out < T_no`` (always, when not ``gated``: the opportunistic ablation). With fresh
    groups only and no other load this is Eq. 3, ``M_r(Q_r, d_p) − M_r(Q_r, d_p + d_a) > C_in + C_out``.
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
    # every group's expected remaining lengths in one pass (elementwise: the same as group by group)
    left = expected_remaining([h for g in groups for h in g.progress], [d for g in groups for d in g.done], sample,
                              prior)
    ends = np.cumsum([len(g.progress) for g in groups])
    work = {g.group_id: part for g, part in zip(groups, np.split(left, ends[:-1]))}

    def requests(members, horizon=None, prefill_all=False):
        ctx, rem, pre = [], [], []
        for g in members:
            left = work[g.group_id] if horizon is None else np.minimum(work[g.group_id], horizon)
            for held, r in zip(g.progress, left):
                if r > 0:
                    ctx.append(g.prompt_len + held)
                    rem.append(r)
                    pre.append(prefill_all or g.worker is None or g.prefilling)
        return np.asarray(ctx, float), np.asarray(rem, float), np.asarray(pre, bool)

    def times(request_sets: list) -> list:
        if replica_times is not None:
            return replica_times(request_sets)
        return [replica_time(*sets) for sets in request_sets]

    def primaries_time(moved: set) -> float:
        request_sets = []
        for w in primaries:
            mine = [g for g in members[w] if g.group_id not in moved]
            need = [g for g in mine if g.needed]
            if not need:
                continue
            horizon = max(float(work[g.group_id].max()) for g in need)
            others = [g for g in mine if not g.needed]
            c1, r1, p1 = requests(need)
            c2, r2, p2 = requests(others, horizon=horizon)
            request_sets.append((np.concatenate([c1, c2]), np.concatenate([r1, r2]), np.concatenate([p1, p2])))
        worst = 0.0
        for t in times(request_sets):
            worst = max(worst, t)
        return worst

    t_no = primaries_time(set())
    q_a = min(q_a, len(needed))
    movers = sorted(needed, key=lambda g: (g.worker is not None, g.rank))[:q_a]
    t_aux = 0.0
    if movers and d_a > 0:
        for t in times([requests(movers[k::d_a], prefill_all=True) for k in range(d_a) if movers[k::d_a]]):
            t_aux = max(t_aux, t)
    drained = min(1.0, costs.c_in / t_no) if t_no > 0 else 1.0
    t_joint = (1.0 - drained) * max(primaries_time({g.group_id for g in movers}), t_aux)
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


def workload_time(stages: Sequence[str], run_time: Callable[[int, int, int], float], d: int,
                  micro_batch_per_device: int, drain: Optional[float] = None, rho: int = 1,
                  chunk_len: Optional[Callable[[int, int, int], int]] = None, sequence_parallel: int = 1) -> tuple:
    """M_t(U, d) of units with these ``stages``: chunks of :func:`~bidirl.core.protocol.chunk_size` units (one
    micro-batch on each device of ``d`` replicas of ``rho`` devices), summed.

    ``run_time(first, end, d)`` predicts the chunk of units ``[first, end)`` on ``d`` replicas. Returns
    ``(seconds, drained)``; with ``drain``, ``drained`` counts the leading units the ``d`` replicas finish
    within ``drain`` seconds (DrainPrefix: the work primaries do while auxiliaries are prepared).
    ``chunk_len(first, end, d)``: token-budget chunk lengths (:func:`chunk_runs`).
    """
    total, drained = 0.0, 0
    cut = None if chunk_len is None else (lambda a, b: chunk_len(a, b, d))
    for first, end in chunk_runs(stages, chunk_size(micro_batch_per_device, rho, d, sequence_parallel), cut):
        total += run_time(first, end, d)
        if drain is not None and total <= drain:
            drained = end
    return total, drained


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


def trainer_gate(stages: Sequence[str], run_time: Callable[[int, int, int], float], d_p: int, d_a: int,
                 micro_batch_per_device: int, costs: SwitchCosts, gated: bool = True, rho: int = 1,
                 optimizer: float = 0.0, chunk_len: Optional[Callable[[int, int, int], int]] = None,
                 sequence_parallel: int = 1) -> TrainerGate:
    """Algorithm 2, lines 1-6: ``U' = DrainPrefix(U, C_in)``, ``T_no = M_t(U, d_p)``,
    ``T_borrow = C_in + M_t(U', d_p + d_a) + C_out + C_grad``; admitted when ``T_borrow < T_no`` (always when
    there is work left, when not ``gated``). C_grad is charged only if U' holds actor-update work.

    One refinement of the paper's sum, because the runtime overlaps them: when the window ends with the step, the
    primaries merge the auxiliary gradients (C_grad) and take the optimizer step (``optimizer`` seconds, paid
    with or without borrowing) while the rollout pool switches back (C_out), so the step waits for
    ``max(C_out, C_grad + optimizer) − optimizer`` rather than ``C_out + C_grad`` (they add up again when
    ``optimizer`` is 0 and one of them is). ``stages`` is the stage of each remaining unit in order;
    ``run_time(first, end, d)`` as in :func:`workload_time`.
    """
    t_no, drained = workload_time(stages, run_time, d_p, micro_batch_per_device, drain=costs.c_in, rho=rho,
                                  chunk_len=chunk_len, sequence_parallel=sequence_parallel)
    rest = stages[drained:]
    shifted = None if chunk_len is None else (lambda a, b, d: chunk_len(a + drained, b + drained, d))
    t_joint, _ = workload_time(rest, lambda a, b, d: run_time(a + drained, b + drained, d), d_p + d_a,
                               micro_batch_per_device, rho=rho, chunk_len=shifted,
                               sequence_parallel=sequence_parallel)
    c_grad = costs.c_grad if any(s in UPDATE_STAGES for s in rest) else 0.0
    tail = max(costs.c_out, c_grad + optimizer) - optimizer if optimizer > 0 else costs.c_out + c_grad
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
