"""Rollout Routing Replay in the trainer (bidirl.rl.route_replay; docs/architecture.md "MoE").

The "rollout" here is the tiny MoE model's own forward (its routes recorded at the router, bidirl.rl.routes); the
vLLM side is in tests/test_routes.py (integration). Tolerance: a replayed forward of the model's own routes sends
every token to the same experts with the same weights, but lists each token's experts in another order (sorted ids,
not by probability), so an expert's batch of rows is gathered in another order and its matmuls may round otherwise:
the two log-probs differ in rounding only, ≤ tests/rounding.py's bound for two such computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bidirl.cluster.engines.workers.trainer import TrainerEngine
from bidirl.rl import tiny_model
from bidirl.rl.route_replay import RouteReplay, RouteReplayError
from bidirl.rl.routes import ROUTE_DTYPE, routes_of
from bidirl.rl.samples import Sample

CFG = tiny_model.TinyMoeConfig()
PROMPTS = [(4, 5, 6, 7, 8), (9, 10, 11)]
RESPONSES = [(12, 13, 14, 15, 16, 17), (18, 19, 20, 21)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_model.create_moe(tmp_path_factory.mktemp("tiny-moe"), seed=0)


def _samples(model, prompts=PROMPTS, responses=RESPONSES):
    """Samples whose routes are ``model``'s own, over the tokens a rollout feeds (all but the last)."""
    out = []
    for g, (p, r) in enumerate(zip(prompts, responses)):
        routes = routes_of(model, list(p) + list(r)[:-1], CFG.num_experts_per_tok).astype(ROUTE_DTYPE)
        out.append(Sample(g, 0, p, r, tuple([0.0] * len(r)), 0.0, 0, routes=routes))
    return out


def _perturb_routers(model, scale: float = 3.0, seed: int = 1) -> None:
    """Add noise of ``scale`` times the routers' own weight spread to every router (a trainer whose routers have
    drifted from the rollout's)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                w = module.weight
                w.add_(torch.randn(w.shape, generator=gen) * scale * float(w.std()))


class ExpertsSeen:
    """The expert ids each MoE layer's experts module was handed, per forward (the trainer's chosen experts)."""

    def __init__(self, model):
        self.seen: dict = {}
        self.handles = []
        for name, module in model.named_modules():
            if name.endswith("mlp.experts"):
                layer = int(name.split(".")[name.split(".").index("layers") + 1])
                self.handles.append(module.register_forward_pre_hook(
                    lambda _m, args, layer=layer: self.seen.setdefault(layer, []).append(args[1].detach().clone())))

    def routes(self, rows: int) -> np.ndarray:
        """The first forward's ``(rows, layers, k)`` sorted expert ids."""
        per_layer = [np.sort(self.seen[layer][0].numpy()[:rows], axis=-1) for layer in sorted(self.seen)]
        return np.stack(per_layer, axis=1)

    def remove(self):
        for h in self.handles:
            h.remove()


def test_replaying_the_models_own_routes_changes_nothing(moe_dir):
    import rounding

    engine = TrainerEngine(str(moe_dir), route_replay=True)
    tol = rounding.run_logprob_tolerance(moe_dir, engine.state_dict(), lr=0.0, steps=0)
    samples = _samples(engine.model)
    with_r3 = engine.logprobs(samples)
    engine.route_replay = False
    without = engine.logprobs(samples)
    for a, b in zip(with_r3, without):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    counts = engine.route_replay_counts()
    fed = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    assert counts["batches"] == 1 and counts["tokens"] == fed
    assert counts["decisions"] == fed * CFG.num_hidden_layers and counts["differing"] == 0


def test_with_a_perturbed_trainer_router_the_replayed_experts_are_the_rollouts_token_by_token(moe_dir):
    engine = TrainerEngine(str(moe_dir), route_replay=True)
    samples = _samples(engine.model)                     # the rollout's routes: the unperturbed routers'
    _perturb_routers(engine.model)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for replay in (False, True):
        engine.route_replay = replay
        seen = ExpertsSeen(engine.model)
        try:
            engine.logprobs(samples)
        finally:
            seen.remove()
        chosen = seen.routes(len(samples) * width).reshape(len(samples), width, CFG.num_hidden_layers, -1)
        same = [np.array_equal(chosen[b, t], s.routes[t]) for b, s in enumerate(samples)
                for t in range(len(s.routes))]
        if replay:
            assert all(same)                              # every fed token, every layer: the rollout's experts
        else:
            assert not all(same)                          # the perturbation does move routes (the check can fail)
    # the replayed forward counted the decisions its own routers would have taken otherwise; at the first MoE layer
    # both forwards see the same inputs, so those differ exactly where the two models' own layer-0 routes do (later
    # layers' inputs follow the replayed experts, so they are counted but not recomputable independently)
    counts = engine.route_replay_counts()
    own = _samples(engine.model)
    first_layer = sum(int(not np.array_equal(s.routes[t, 0], o.routes[t, 0]))
                      for s, o in zip(samples, own) for t in range(len(s.routes)))
    assert 0 < first_layer <= counts["differing"] <= counts["decisions"]


def test_replay_holds_through_the_update_pass_and_its_gradient(moe_dir):
    """The update pass (chunk_gradients) replays too: with routes from the unperturbed routers, the perturbed
    trainer's loss gradient flows through the replayed experts only — an expert no token was replayed to gets none."""
    engine = TrainerEngine(str(moe_dir), route_replay=True)
    samples = _samples(engine.model)
    _perturb_routers(engine.model)
    old = engine.logprobs(samples)
    g = engine.chunk_gradients(samples, torch.tensor([1.0, -1.0]), old, accumulate=True, chunk_id=0)
    assert g.samples == 2
    # every fed position reaches a response token's log-prob through a later layer's attention, except at the last
    # layer, whose output at a position feeds that position's logits only: there just the positions P − 1 … (whose
    # logits predict response tokens) count
    last = CFG.num_hidden_layers - 1
    used = {(layer, int(e)) for s in samples for t in range(len(s.routes))
            for layer in range(CFG.num_hidden_layers) for e in s.routes[t, layer]
            if layer < last or t >= len(s.prompt_ids) - 1}
    names = [n for n, _ in engine.model.named_parameters()]
    for name, p in zip(names, engine.params):
        if name.endswith("mlp.experts.down_proj"):
            layer = int(name.split(".")[2])
            for e in range(CFG.num_experts):
                moved = bool(p.grad[e].abs().sum() > 0)
                assert moved == ((layer, e) in used), (name, e)


def test_replay_errors_name_the_cause(moe_dir, tmp_path):
    dense = tiny_model.create(tmp_path / "dense", seed=0)
    with pytest.raises(RouteReplayError, match="route_replay.*MoE|not a mixture-of-experts"):
        TrainerEngine(str(dense), route_replay=True)
    engine = TrainerEngine(str(moe_dir), route_replay=True)
    s = _samples(engine.model)[0]
    bare = Sample(s.group_id, s.index, s.prompt_ids, s.response_ids, s.logprobs, 0.0, 0)
    with pytest.raises(RouteReplayError, match=r"sample \(0, 0\) carries no routes"):
        engine.logprobs([bare])
    short = Sample(s.group_id, s.index, s.prompt_ids, s.response_ids, s.logprobs, 0.0, 0, routes=s.routes[:-1])
    with pytest.raises(RouteReplayError, match="expected"):
        engine.logprobs([short])
    wrong = Sample(s.group_id, s.index, s.prompt_ids, s.response_ids, s.logprobs, 0.0, 0, routes=s.routes + 100)
    with pytest.raises(RouteReplayError, match="outside"):
        engine.logprobs([wrong])
    with pytest.raises(RouteReplayError, match="dense model"):
        RouteReplay(tiny_model.transformers_model(tiny_model.TinyConfig()))
