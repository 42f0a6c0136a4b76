"""Scheduling policies: BiDiRL and the paper's ablation variants (§7.3), selectable by name."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

from bidirl.core.protocol import CORE_POLICIES


@dataclass(frozen=True)
class Policy:
    """Which borrowing directions are on, and how they decide.

    ``gated``: admit a window only when the stage-time models predict a gain over the switch costs
    (Eq. 3 for Rollouter-on-TrainerPool, Algorithm 2's T_borrow < T_no for Trainer-on-RolloutPool);
    otherwise borrow whenever the other pool is idle. ``model_split``: lazy pull plus the model-guided
    JointTailSplit; otherwise a one-shot split proportional to data-parallel capacity, made for each segment of the
    window's work when it opens. ``tail_reclaim``: TailWindow takes the chunks sent but not started back into the
    split (Table 2: queued chunks are recoverable); False keeps them where lazy pull sent them (only to show what
    the reclaim changes, e.g. in a Gantt).
    """
    name: str
    rollout_on_trainer_pool: bool
    trainer_on_rollout_pool: bool
    gated: bool = True
    model_split: bool = True
    tail_reclaim: bool = True
    # how a system forms batches and admits work — the control plane's own rules by default; the modelled
    # external systems (bidirl.sim.baselines) set theirs
    batch_rule: str = "lookahead"          # a key of bidirl.core.buffer.BATCH_RULES
    enforce_staleness: bool = True         # assert the staleness rule on every batch (check_batch)
    max_in_flight: Optional[int] = None    # groups generating (or parked) at once, beside the run-ahead bound
    drop_stale: bool = False               # at a sync, discard unfinished groups too old for any future batch


POLICIES = {
    "bidirl": Policy("bidirl", True, True),
    "no-borrow": Policy("no-borrow", False, False),
    "rot-only": Policy("rot-only", True, False),          # the paper's "w/o T-on-R"
    "tor-only": Policy("tor-only", False, True),          # the paper's "w/o R-on-T"
    "opportunistic": Policy("opportunistic", True, True, gated=False, model_split=False),
}
assert tuple(POLICIES) == CORE_POLICIES, "core/policies.py and protocol.CORE_POLICIES name the same policies"


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        close = difflib.get_close_matches(name, list(POLICIES), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(POLICIES)}"
        raise ValueError(f"unknown scheduling policy {name!r} — {hint}")
    return POLICIES[name]
