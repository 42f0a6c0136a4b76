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
