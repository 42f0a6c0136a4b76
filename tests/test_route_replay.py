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


def tokens_on_rollout_experts(engine, samples, replay: bool) -> tuple:
    """One ``engine.logprobs(samples)`` with R3 on or off: per fed token, whether the trainer chose the rollout's
    experts (``Sample.routes``) in every MoE layer, and the log-probs."""
    engine.route_replay = replay
    seen = ExpertsSeen(engine.model)
    try:
        lps = engine.logprobs(samples)
    finally:
        seen.remove()
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    chosen = seen.routes(len(samples) * width).reshape(len(samples), width, CFG.num_hidden_layers, -1)
    return [np.array_equal(chosen[b, t], s.routes[t]) for b, s in enumerate(samples)
            for t in range(len(s.routes))], lps


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
    for replay in (False, True):
        same, _ = tokens_on_rollout_experts(engine, samples, replay)
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


# ---------------------------------------------------------------------------------------------------------------
# the pieces routes travel through: kept prefix blocks, samples, the config switch, the run's count
# ---------------------------------------------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 5), min_size=1, max_size=40),
       st.lists(st.integers(0, 5), min_size=0, max_size=40), st.integers(0, 40))
def test_kept_prefix_blocks_fill_exactly_the_positions_of_full_shared_blocks(block, a, b, upto):
    """A sequence ``b`` that shares a prefix with a stored ``a`` gets rows for exactly the positions of the full
    blocks it shares whole (the prefix cache's own reuse rule), each row ``a``'s row at that position."""
    from bidirl.rl.routes import PrefixRoutes

    kept = PrefixRoutes(block=block)
    rows_a = {p: np.full((2, 2), p, dtype=ROUTE_DTYPE) for p in range(len(a))}
    kept.store(a, rows_a)
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    whole = (min(shared, len(a)) // block) * block         # full blocks both sequences share
    rows_b: dict = {}
    kept.fill(b, rows_b, upto=upto)
    want = set(range(min(whole, upto, len(b))))
    assert set(rows_b) == want
    for p in want:
        np.testing.assert_array_equal(rows_b[p], rows_a[p])


def test_sequence_routes_names_missing_positions():
    from bidirl.rl.routes import sequence_routes

    rows = {0: np.zeros((2, 2)), 2: np.zeros((2, 2))}
    with pytest.raises(RuntimeError, match=r"engine X: no route recorded for positions \[1, 3\]"):
        sequence_routes(rows, 4, "engine X")
    assert sequence_routes({0: np.ones((2, 2))}, 1, "x").shape == (1, 2, 2)


def test_samples_carry_their_groups_routes():
    from bidirl.core.protocol import GroupState
    from bidirl.rl.samples import GroupPayload, samples_from_groups

    r0, r1 = np.zeros((3, 2, 2), ROUTE_DTYPE), np.ones((4, 2, 2), ROUTE_DTYPE)
    payload = GroupPayload(prompt_ids=(4, 5), token_ids=((6, 7), (6, 7, 8)), logprobs=((0.0, 0.0), (0.0,) * 3),
                           versions=(0, 0), finish_reasons=("stop", "stop"), max_tokens=4, rewards=(1.0, 0.0),
                           routes=(r0, r1))
    state = GroupState(group_id=3, prompt_len=2, generated=(2, 3), done=(True, True), version=0, payload=payload)
    a, b = samples_from_groups([state])
    assert a.routes is r0 and b.routes is r1
    assert a == Sample(3, 0, (4, 5), (6, 7), (0.0, 0.0), 1.0, 0)        # routes are left out of equality


def test_the_config_switch_is_on_for_moe_and_refused_for_dense_models():
    from bidirl.errors import ConfigError
    from bidirl.job import config as cfgmod

    assert cfgmod.JobConfig(model="tiny-moe", hardware="cpu").route_replay
    assert not cfgmod.JobConfig(model="tiny-moe", hardware="cpu", rl=cfgmod.RLConfig(route_replay=False)).route_replay
    assert not cfgmod.JobConfig(model="tiny", hardware="cpu").route_replay
    with pytest.raises(ConfigError, match=r"rl\.route_replay: .*'tiny' is dense"):
        cfgmod.JobConfig(model="tiny", hardware="cpu", rl=cfgmod.RLConfig(route_replay=True))
    with pytest.raises(ConfigError, match=r"rl\.route_replay_compare"):
        cfgmod.JobConfig(model="tiny-moe", hardware="cpu",
                         rl=cfgmod.RLConfig(route_replay=False, route_replay_compare=True))
    shipped = cfgmod.load("tiny-moe-cpu")
    assert shipped.model_spec.is_moe and shipped.route_replay and shipped.rl.route_replay_compare


def test_the_runs_tally_counts_a_chunk_replayed_only_when_every_fed_token_was():
    from bidirl.cluster.engines.route_tally import RouteTally

    tally = RouteTally(on=True)
    tally.chunk("old_logprob", 10, 10)
    tally.chunk("actor_update", 9, 10)          # a token short: not replayed
    tally.chunk("actor_update", 10, 10)
    s = tally.summary()
    assert (s["chunks"], s["replayed_chunks"], s["every_chunk_replayed"], s["tokens"]) == (3, 2, False, 29)
    again = RouteTally(on=True)
    again.restore(tally.state())
    assert again.summary() == s
    off = RouteTally(on=False)
    off.chunk("old_logprob", 0, 10)
    assert off.summary()["replayed_chunks"] == 0 and not off.summary()["every_chunk_replayed"]


def test_moe_weights_leave_the_trainer_per_expert_and_come_back_fused(moe_dir):
    """The trainer's state dict names an MoE model's experts as its checkpoint does (one entry per expert, the fused
    tensors split), which the rollouters load; another trainer loads it back into its fused tensors bit for bit."""
    from bidirl.rl import model_folder as mf

    a, b = TrainerEngine(str(moe_dir)), TrainerEngine(str(moe_dir))
    state = a.state_dict()
    stored = mf.checkpoint_shapes(moe_dir)
    assert {k for k in state if k != "lm_head.weight"} == set(stored)          # the tied head is added as sent
    assert all(tuple(state[k].shape) == tuple(stored[k]) for k in stored)
    with torch.no_grad():
        for p in b.model.parameters():
            p.add_(1.0)
    b.load_state_dict(state)
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    del state[next(k for k in state if ".experts.3.up_proj" in k)]
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight' is missing"):
        b.load_state_dict(state)


def test_moe_engine_runs_refuse_the_collective_weight_transport_by_name():
    from bidirl.errors import ConfigError
    from bidirl.job import config as cfgmod

    cfg = cfgmod.load("tiny-moe-cpu")
    cfgmod.check_engine_run(cfg)
    with pytest.raises(ConfigError, match=r"transport\.weights: .*fused expert tensors"):
        cfgmod.check_engine_run(cfg.with_overrides({"transport.weights": "collective"}))
