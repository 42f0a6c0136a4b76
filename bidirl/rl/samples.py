"""Rollout results as data: a group's payload and the response-level training samples built from it.

In GRPO-style RL (paper §2.1) the rollout unit is a prompt-level group and the training unit a
response-level sample. A rollout engine returns each group as a ``bidirl.core.protocol.GroupState``
whose ``payload`` is a :class:`GroupPayload`; :func:`samples_from_groups` flattens finished groups into
:class:`Sample` records in (group, response) order, the order the trainer's chunks keep (§6.3, Table 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class GroupPayload:
    """What a rollout engine knows about one group: prompt, and per response its tokens so far.

    ``logprobs[i][t]`` is the behaviour policy's log-probability of ``token_ids[i][t]`` as sampled;
    ``versions[i]`` the oldest actor version that generated any token of response ``i`` (the current
    version for a response with no tokens yet); ``finish_reasons[i]`` is ``"stop"`` (EOS), ``"length"``
    (hit ``max_tokens``) or ``None`` while unfinished. ``texts`` and ``rewards`` are filled when the engine
    was given a reward function (an unfinished response's reward is NaN until it completes); ``meta`` is
    the caller's per-group datum (e.g. the expected answer). ``routes`` (an engine recording a mixture-of-experts
    model's routes, R3): per response a ``(positions, MoE layers, k)`` int array of the experts each fed token was
    sent to — prompt and response tokens but the last (sampled, never fed); an unfinished response's known prefix.
    """
    prompt_ids: tuple
    token_ids: tuple
    logprobs: tuple
    versions: tuple
    finish_reasons: tuple
    max_tokens: int
    texts: Optional[tuple] = None
    rewards: Optional[tuple] = None
    meta: Any = None
    routes: Optional[tuple] = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Sample:
    """One response-level training sample. ``routes``: the rollout's expert routes of its prompt and response
    tokens (``GroupPayload.routes``), which the trainer replays (R3, :mod:`bidirl.rl.route_replay`); ``None`` for a
    dense model or an engine not recording them. Left out of equality (an array)."""
    group_id: int
    index: int
    prompt_ids: tuple
    response_ids: tuple
    logprobs: tuple
    reward: float
    version: int
    routes: Any = field(default=None, compare=False, repr=False)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)


def samples_from_groups(groups: Iterable) -> list:
    """Flatten complete ``GroupState``s (payload :class:`GroupPayload` with rewards) into samples."""
    out = []
    for g in groups:
        p = g.payload
        if not isinstance(p, GroupPayload):
            raise ValueError(f"group {g.group_id}: payload is {type(p).__name__}, expected GroupPayload "
                             "(groups produced by bidirl.cluster.engines.workers.rollout.RolloutEngine)")
        if not all(g.done):
            raise ValueError(f"group {g.group_id} is not complete (done={g.done}); resume it before training")
        if p.rewards is None:
            raise ValueError(f"group {g.group_id} has no rewards; give the rollout engine a reward_fn")
        for i, (ids, lps) in enumerate(zip(p.token_ids, p.logprobs)):
            out.append(Sample(int(g.group_id), i, tuple(p.prompt_ids), tuple(ids), tuple(lps),
                              float(p.rewards[i]), int(p.versions[i]),
                              routes=None if p.routes is None else p.routes[i]))
    return out
