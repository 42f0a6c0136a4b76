"""The sans-I/O control plane (DESIGN.md): a state machine from driver events to commands.

``Coordinator`` owns the rollout buffer and staleness rule, pool leases, the trainer's chunk queue, both
borrowing directions and the online profiler; ``protocol`` defines the events and commands.
"""

from bidirl.core.coordinator import Coordinator, Settings, Topology
from bidirl.core.policies import POLICIES, Policy, get_policy
from bidirl.core.staleness import StalenessRule, check_batch

__all__ = ["Coordinator", "Settings", "Topology", "POLICIES", "Policy", "get_policy", "StalenessRule",
           "check_batch"]
