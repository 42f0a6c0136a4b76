"""The trainer's FLOPs of a vision-language model: the decoder's parameters on every token, the ViT's on the
prompt's image patches only (bidirl.perf.flops, "Vision-language models")."""

from __future__ import annotations

import numpy as np
import pytest

from bidirl.job import config as cfgmod
from bidirl.job import presets
from bidirl.perf import TrainerModel
from bidirl.perf.flops import (CAUSAL_ATTENTION_FRACTION, VIT_SPATIAL_MERGE, check_image_tokens,
                               decoder_params_nonembedding, forward_flops, sample_forward_flops, stage_flops,
                               vit_forward_flops, vit_tokens_per_sample)
from bidirl.perf.predictor import StagePredictor

A6000 = presets.hardware("a6000")
P, R = [300, 412, 256], [800, 1200, 5]


def appendix_flops(model, p, r) -> float:
    """The appendix's F(b) with N_nonemb the whole model's count (vision encoder included): the old charge."""
    p, r = np.asarray(p, float), np.asarray(r, float)
    s = p + r
    return float((2.0 * model.params_active_nonembedding * s
                  + CAUSAL_ATTENTION_FRACTION * 4.0 * model.layers * model.hidden * s * s
                  + 2.0 * model.hidden * model.vocab * r).sum())


@pytest.mark.parametrize("name", ["qwen3-vl-2b", "qwen3-vl-4b"])
def test_vl_trainer_flops_move_by_exactly_the_vision_terms(name):
    m = presets.model(name)
    assert m.vision_params > 0
    tokens, n = sum(P) + sum(R), len(P)
    removed = 2.0 * m.vision_params * tokens                     # the ViT's parameters no longer on every token
    added = 2.0 * m.vision_params * VIT_SPATIAL_MERGE * 256 * n  # the ViT over 4 x 256 patches per sample
    old = appendix_flops(m, P, R)
    # float64 sums of ~1e13 terms: relative rounding ~1e-16 per operation, far below 1e-12
    assert forward_flops(m, P, R, 256) == pytest.approx(old - removed + added, rel=1e-12)
    assert forward_flops(m, P, R) == pytest.approx(old - removed, rel=1e-12)
    # the ViT's share in each stage carries the stage multiplier (3 for actor_update)
    assert stage_flops(m, "actor_update", P, R, 256) - stage_flops(m, "actor_update", P, R) == \
        pytest.approx(3 * added, rel=1e-9)
    assert vit_forward_flops(m, 256, n) == pytest.approx(added, rel=1e-15)
    assert decoder_params_nonembedding(m) == m.params_active_nonembedding - m.vision_params


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen2.5-3b", "qwen3-30b-a3b"])
def test_text_model_flops_do_not_move(name):
    m = presets.model(name)
    assert m.vision_params == 0
    assert forward_flops(m, P, R) == appendix_flops(m, P, R)
    assert forward_flops(m, P, R, 256) == forward_flops(m, P, R)     # no encoder: image tokens cost nothing extra


def test_each_sample_carries_its_own_image():
    m = presets.model("qwen3-vl-4b")
    per_sample = sample_forward_flops(m, P, R, 256) - sample_forward_flops(m, P, R, 0)
    assert np.allclose(per_sample, 2.0 * m.vision_params * 1024, rtol=1e-9)
    assert vit_tokens_per_sample(256) == 1024


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256", None])
def test_image_tokens_are_validated(bad):
    with pytest.raises(ValueError, match="image_tokens_per_prompt"):
        check_image_tokens(bad)
    with pytest.raises(ValueError, match="image_tokens_per_prompt"):
        TrainerModel(presets.model("qwen3-vl-4b"), A6000, image_tokens_per_prompt=bad)


def test_geo3k_preset_reaches_the_trainer_model():
    assert presets.workload("geo3k").image_tokens_per_prompt == 256
    assert presets.workload("gsm8k").image_tokens_per_prompt == 0
    cfg = cfgmod.load("a6000-default")
    assert cfg.workload_stats.name == "geo3k"
    predictor = StagePredictor.from_config(cfg, 1, 1)
    assert predictor.trainer.image_tokens_per_prompt == 256
    plain = TrainerModel(cfg.model_spec, A6000, params=predictor.trainer.params)
    assert predictor.trainer.microbatch_time("old_logprob", P, R) > plain.microbatch_time("old_logprob", P, R)


@pytest.fixture
def user_data(tmp_path, monkeypatch):
    import shutil
    root = tmp_path / "data"
    shutil.copytree(presets.data_dir(), root)
    monkeypatch.setenv("BIDIRL_DATA", str(root))
    return root


@pytest.mark.parametrize("edit, needle", [
    (("image_tokens_per_prompt: 256", "image_tokens_per_prompt: -4"), "whole number"),
    (("image_tokens_per_prompt: 256", "image_tokens_per_prompt: 12.5"), "whole number"),
    (("image_tokens_per_prompt: 256", "image_tokens_per_prompt: 2000"), "exceeds prompt_min"),
    (("multimodal: true", "multimodal: false"), "not multimodal"),
])
def test_bad_image_tokens_in_a_workload_preset(user_data, edit, needle):
    path = user_data / "presets" / "workloads" / "broken.yaml"
    text = (user_data / "presets" / "workloads" / "geo3k.yaml").read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(presets.PresetError) as info:
        presets.workload("broken")
    assert "image_tokens_per_prompt" in str(info.value) and needle in str(info.value) and info.value.fix
