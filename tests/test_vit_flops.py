"""The trainer's and the rollout prefill's FLOPs of a vision-language model: the decoder's parameters on every
token, the ViT's on the prompt's image patches only (bidirl.perf.flops, "Vision-language models")."""

from __future__ import annotations

import numpy as np
import pytest

from bidirl.job import config as cfgmod
from bidirl.job import presets
from bidirl.perf import TrainerModel
from bidirl.perf.flops import (CAUSAL_ATTENTION_FRACTION, VIT_SPATIAL_MERGE, check_image_tokens,
                               decoder_params_nonembedding, forward_flops, prefill_flops, sample_forward_flops,
                               stage_flops, vit_forward_flops, vit_tokens_per_sample)
from bidirl.perf.predictor import StagePredictor
from bidirl.perf.rollout import RolloutModel

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


# ------------------------------------------------------------------------------------------------
# the rollout's prefill: the decoder on every prompt token, the encoder once per request (flops.prefill_flops)
# ------------------------------------------------------------------------------------------------

def appendix_prefill_flops(model, p) -> float:
    """The appendix's F_pre with N the whole model's count (vision encoder included): the old charge."""
    p = np.asarray(p, float)
    return float(2.0 * model.params_active_nonembedding * p.sum()
                 + CAUSAL_ATTENTION_FRACTION * 4.0 * model.layers * model.hidden * (p * p).sum()
                 + 2.0 * model.hidden * model.vocab * p.size)


@pytest.mark.parametrize("name", ["qwen3-vl-2b", "qwen3-vl-4b"])
def test_a_text_prompt_pays_no_encoder_in_prefill_and_an_image_prompt_pays_exactly_its_patches(name):
    m = presets.model(name)
    n = len(P)
    decoder_only = appendix_prefill_flops(m, P) - 2.0 * m.vision_params * sum(P)
    # float64 sums of ~1e12-1e13 terms: relative rounding ~1e-16 per operation, far below 1e-12
    assert prefill_flops(m, P) == pytest.approx(decoder_only, rel=1e-12)
    # the old charge, the ViT's parameters on every prompt token, is 2·N_vision·ΣP ≈ 8e11 FLOPs above it (10 % of
    # the old prefill of these prompts on the 4B, 22 % on the 2B): far outside the 1e-3 margin
    assert prefill_flops(m, P) < appendix_prefill_flops(m, P) * (1 - 1e-3)
    with_images = decoder_only + 2.0 * m.vision_params * VIT_SPATIAL_MERGE * 256 * n
    assert prefill_flops(m, P, 256) == pytest.approx(with_images, rel=1e-12)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen2.5-3b", "qwen3-30b-a3b"])
def test_text_model_prefill_does_not_move(name):
    m = presets.model(name)
    assert prefill_flops(m, P) == appendix_prefill_flops(m, P)
    assert prefill_flops(m, P, 256) == prefill_flops(m, P)


def test_the_rollout_model_and_the_engine_charge_the_encoder_per_request_in_prefill_and_never_in_decode():
    cfg = cfgmod.load("a6000-default")
    predictor = StagePredictor.from_config(cfg, 1, 1)
    rollout = predictor.rollout
    assert rollout.image_tokens_per_prompt == 256
    m, q = rollout.model, rollout.params
    text = RolloutModel(m, rollout.hardware, params=q, max_seqs=rollout.max_seqs)
    # one request set, whole: the features' F_pre is prefill_flops of the same prompts (the same float64 terms
    # summed in another order: relative rounding ~1e-16 per operation, far below 1e-12)
    feat = rollout.replica_features(P, R)
    assert feat.f_pre[0] == pytest.approx(prefill_flops(m, P, 256), rel=1e-12)
    assert text.replica_features(P, R).f_pre[0] == pytest.approx(prefill_flops(m, P), rel=1e-12)
    # prefill moves by α_pre times the encoder's FLOPs of the three requests; decode does not move at all (the
    # same parameters and features: exact). The prefill times are ~0.2 s and differ by ~0.05 s; float64 rounding
    # of ~0.2 s sums is ~1e-17 s, so their difference matches to ~1e-15 relative: 1e-9 leaves room for the
    # overlap's arithmetic, and a missing or doubled encoder term (100 % off) still fails
    encoder = vit_forward_flops(m, 256, len(P))
    assert rollout.prefill_time(P) - text.prefill_time(P) == pytest.approx(q.alpha_pre * encoder, rel=1e-9)
    assert rollout.decode_time(P, R) == text.decode_time(P, R)
    # the planner's vectorised path agrees with the per-replica one (groups of 1 over 2 replicas): the same
    # whole-number feature sums (exact below 2**53) and float64 products, ~1e-16 relative apart
    assert rollout.stage_times(P, R, [2])[0] == pytest.approx(rollout.stage_time(P, R, 2), rel=1e-12)
    # the continuous-batching engine's prefill waves use the same count
    assert predictor.engine_costs().prefill_flops(np.asarray(P)) == pytest.approx(prefill_flops(m, P, 256),
                                                                                   rel=1e-12)


def test_trainer_and_rollout_take_a_samples_encoder_flops_from_one_function(monkeypatch):
    """A forward-only trainer stage and a prefill add the same encoder FLOPs per sample, and both come from
    flops.vit_forward_flops: replacing it moves both sides (they cannot drift apart)."""
    import bidirl.perf.flops as flops
    m = presets.model("qwen3-vl-4b")
    trainer_encoder = stage_flops(m, "old_logprob", P, R, 256) - stage_flops(m, "old_logprob", P, R)
    rollout_encoder = prefill_flops(m, P, 256) - prefill_flops(m, P)
    # differences of ~1e13 sums: absolute rounding ~1e13·1e-16 = 1e-3 FLOPs per term, relative to ~2.6e12: 1e-9
    assert trainer_encoder == pytest.approx(rollout_encoder, rel=1e-9)
    assert rollout_encoder == pytest.approx(vit_forward_flops(m, 256, len(P)), rel=1e-9)
    # a stand-in: 1e12 FLOPs per sample whose prompt holds 256 image tokens, 0 for a text prompt
    monkeypatch.setattr(flops, "vit_forward_flops", lambda model, n, samples=1: 1.0e12 * (n / 256) * samples)
    rollout = RolloutModel(m, A6000, image_tokens_per_prompt=256)
    text_rollout = RolloutModel(m, A6000)
    assert rollout.replica_features(P, R).f_pre[0] - text_rollout.replica_features(P, R).f_pre[0] == \
        pytest.approx(3.0e12, rel=1e-9)
    assert forward_flops(m, P, R, 256) - forward_flops(m, P, R) == pytest.approx(3.0e12, rel=1e-9)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256", None])
def test_rollout_image_tokens_are_validated(bad):
    with pytest.raises(ValueError, match="image_tokens_per_prompt"):
        RolloutModel(presets.model("qwen3-vl-4b"), A6000, image_tokens_per_prompt=bad)
