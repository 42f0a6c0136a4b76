"""The sans-I/O control plane (``docs/architecture.md``): a state machine from driver events to commands.

It depends on the standard library and numpy only. ``protocol`` defines the messages and every shared name;
``Coordinator`` holds the event handlers; ``lease`` (pool ownership), ``gates`` (the scheduler's decisions),
``buffer``, ``staleness``, ``chunks`` and ``profiler`` are the pieces it is made of.
"""

from bidirl.core.coordinator import Coordinator, CoordinatorView, Settings, Topology
from bidirl.core.lease import Lease, LeaseError, PoolLease
from bidirl.core.policies import POLICIES, Policy, get_policy
from bidirl.core.staleness import StalenessRule, check_batch

__all__ = ["Coordinator", "CoordinatorView", "Settings", "Topology", "Lease", "LeaseError", "PoolLease",
           "POLICIES", "Policy", "get_policy", "StalenessRule", "check_batch"]
