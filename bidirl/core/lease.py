"""Who owns a pool: the lease state machine of hot switching (paper §3.2, preempt-and-yield).

Each pool is owned by its primary workers by default. Borrowing lends it to the other role's auxiliary
workers for a while; revoking the lease makes the auxiliaries stop taking work, return what is recoverable and
yield the pool back. A pool therefore never hosts both roles at once.

::

    PRIMARY --lend--> SWITCHING_IN --switched--> LENT --revoke--> REVOKING --yield--> SWITCHING_OUT
       ^                                                                                   |
       +-------------------------------------- switched -----------------------------------+

* ``lend``: the scheduler admitted a window and sent ``Switch(phase="in")`` (C_in runs);
* ``switched``: the driver's ``SwitchFinished`` arrived;
* ``revoke``: the batch is ready, the auxiliaries finished their share, or an auxiliary failed;
* ``yield``: nothing of the auxiliaries is still running, ``Switch(phase="out")`` is sent (C_out runs).

Any other (state, event) pair is a scheduler bug and raises :class:`LeaseError` naming both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Lease(enum.Enum):
    PRIMARY = "primary"                # the pool's own role works on it
    SWITCHING_IN = "switching_in"      # handing it to the auxiliary role (C_in)
    LENT = "lent"                      # auxiliary workers take work on it
    REVOKING = "revoking"              # auxiliaries finish what runs and return the rest
    SWITCHING_OUT = "switching_out"    # handing it back (C_out)


TRANSITIONS: dict = {
    (Lease.PRIMARY, "lend"): Lease.SWITCHING_IN,
    (Lease.SWITCHING_IN, "switched"): Lease.LENT,
    (Lease.LENT, "revoke"): Lease.REVOKING,
    (Lease.REVOKING, "yield"): Lease.SWITCHING_OUT,
    (Lease.SWITCHING_OUT, "switched"): Lease.PRIMARY,
}


class LeaseError(RuntimeError):
    """An event that the pool's lease state does not allow (a scheduler bug)."""


@dataclass
class PoolLease:
    pool: str
    state: Lease = Lease.PRIMARY

    def fire(self, event: str) -> Lease:
        """Apply ``event``; returns the new state or raises :class:`LeaseError`."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            allowed = sorted(e for s, e in TRANSITIONS if s is self.state)
            raise LeaseError(f"pool {self.pool}: '{event}' is not allowed while the lease is "
                             f"{self.state.value} (allowed: {', '.join(allowed)})")
        self.state = new
        return new

    @property
    def primary(self) -> bool:
        """The pool's own workers hold it."""
        return self.state is Lease.PRIMARY

    @property
    def lent(self) -> bool:
        """Auxiliary workers hold it and may take new work."""
        return self.state is Lease.LENT

    @property
    def revoking(self) -> bool:
        return self.state is Lease.REVOKING

    @property
    def switching(self) -> bool:
        return self.state in (Lease.SWITCHING_IN, Lease.SWITCHING_OUT)
