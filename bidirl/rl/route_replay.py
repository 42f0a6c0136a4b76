"""The trainer's half of Rollout Routing Replay (R3; docs/architecture.md "MoE"): its MoE routers send each token
to the experts the rollout sent it to.

Trainer and inference engine compute the same router logits with different kernels, batch shapes and (on GPU)
precisions, so near-ties between experts break differently: on Qwen3-30B-A3B about 10 % of router decisions differ
and 94 % of tokens differ in at least one layer, which moves the trainer's log-probs away from the behaviour
policy's and breaks the importance ratios of the policy loss (§2.1); runs without replay collapse where runs with it
do not (Megatron-LM #4168). R3 records the rollout's routes (:mod:`bidirl.rl.routes`, carried by
``Sample.routes``) and replays them in the trainer's ``old_logprob`` and update forward passes:

* the expert *set* of each (token, MoE layer) is the rollout's;
* the mixing weights are the trainer's own router probabilities of those experts (softmax over all experts,
  gathered at the replayed ids, renormalised when the model renormalises its top-k), so the router still learns
  through them — the replay fixes which experts run, not how much each counts.

A :class:`RouteReplay` hooks every MoE router of one model once (``*.layers.<i>.mlp.gate`` returning
``(logits, weights, ids)``: transformers' Qwen2-MoE / Qwen3-MoE routers) and replays the routes of the batch set by
:meth:`RouteReplay.batch`. The batch stays set after the block for a backward pass that recomputes the forward
(activation checkpointing), which replays the same routes; any other forward after the block routes by itself, and
the next :meth:`~RouteReplay.batch` replaces the batch. A position without a route (the last response token, never
fed to the rollout's model; padding) keeps the trainer's own choice: the former's logits predict nothing the loss
uses, the latter is masked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from bidirl.rl.routes import ROUTER_SUFFIX, _layer_index, moe_route_shape


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (where activation checkpointing recomputes)."""
    import torch

    return torch._C._current_graph_task_id() != -1


class RouteReplayError(ValueError):
    """R3 asked for where it cannot run: a dense model, or samples without the rollout's routes."""


@dataclass
class ReplayCounts:
    """What a :class:`RouteReplay` did: batches and tokens replayed, and the router decisions (one per token and
    MoE layer) whose expert set the trainer's own router would have chosen differently."""
    batches: int = 0
    tokens: int = 0
    decisions: int = 0
    differing: int = 0

    def to_dict(self) -> dict:
        return {"batches": self.batches, "tokens": self.tokens, "decisions": self.decisions,
                "differing": self.differing,
                "differing_fraction": self.differing / self.decisions if self.decisions else None}


@dataclass
class _Batch:
    routes: object               # [B·T, layers, k] long tensor (rows of unknown positions: anything)
    known: object                # [B·T] bool tensor
    counted: set = field(default_factory=set)     # layers whose decisions this batch has counted (a recompute
                                                  # under activation checkpointing runs the router again)
    active: bool = True                           # inside RouteReplay.batch's block


class RouteReplay:
    """Replays the rollout's routes in ``model``'s MoE routers (module docstring)."""

    def __init__(self, model, config=None):
        config = config if config is not None else model.config
        try:
            self.layers_count, self.top_k = moe_route_shape(config)
        except ValueError as exc:
            raise RouteReplayError(f"route replay (R3): {exc}; turn rl.route_replay off for a dense model") from None
        self.experts = int(config.num_experts)
        routers = sorted(((_layer_index(n), m) for n, m in model.named_modules() if n.endswith(ROUTER_SUFFIX)),
                         key=lambda x: x[0])
        if len(routers) != self.layers_count:
            raise RouteReplayError(f"route replay (R3): {type(model).__name__} has {len(routers)} routers "
                                   f"('*.{ROUTER_SUFFIX}'), its config {self.layers_count} MoE layers")
        self.counts = ReplayCounts()
        self._batch: Optional[_Batch] = None
        self._handles = [module.register_forward_hook(self._hook(j, module)) for j, (_, module) in enumerate(routers)]

    def _hook(self, j: int, module):
        import torch

        renormalise = bool(getattr(module, "norm_topk_prob", True))

        def hook(_module, _args, output):
            batch = self._batch
            if batch is None or not (batch.active or _in_backward()):
                return None               # a forward outside a replayed block routes by itself
            logits, _weights, own = output
            if logits.shape[0] != batch.known.shape[0]:
                if not batch.active:      # a backward's recompute of another forward: not this batch's
                    return None
                raise RuntimeError(f"route replay (R3): the router of MoE layer {j} saw {logits.shape[0]} tokens, "
                                   f"the replayed batch has {batch.known.shape[0]}")
            replayed = batch.routes[:, j].to(own.device)
            known = batch.known.to(own.device)
            ids = torch.where(known[:, None], replayed, own)
            if j not in batch.counted:
                batch.counted.add(j)
                same = (torch.sort(own, dim=-1).values == torch.sort(replayed, dim=-1).values).all(dim=-1)
                self.counts.decisions += int(known.sum())
                self.counts.differing += int((known & ~same).sum())
            probs = torch.softmax(logits.float(), dim=-1)
            weights = probs.gather(-1, ids)
            if renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), ids
        return hook

    @contextlib.contextmanager
    def batch(self, samples: Sequence, width: int):
        """Replay the routes of ``samples`` (right-padded to ``width`` positions, as the trainer's batch) in the
        forwards run inside the block (and in a backward that recomputes them after it)."""
        batch = self._batch = self.batch_of(samples, width)
        self.counts.batches += 1
        self.counts.tokens += int(batch.known.sum())
        try:
            yield self
        finally:
            batch.active = False

    def batch_of(self, samples: Sequence, width: int) -> _Batch:
        """The ``[B·width, layers, k]`` routes and known-mask of ``samples`` (RouteReplayError naming a sample
        without routes or with routes of another shape or length)."""
        import torch

        routes = np.zeros((len(samples), width, self.layers_count, self.top_k), dtype=np.int64)
        known = np.zeros((len(samples), width), dtype=bool)
        for b, s in enumerate(samples):
            r = getattr(s, "routes", None)
            where = f"sample ({s.group_id}, {s.index})"
            if r is None:
                raise RouteReplayError(f"route replay (R3): {where} carries no routes; the rollout must record them "
                                       "(an engine run records them for an MoE model when rl.route_replay is on)")
            r = np.asarray(r)
            need = len(s.prompt_ids) + len(s.response_ids) - 1
            if r.shape != (need, self.layers_count, self.top_k):
                raise RouteReplayError(f"route replay (R3): {where} has routes of shape {r.shape}, expected "
                                       f"({need}, {self.layers_count}, {self.top_k}): one row per fed token (prompt "
                                       "and response but the last) per MoE layer")
            if r.size and (r.min() < 0 or r.max() >= self.experts):
                raise RouteReplayError(f"route replay (R3): {where} names experts outside [0, {self.experts})")
            routes[b, :need] = r
            known[b, :need] = True
        return _Batch(torch.as_tensor(routes.reshape(-1, self.layers_count, self.top_k)),
                      torch.as_tensor(known.reshape(-1)))

    def forget(self) -> None:
        """Drop the last batch (a backward after this recomputes with the trainer's own routes)."""
        self._batch = None

    def remove(self) -> None:
        """Detach the hooks (the routers choose for themselves again)."""
        for h in self._handles:
            h.remove()
        self._handles, self._batch = [], None
