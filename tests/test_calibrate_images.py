"""``bidirl calibrate`` from a vision-language model's records: the profile's optional ``image_tokens_per_prompt``
(meta.json) says how many LLM image tokens every measured prompt held, and every model the calibration builds
charges the vision encoder for them (:func:`bidirl.perf.flops.vit_forward_flops`: once per request in the
rollout's prefill, once per sample in each trainer stage). Absent means text-only; a vision-language model's
records without it are refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from bidirl.calibrate.from_records import calibrate_profile, image_tokens_of, predict_points
from bidirl.calibrate.records import (IMAGE_TOKENS, META_FILE, ROLLOUT_FIELDS, TRAINER_FIELDS, Profile, ProfileError,
                                      load_profile, save_profile, with_lengths)
from bidirl.job import presets
from bidirl.perf.flops import STAGE_MULTIPLIER, vit_forward_flops
from bidirl.perf.fit import knob_hardware

SHIPPED = presets.data_dir() / "profiles" / "cpu-tiny"
VL = presets.model("qwen3-vl-2b")
IMAGES = 256                 # geo3k's LLM image tokens per prompt (the workload preset's)
#: the truth the synthetic records are made from: the a6000 preset with other knobs than its own
TRUTH_KNOBS = {"train_mfu": 0.31, "prefill_mfu": 0.27, "decode_mbu": 0.52, "kernel_overhead_per_layer": 3e-4,
               "scheduler_overhead": 2e-3, "decode_token_overhead": 1e-5}


def _vl_profile(images, truth_images=IMAGES, hardware="a6000") -> Profile:
    """The shipped grid's shapes with IMAGES more prompt tokens (the image's), as measured on qwen3-vl-2b: each
    record's time is what the knob-derived models of ``TRUTH_KNOBS`` give with ``truth_images`` image tokens per
    prompt. ``images`` is what the profile says (None: the field left out)."""
    shipped = load_profile(SHIPPED)
    truth = knob_hardware(presets.hardware(hardware), TRUTH_KNOBS)
    meta = {**shipped.meta, "model": VL.name, "hardware": hardware}
    meta.pop(IMAGE_TOKENS, None)
    if images is not None:
        meta[IMAGE_TOKENS] = images
    frames = {}
    for kind, fields in (("rollout", ROLLOUT_FIELDS), ("trainer", TRAINER_FIELDS)):
        df = getattr(shipped, kind)[list(fields)].copy()
        df["prompt_len"] = df["prompt_len"] + IMAGES
        df = with_lengths(df)
        df["observed"] = predict_points(df.assign(kind=kind), truth, VL, meta, truth_images)
        frames[kind] = df
    return Profile(meta, frames["rollout"], frames["trainer"], None)


# --------------------------------------------------------------------------------------------------
# the field
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def profile_copy(tmp_path):
    folder = tmp_path / "prof"
    shutil.copytree(SHIPPED, folder)
    return folder


def _set(folder, value):
    meta = json.loads((folder / META_FILE).read_text())
    meta[IMAGE_TOKENS] = value
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("bad", [-1, 2.5, "256", True, None, [256]])
def test_a_bad_image_token_count_is_refused_naming_the_field_and_the_fix(profile_copy, bad):
    _set(profile_copy, bad)
    with pytest.raises(ProfileError) as info:
        load_profile(profile_copy)
    msg = str(info.value)
    assert "meta.json" in msg and IMAGE_TOKENS in msg and "whole number ≥ 0" in msg and "text-only" in msg


def test_more_image_tokens_than_a_prompt_holds_is_refused(profile_copy):
    shortest = int(load_profile(SHIPPED).rollout["prompt_len"].min())
    _set(profile_copy, shortest)
    assert load_profile(profile_copy).image_tokens_per_prompt == shortest       # the edge is allowed
    _set(profile_copy, shortest + 1)
    with pytest.raises(ProfileError, match=rf"{IMAGE_TOKENS}.*{shortest + 1}.*prompt_len {shortest}"):
        load_profile(profile_copy)


def test_the_field_is_written_and_read_back(tmp_path):
    prof = _vl_profile(IMAGES)
    save_profile(tmp_path / "vl", prof.meta, prof.rollout, prof.trainer)
    back = load_profile(tmp_path / "vl")
    assert back.image_tokens_per_prompt == IMAGES and image_tokens_of(back, VL) == IMAGES
    bad = dict(prof.meta, **{IMAGE_TOKENS: -3})
    with pytest.raises(ProfileError, match=IMAGE_TOKENS):
        save_profile(tmp_path / "bad", bad, prof.rollout, prof.trainer)


def test_absent_is_text_only_for_a_text_model_and_refused_for_a_vision_language_one():
    shipped = load_profile(SHIPPED)
    assert shipped.image_tokens_per_prompt is None
    assert image_tokens_of(shipped, presets.model("tiny")) == 0            # text-only, as the docs state
    with pytest.raises(ProfileError, match=rf"no field '{IMAGE_TOKENS}'.*qwen3-vl-2b.*vision encoder.*0 if the "
                                           "prompts were text only"):
        calibrate_profile(_vl_profile(None), overrides=False)
    # stated text-only prompts are accepted for a VL model; image tokens for a text model are refused
    assert image_tokens_of(_vl_profile(0), VL) == 0
    text = Profile({**shipped.meta, IMAGE_TOKENS: 4}, shipped.rollout, shipped.trainer, None)
    with pytest.raises(ProfileError, match="no vision encoder"):
        image_tokens_of(text, presets.model("tiny"))


# --------------------------------------------------------------------------------------------------
# the charge
# --------------------------------------------------------------------------------------------------

def test_each_trainer_chunk_pays_the_encoder_once_per_sample_at_the_stages_multiplier():
    """At one GPU a trainer chunk is τ_s + α_s·m_s·F(b) (no collectives, so nothing to overlap; a6000 states no
    cache, so no spill term): the image tokens add exactly α_s·m_s·2·N_vision·T_vit per sample, α_s =
    1/(peak·train_mfu). The two predictions are ≈ 0.01-1 s, so float64 rounding leaves ≈ 1e-16 s; rel 1e-9 is far
    above it and far below any defect (a missing or doubled encoder term is relative 1)."""
    prof = _vl_profile(IMAGES)
    hw = knob_hardware(presets.hardware("a6000"), TRUTH_KNOBS)
    t = prof.trainer.assign(kind="trainer")
    with_images = predict_points(t, hw, VL, prof.meta, IMAGES)
    without = predict_points(t, hw, VL, prof.meta, 0)
    alpha = 1.0 / (hw.peak_flops * hw.train_mfu)
    want = [alpha * STAGE_MULTIPLIER[s] * vit_forward_flops(VL, IMAGES, n) for s, n in zip(t["stage"], t["requests"])]
    np.testing.assert_allclose(with_images - without, want, rtol=1e-9)


def test_the_rollout_pays_the_encoder_in_prefill_once_per_request():
    prof = _vl_profile(IMAGES)
    hw = knob_hardware(presets.hardware("a6000"), TRUTH_KNOBS)
    r = prof.rollout.assign(kind="rollout")
    extra = predict_points(r, hw, VL, prof.meta, IMAGES) - predict_points(r, hw, VL, prof.meta, 0)
    assert np.all(extra > 0)
    # more requests, more encoder work: per request the extra time is within the prefill's FLOP rate of
    # 2·N_vision·T_vit (the overlap of prefill with decode can hide part of it, never add to it)
    per_request = vit_forward_flops(VL, IMAGES) / (hw.peak_flops * hw.prefill_mfu)
    assert np.all(extra <= r["requests"].to_numpy() * per_request * (1 + 1e-9))


def test_calibrating_a_vision_language_models_records_recovers_the_knobs_that_made_them():
    """Records made by the knob-derived models of TRUTH_KNOBS with 256 image tokens a prompt: told the count, the
    knob fit reproduces every record (as the text model's fit does, tests/test_calibration.py) and finds train_mfu;
    told the prompts were text only (what the earlier code assumed: it charged no encoder), it folds the encoder's
    work into the decoder's knobs."""
    told = calibrate_profile(_vl_profile(IMAGES), overrides=False)
    assert told.image_tokens_per_prompt == IMAGES and told.summary()[IMAGE_TOKENS] == IMAGES
    fit = told.knob_fit
    assert fit.success and fit.rollout_errors.max() < 1e-4 and fit.trainer_errors.max() < 1e-4, fit.report()
    assert told.knobs["train_mfu"] == pytest.approx(TRUTH_KNOBS["train_mfu"], rel=1e-4)
    # blind, the encoder's FLOPs (2 · 0.407 B · 1,024 ViT tokens ≈ 8.3e11 a sample, against the decoder's
    # 2 · N_dec · (p + r) ≈ 1e12 at these 260-290-token samples: ≈ 45 % of the work) go uncharged, so the fit lowers
    # train_mfu to about 0.55× the truth; 0.8× sits between that and a fit the images do not move
    blind = calibrate_profile(_vl_profile(0, truth_images=IMAGES), overrides=False)
    assert blind.knobs["train_mfu"] < 0.8 * TRUTH_KNOBS["train_mfu"]
