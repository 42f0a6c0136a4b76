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

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from bidirl.core.protocol import UPDATE_STAGES, SwitchCosts


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
    """A Rollouter-on-TrainerPool decision: predicted primary-only time, joint time, their gain and the cost."""
    admitted: bool
    t_primary: float
    t_joint: float
    q_a: int
    load: int
    cost: float

    @property
    def gain(self) -> float:
        return self.t_primary - self.t_joint


def rollout_gate(m_r: Callable[[int, int], float], deficit: int, load: int, d_p: int, d_a: int,
                 costs: SwitchCosts, gated: bool = True) -> RolloutGate:
    """Eq. 3 for primaries that also carry run-ahead groups.

    ``m_r(groups, d)`` predicts the time ``d`` replicas need for ``groups`` groups. The deficit Q_r closes
    when the primaries' load L ≥ Q_r drains (all of it progresses together under continuous batching);
    after dispatch (Eq. 4) the primaries keep L − Q_a and the auxiliaries take Q_a, so the gain is
    ``M_r(L, d_p) − max(M_r(L − Q_a, d_p), M_r(Q_a, d_a))`` — Eq. 3's
    ``M_r(Q_r, d_p) − M_r(Q_r, d_p + d_a)`` with a capacity-proportional split when L = Q_r. Admitted when the
    gain exceeds C_in + C_out (always, when not ``gated``: the opportunistic ablation).
    """
    def m(groups: int, d: int) -> float:
        return m_r(groups, d) if groups > 0 and d > 0 else 0.0

    load = max(deficit, load)
    q_a = rollout_dispatch(deficit, d_p, d_a)
    t_p = m(load, d_p)
    t_j = max(m(load - q_a, d_p), m(q_a, d_a))
    cost = costs.c_in + costs.c_out
    return RolloutGate(admitted=(t_p - t_j > cost) if gated else True, t_primary=t_p, t_joint=t_j, q_a=q_a,
                       load=load, cost=cost)


# --------------------------------------------------------------------------------------------------
# Trainer-on-RolloutPool
# --------------------------------------------------------------------------------------------------

def chunk_runs(stages: Sequence[str], size: int) -> list:
    """``[(first, end)]`` index ranges cutting a stage-ordered unit list into chunks of at most ``size`` units
    that never cross a stage boundary (how lazy pull cuts it)."""
    runs, i, n = [], 0, len(stages)
    while i < n:
        j = i
        while j < n and j - i < size and stages[j] == stages[i]:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def workload_time(stages: Sequence[str], run_time: Callable[[int, int, int], float], d: int, max_chunk: int,
                  drain: Optional[float] = None) -> tuple:
    """M_t(U, d) of units with these ``stages``: chunks of ``max_chunk · d`` units, summed.

    ``run_time(first, end, d)`` predicts the chunk of units ``[first, end)`` on ``d`` replicas. Returns
    ``(seconds, drained)``; with ``drain``, ``drained`` counts the leading units the ``d`` replicas finish
    within ``drain`` seconds (DrainPrefix: the work primaries do while auxiliaries are prepared).
    """
    total, drained = 0.0, 0
    for first, end in chunk_runs(stages, max_chunk * d):
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
                 max_chunk: int, costs: SwitchCosts, gated: bool = True) -> TrainerGate:
    """Algorithm 2, lines 1-6: ``U' = DrainPrefix(U, C_in)``, ``T_no = M_t(U, d_p)``,
    ``T_borrow = C_in + M_t(U', d_p + d_a) + C_out + C_grad``; admitted when ``T_borrow < T_no`` (always when
    there is work left, when not ``gated``). C_grad is charged only if U' holds actor-update work.

    ``stages`` is the stage of each remaining unit in order; ``run_time(first, end, d)`` as in
    :func:`workload_time`.
    """
    t_no, drained = workload_time(stages, run_time, d_p, max_chunk, drain=costs.c_in)
    rest = stages[drained:]
    t_joint, _ = workload_time(rest, lambda a, b, d: run_time(a + drained, b + drained, d), d_p + d_a, max_chunk)
    c_grad = costs.c_grad if any(s in UPDATE_STAGES for s in rest) else 0.0
    t_borrow = costs.c_in + t_joint + costs.c_out + c_grad
    return TrainerGate(admitted=(t_borrow < t_no) if gated else bool(rest), t_no=t_no, t_joint=t_joint,
                       t_borrow=t_borrow, drained=drained, cost=costs.c_in + costs.c_out + c_grad)


def joint_tail_split(n: int, d_p: int, d_a: int, ready_p: float, ready_a: float,
                     time_p: Callable[[int], float], time_a: Callable[[int], float]) -> tuple:
    """JointTailSplit: how many of the ``n`` trailing units the auxiliary side takes.

    Candidates are every integer split where each side gets nothing or at least one unit per device;
    ``time_p(k)`` / ``time_a(k)`` predict a side running its ``k`` units (full chunks of s_max plus at most one
    remainder), starting when it is ready (``ready_*`` seconds from now). The choice minimises the later
    completion (ties: fewer units to the auxiliary side); O(n) candidates. Returns ``(n_a, finish)``; when no
    split is feasible (fewer units than devices on either side) everything stays with the primaries.
    """
    best = None
    for n_a in range(n + 1):
        n_p = n - n_a
        if (0 < n_a < d_a) or (0 < n_p < d_p):
            continue
        t_p = ready_p + time_p(n_p) if n_p else ready_p
        t_a = ready_a + time_a(n_a) if n_a else ready_a
        finish = max(t_p, t_a)
        if best is None or finish < best[1] - 1e-12:
            best = (n_a, finish)
    if best is None:
        best = (0, ready_p + time_p(n))
    return best
