"""The trainer's route replay (R3, :mod:`bidirl.rl.route_replay`): a mixin of
:class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine` giving its forward passes the rollout's routes.

With ``route_replay`` on, every forward of the log-prob stages and of a chunk's update (:meth:`Compute._token_logprobs`)
runs inside :meth:`Replay._replaying`, which hooks the model's MoE routers once per model object (the actor, the
frozen reference) and sets the batch's routes. :meth:`Replay.route_replay_counts` says what was replayed."""

from __future__ import annotations

import contextlib

from bidirl.rl.route_replay import RouteReplay


class Replay:
    """``route_replay`` (bool, set by the engine) and the per-model :class:`RouteReplay` hooks."""

    def _replaying(self, model, samples, width: int):
        """A block whose forwards of ``model`` replay ``samples``' routes (a no-op block when replay is off)."""
        replays = self.__dict__.setdefault("_route_replays", {})
        if not getattr(self, "route_replay", False):
            for _model, replay in replays.values():       # switched off: an earlier batch's backward is over
                replay.forget()
            return contextlib.nullcontext()
        held = replays.get(id(model))
        if held is None or held[0] is not model:
            held = replays[id(model)] = (model, RouteReplay(model, self.config))
        return held[1].batch(samples, width)

    def route_replay_counts(self) -> dict:
        """Batches, tokens and router decisions replayed so far, summed over this engine's models, and the
        decisions the trainer's own routers would have taken differently (``ReplayCounts.to_dict``)."""
        total = {"batches": 0, "tokens": 0, "decisions": 0, "differing": 0}
        for _model, replay in self.__dict__.get("_route_replays", {}).values():
            for k, v in replay.counts.to_dict().items():
                if k in total:
                    total[k] += v
        total["differing_fraction"] = total["differing"] / total["decisions"] if total["decisions"] else None
        return total


def fed_tokens(samples) -> int:
    """Tokens whose routes a replayed forward of ``samples`` uses: each sample's prompt and response but the last."""
    return sum(max(len(s.prompt_ids) + len(s.response_ids) - 1, 0) for s in samples)


def replay_detail(engine, samples, before: int, compare: bool, model: str) -> dict:
    """A log-prob call's replay record for its span: tokens replayed since ``before`` (the engine's replayed-token
    count when the call began) out of the fed tokens; with ``compare`` (the actor model, replay on), each sample's
    largest gap between the rollout's log-probs and the trainer's without the replay (the forward is run again with
    the replay off)."""
    if not engine.route_replay:
        return {}
    out = {"replayed_tokens": engine.route_replay_counts()["tokens"] - before, "fed_tokens": fed_tokens(samples)}
    if compare and model == "actor":        # every rank of a gang, an empty share too (it joins the gathers)
        import torch

        engine.route_replay = False
        try:
            plain = engine.logprobs(samples, model)
        finally:
            engine.route_replay = True
        out["gap_without_replay"] = [float((torch.tensor(s.logprobs, dtype=torch.float32) - lp).abs().max())
                                     if len(lp) else 0.0 for s, lp in zip(samples, plain)]
    return out
