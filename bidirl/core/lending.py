"""The coordinator's lending (paper §3.2, preempt-and-yield): a borrowing decision reported and, if admitted, the
pool lent (``Switch`` in); a lease revoked — auxiliaries stop taking work and return what is recoverable — and
the pool yielded (``Switch`` out) once nothing of theirs runs on it. The lease itself is the state machine of
:mod:`~bidirl.core.lease`.

A part of :class:`bidirl.core.coordinator.Coordinator`, split out by concern: the methods read and write the
coordinator's state (its fields are declared there) and append commands to ``self._out``.
"""

from __future__ import annotations

from bidirl.core import protocol as P


class Lending:
    """Lend, revoke and yield a pool (methods of the coordinator; no state of their own)."""

    def _decide(self, direction: str, admitted: bool, gain: float, cost: float, detail: dict) -> None:
        """Report a borrowing decision; if admitted, lend the pool (lease: lend, ``Switch`` in). A decision listed in
        ``Settings.flipped_decisions`` is taken the other way (a counterfactual, ``bidirl.experiments.gate_regret``)."""
        if self.decisions_made in getattr(self.settings, "flipped_decisions", ()):
            admitted = not admitted
        self.decisions_made += 1
        self._out.append(P.Decided(P.Decision(t=self._now, direction=direction, admitted=admitted,
                                              predicted_gain=gain, cost=cost, detail=detail)))
        if admitted:
            pool = P.BORROWED_POOL[direction]
            self.window_sent[pool] = 0
            self.leases[pool].fire("lend")
            expected = self.profiler.charged(direction, self._now).c_in
            self._out.append(P.Switch(pool, P.GUEST_ROLE[pool], direction, "in", expected,
                                      self._role_version(P.GUEST_ROLE[pool])))

    def _role_version(self, role: str) -> int:
        """The actor version a role's workers run: rollouters the synced one, trainers the trainer's."""
        return self.rollout_version if role == P.ROLLOUT else self.trainer_version

    def _revoke(self, pool: str, why: str):
        """Preempt-and-yield (§3.2): auxiliaries stop taking work, return what is recoverable, then yield. ``why``
        is kept for the switch out when the window sent its guests no work (``Switch.no_work``)."""
        if not self.leases[pool].lent:
            return
        if not self.window_sent.get(pool, 0):
            self.no_work[pool] = why
        self.leases[pool].fire("revoke")
        if pool == P.TRAINER_POOL:
            self._interrupt_all(self._alive(self.topology.aux_rollouters))
        elif self.step is not None:
            for c in self.step.live(P.AUXILIARY):
                if c.status == "queued":
                    self._out.append(P.CancelChunk(P.AUX_TRAINER, c.chunk.chunk_id))
            self.step.release_plan()
        self._maybe_switch_out(pool)

    def _maybe_switch_out(self, pool: str):
        """Yield a revoked pool once nothing of the auxiliaries runs on it (lease: yield, ``Switch`` out)."""
        if not self.leases[pool].revoking:
            return
        if pool == P.TRAINER_POOL:
            aux = self._alive(self.topology.aux_rollouters)
            if any(self.buffer.running_count(w) for w in aux) or any(w in self.stopping for w in
                                                                  self.topology.aux_rollouters):
                return
            self.aux_assigned.clear()
        elif self.step is not None and self.step.live(P.AUXILIARY) and P.AUX_TRAINER not in self.failed:
            return
        self.leases[pool].fire("yield")
        home = P.HOME_ROLE[pool]
        direction = P.DIRECTION_OF_POOL[pool]
        self._out.append(P.Switch(pool, home, direction, "out", self.profiler.charged(direction, self._now).c_out,
                                  self._role_version(home), no_work=self.no_work.pop(pool, "")))

    def _yield_revoked(self):
        for pool in P.POOLS:
            self._maybe_switch_out(pool)
