"""Model folders the engines load, weight names on the way to vLLM, and how a chunk is dealt to a gang's ranks.

Fast unit tests (no process groups, no vLLM engine); the vLLM architecture check imports vLLM and is marked
``integration``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from bidirl.cluster.engines.workers.trainer import TrainerEngine, rank_shares, resolve_precision
from bidirl.rl import model_folder as checkpoint
from bidirl.rl import tiny_model


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny_model.create(tmp_path_factory.mktemp("qwen") / "m", seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_model.create(tmp_path_factory.mktemp("llama") / "m", seed=0, cfg=tiny_model.TINY_LLAMA)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# --------------------------------------------------------------------------------------------------
# model folders
# --------------------------------------------------------------------------------------------------

def test_a_folder_without_config_or_weights_is_refused_with_the_fix(tmp_path, qwen_dir):
    with pytest.raises(checkpoint.ModelFolderError, match="is not a folder"):
        checkpoint.model_folder(tmp_path / "nowhere")
    with pytest.raises(checkpoint.ModelFolderError, match=r"holds no config.json; pass a transformers checkpoint"):
        TrainerEngine(tmp_path)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(qwen_dir / "config.json", weightless / "config.json")
    with pytest.raises(checkpoint.ModelFolderError, match=r"holds no weights .*save_pretrained"):
        TrainerEngine(weightless)


def test_architectures_transformers_cannot_load_as_a_causal_lm_are_named(tmp_path, qwen_dir):
    unknown = _copy_with_config(qwen_dir, tmp_path / "unknown", model_type="no-such-model")
    with pytest.raises(checkpoint.ModelFolderError, match=r"transformers cannot read its config.json \(model_type "
                                                          r"'no-such-model'\)"):
        TrainerEngine(unknown)
    encoder_decoder = tmp_path / "t5"
    encoder_decoder.mkdir()
    (encoder_decoder / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    shutil.copy(qwen_dir / "model.safetensors", encoder_decoder / "model.safetensors")
    with pytest.raises(checkpoint.ModelFolderError, match=r"model_type 't5' .*has no causal-LM class"):
        checkpoint.causal_lm_config(encoder_decoder)


def test_both_built_in_architectures_load_with_their_own_head(qwen_dir, llama_dir):
    for folder, arch, tied in ((qwen_dir, "Qwen2ForCausalLM", True), (llama_dir, "LlamaForCausalLM", False)):
        config = checkpoint.causal_lm_config(folder)
        assert config.architectures == [arch] and checkpoint.tied_embeddings(config) is tied
        model = checkpoint.load_causal_lm(folder, torch.float32)
        assert len(checkpoint.transformer_blocks(model)) == tiny_model.TinyConfig().num_hidden_layers
        cfg = tiny_model.config_for("llama" if arch.startswith("Llama") else "qwen2")
        assert sum(p.numel() for p in model.parameters()) == tiny_model.parameter_counts(cfg)["params_total"]
        shapes = checkpoint.checkpoint_shapes(folder)
        assert ("lm_head.weight" in shapes) is not tied               # a tied head is stored once
        assert ("model.layers.0.self_attn.q_proj.bias" in shapes) is tied   # Qwen2 has q/k/v biases, Llama none
    assert tiny_model.parameter_counts(tiny_model.TINY_LLAMA)["params_total"] != \
        tiny_model.parameter_counts()["params_total"]
    with pytest.raises(ValueError, match="architecture"):
        tiny_model.TinyConfig(architecture="gpt2")


def test_tokenizers_of_the_tiny_model_and_of_any_checkpoint(tmp_path, qwen_dir):
    tiny = checkpoint.load_tokenizer(qwen_dir)
    plain = tmp_path / "plain"                     # the same tokenizer files without the tiny model's marker
    plain.mkdir()
    tiny_model.build_tokenizer().save_pretrained(plain)
    auto = checkpoint.load_tokenizer(plain)         # AutoTokenizer
    assert auto("12+7=")["input_ids"] == tiny("12+7=")["input_ids"]
    with pytest.raises(checkpoint.ModelFolderError, match="no tokenizer transformers can load"):
        checkpoint.load_tokenizer(tmp_path)


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_an_architecture_vllm_does_not_implement_is_named(tmp_path, qwen_dir):
    assert checkpoint.check_vllm_architecture(qwen_dir) == "Qwen2ForCausalLM"
    foreign = _copy_with_config(qwen_dir, tmp_path / "foreign", architectures=["NoSuchForCausalLM"])
    from bidirl.cluster.engines.workers.rollout import RolloutEngine
    with pytest.raises(checkpoint.ModelFolderError, match=r"vLLM implements none of the architectures "
                                                          r"\['NoSuchForCausalLM'\]"):
        RolloutEngine(foreign)


# --------------------------------------------------------------------------------------------------
# weight names
# --------------------------------------------------------------------------------------------------

def test_wrapper_prefixes_are_removed_and_the_tied_head_added():
    emb, norm = torch.zeros(4, 2), torch.ones(2)
    state = {"module._orig_mod.model.embed_tokens.weight": emb,
             "model._fsdp_wrapped_module.norm._checkpoint_wrapped_module.weight": norm}
    out = checkpoint.hf_weights(state, tied=True)
    assert out == {"model.embed_tokens.weight": emb, "model.norm.weight": norm, "lm_head.weight": emb}
    assert "lm_head.weight" not in checkpoint.hf_weights(state, tied=False)
    with pytest.raises(ValueError, match="both map to checkpoint name 'model.norm.weight'"):
        checkpoint.hf_weights([("model.norm.weight", norm), ("module.model.norm.weight", torch.ones(2))], tied=False)


def test_weights_are_checked_against_the_checkpoint(qwen_dir, llama_dir):
    state = TrainerEngine(qwen_dir).state_dict()
    shapes = checkpoint.checkpoint_shapes(qwen_dir)
    checkpoint.check_weights(state, shapes, tied=True, where="sync")
    checkpoint.check_weights({k: v for k, v in state.items() if k != "lm_head.weight"}, shapes, tied=True,
                             where="sync")
    with pytest.raises(ValueError, match=r"sync: the weights do not match the checkpoint: unexpected names "
                                         r"\['lm_head.weight'\]"):
        checkpoint.check_weights(state, shapes, tied=False, where="sync")
    llama = TrainerEngine(llama_dir).state_dict()
    with pytest.raises(ValueError, match=r"missing names \['model.layers.0.self_attn.k_proj.bias', .*\.\.\..*; "
                                         r"pass the state_dict\(\) of a trainer of this model"):
        checkpoint.check_weights(llama, shapes, tied=True, where="sync")
    older = dict(shapes, **{"model.layers.0.self_attn.rotary_emb.inv_freq": (16,)})   # not a weight
    checkpoint.check_weights(state, older, tied=True, where="sync")


# --------------------------------------------------------------------------------------------------
# trainer settings and dealing a chunk to a gang
# --------------------------------------------------------------------------------------------------

def test_precision_and_device_settings(qwen_dir):
    assert resolve_precision("auto", "cpu") == "fp32" and resolve_precision("auto", "cuda") == "bf16-mixed"
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="device"):
        TrainerEngine(qwen_dir, device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            TrainerEngine(qwen_dir, device="cuda")
    engine = TrainerEngine(qwen_dir)
    assert engine.precision == "fp32" and not engine.sharded and engine.local_numel == engine.numel


def test_rank_shares_deal_per_device_runs():
    assert rank_shares(list(range(7)), 2, 4) == [[0, 1], [2, 3], [4, 5], [6]]
    assert rank_shares([5], 1, 4) == [[5], [], [], []]
    with pytest.raises(ValueError, match="do not fit"):
        rank_shares(list(range(9)), 2, 4)
    with pytest.raises(ValueError, match="per_device"):
        rank_shares([1], 0, 2)
