"""The trainer model's cache-spill term: the actor update's saved activations beyond the device's last-level cache
cost β_mem per byte (bidirl.perf.trainer.spill_bytes), fitted by bidirl calibrate on the fit points only."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.calibrate.from_records import calibrate_profile
from bidirl.experiments.stage_models import shipped_profile
from bidirl.job import presets
from bidirl.job.presets import PresetError
from bidirl.perf.fit import calibrate_trainer
from bidirl.perf.flops import STAGES
from bidirl.perf.params import TrainerParams, check_stage_params, default_trainer_params
from bidirl.perf.trainer import TrainerModel, saved_activation_bytes_per_token, spill_bytes

TINY = presets.model("tiny")
CPU = presets.hardware("cpu")
MIB = 2 ** 20


def test_saved_activation_bytes_follow_the_memory_models_formula_at_the_models_dtype():
    # tiny: L = 2, H = 128, V = 32, fp32 (4 bytes): 34·2·128·(4/2) + 4·32 = 17,408 + 128
    assert saved_activation_bytes_per_token(TINY) == 17536
    # a bf16 model keeps bidirl.perf.memory's unscaled 34·L·H + 4·V
    vl4b = presets.model("qwen3-vl-4b")
    assert vl4b.dtype_bytes == 2
    assert saved_activation_bytes_per_token(vl4b) == 34 * vl4b.layers * vl4b.hidden + 4 * vl4b.vocab


def test_only_the_update_spills_and_only_beyond_the_cache():
    per = saved_activation_bytes_per_token(TINY)
    knee = CPU.cache_bytes / per                                     # 33,554,432 / 17,536 ≈ 1,913 tokens
    tokens = np.array([100.0, knee, 4096.0])
    np.testing.assert_allclose(spill_bytes(TINY, CPU, "actor_update", tokens),
                               [0.0, 0.0, 4096 * per - 32 * MIB], atol=1e-6)
    for stage in ("old_logprob", "ref_logprob"):
        assert not spill_bytes(TINY, CPU, stage, tokens).any()
    # a preset that states no cache has no spill term
    assert not spill_bytes(TINY, dataclasses.replace(CPU, cache_bytes=0.0), "actor_update", tokens).any()


def test_no_gpu_preset_states_a_cache_or_a_spill_cost():
    """The term is 0 wherever it was not calibrated on records, so no GPU prediction moves."""
    for name in ("a6000", "h100", "h200", "h20"):
        hw = presets.hardware(name)
        assert hw.cache_bytes == 0
        for model in ("qwen3-vl-4b", "qwen3-vl-2b"):
            params = default_trainer_params(presets.model(model), hw)
            assert set(params.beta_mem.values()) == {0.0}
            assert not TrainerModel(presets.model(model), hw)._spills


def _spilling_model(beta=2e-9):
    params = default_trainer_params(TINY, CPU)
    params = dataclasses.replace(params, beta_mem={s: (beta if s == "actor_update" else 0.0) for s in STAGES})
    return TrainerModel(TINY, CPU, params=params), TrainerModel(TINY, CPU, params=dataclasses.replace(
        params, beta_mem={s: 0.0 for s in STAGES}))


def test_a_chunk_beyond_the_cache_pays_beta_mem_per_spilled_byte():
    model, plain = _spilling_model(2e-9)
    p, r = np.full(128, 24), np.full(128, 24)                     # 6,144 tokens on one replica
    spilled = 6144 * saved_activation_bytes_per_token(TINY) - 32 * MIB
    assert model.chunk_time("actor_update", p, r, 1) == pytest.approx(
        plain.chunk_time("actor_update", p, r, 1) + 2e-9 * spilled, rel=1e-12)
    # the forward-only stages and a chunk inside the cache are unchanged
    assert model.chunk_time("old_logprob", p, r, 1) == plain.chunk_time("old_logprob", p, r, 1)
    assert model.chunk_time("actor_update", p[:8], r[:8], 1) == plain.chunk_time("actor_update", p[:8], r[:8], 1)
    # on a gang of 4 each replica holds a quarter of the tokens (1,536 < 1,913): nothing spills
    assert model.chunk_time("actor_update", p, r, 4) == plain.chunk_time("actor_update", p, r, 4)
    # microbatch_time and replica_time charge it too
    assert model.microbatch_time("actor_update", p, r) == pytest.approx(model.chunk_time("actor_update", p, r, 1))
    assert model.replica_time([("actor_update", p, r), ("old_logprob", p, r)]) == pytest.approx(
        model.chunk_time("actor_update", p, r, 1) + model.chunk_time("old_logprob", p, r, 1))


def test_planner_paths_time_spilling_chunks_as_the_simulator_does():
    """stage_time / stage_times / span_times / packed_stage_time agree with chunk_time chunk by chunk."""
    model, plain = _spilling_model(2e-9)
    rng = np.random.default_rng(0)
    p, r = rng.integers(8, 40, 400), rng.integers(2, 60, 400)
    mb, d = 64, 2                                                  # chunks of 128 samples on 2 replicas
    size = model.chunk_size(mb, d)
    chunks = [(a, min(a + size, p.size)) for a in range(0, p.size, size)]
    by_chunk = sum(model.chunk_time(s, p[a:b], r[a:b], d) for s in STAGES for a, b in chunks)
    assert model.stage_time(p, r, d, mb) == pytest.approx(by_chunk, rel=1e-12)
    assert model.stage_time(p, r, d, mb) > plain.stage_time(p, r, d, mb)      # some of these chunks spill
    np.testing.assert_allclose(model.stage_times(p, r, [1, 2], mb),
                               [model.stage_time(p, r, 1, mb), model.stage_time(p, r, 2, mb)], rtol=1e-12)
    starts, stops = [a for a, _ in chunks], [b for _, b in chunks]
    np.testing.assert_allclose(model.span_times("actor_update", p, r, starts, stops, d),
                               [model.chunk_time("actor_update", p[a:b], r[a:b], d) for a, b in chunks], rtol=1e-12)
    bounds = model.span_time_bounds("actor_update", p, r, starts, stops, d)
    assert all(lo <= t for lo, t in zip(bounds, model.span_times("actor_update", p, r, starts, stops, d)))
    ids = model.packed_chunk_ids(p, r, d, 4096)
    packed = sum(model.chunk_time(s, p[ids == k], r[ids == k], d) for s in STAGES for k in np.unique(ids))
    assert model.packed_stage_time(p, r, d, 4096) == pytest.approx(packed, rel=1e-12)


def _calibrated_spilling(layout: int) -> TrainerModel:
    """cpu-calibrated's trainer (its stage_params, fitted on one replica of one core); on two cores the preset's
    defaults, whose FSDP collectives bring the p-norm overlap in, with the same fitted β_mem."""
    hw = presets.hardware("cpu-calibrated")
    if layout == 1:
        return TrainerModel(TINY, hw)
    beta = TrainerModel(TINY, hw).params.beta_mem
    return TrainerModel(TINY, hw, layout=layout,
                        params=dataclasses.replace(default_trainer_params(TINY, hw, layout), beta_mem=dict(beta)))


_CALIBRATED = {layout: _calibrated_spilling(layout) for layout in (1, 2)}


def _one_by_one(model, stage, p, r, bounds, d) -> np.ndarray:
    """The spill path as it was before the deals carried tokens: :meth:`TrainerModel.chunk_time` of each chunk."""
    return np.array([model.chunk_time(stage, p[a:b], r[a:b], d) for a, b in bounds], dtype=float)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 3000)), min_size=1, max_size=120),
       layout=st.sampled_from((1, 2)), d=st.integers(1, 6), mb=st.integers(1, 8), budget=st.integers(1, 4),
       cuts=st.lists(st.integers(0, 119), max_size=8))
def test_the_vectorised_spill_path_gives_the_one_by_one_chunk_times_exactly(lens, layout, d, mb, budget, cuts):
    """With the cache-spill term on (cpu-calibrated's fitted β_mem), the deals carry each replica's tokens: chunk
    times, stage times, span times and token-budget stage times are the same numbers (==, no tolerance) as timing
    each chunk alone — a replica's FLOPs and tokens are summed in the same order and timed by the same elementwise
    operations. Samples of up to 6,000 tokens put replicas on both sides of the 1,913-token cache knee."""
    model = _CALIBRATED[layout]
    assert model._spills and (layout == 1 or model._terms["actor_update"][2] > 0)
    p, r = np.array([a for a, _ in lens]), np.array([b for _, b in lens])
    n, size = p.size, model.chunk_size(mb, d)
    chunks = [(a, min(a + size, n)) for a in range(0, n, size)]
    by_stage = {s: _one_by_one(model, s, p, r, chunks, d) for s in STAGES}
    for s in STAGES:
        np.testing.assert_array_equal(model.chunk_times(s, p, r, d, size), by_stage[s])
    assert model.stage_time(p, r, d, mb) == float(sum(by_stage[s].sum() for s in STAGES))
    assert model.stage_times(p, r, [d], mb)[0] == model.stage_time(p, r, d, mb)
    edges = sorted({0, n, *(c for c in cuts if c < n)})
    spans = list(zip(edges[:-1], edges[1:]))
    assert model.span_times("actor_update", p, r, [a for a, _ in spans], [b for _, b in spans], d) == \
        _one_by_one(model, "actor_update", p, r, spans, d).tolist()
    max_tokens = budget * int((p + r).max())
    ids = model.packed_chunk_ids(p, r, d, max_tokens)
    bounds = np.flatnonzero(np.diff(ids)) + 1
    packed = list(zip(np.concatenate(([0], bounds)).tolist(), np.concatenate((bounds, [n])).tolist()))
    assert model.packed_stage_time(p, r, d, max_tokens) == \
        float(sum(_one_by_one(model, s, p, r, packed, d).sum() for s in STAGES))


def _records(model, rows):
    out = []
    for n, length in rows:
        p, r = np.full(n, length // 2), np.full(n, length - length // 2)
        for stage in STAGES:
            out.append({"stage": stage, "prompt_lens": p, "response_lens": r, "d": 1,
                        "observed": model.chunk_time(stage, p, r, 1)})
    return out


def test_calibrate_trainer_recovers_a_known_spill_cost_from_zero():
    truth, _ = _spilling_model(1e-9)
    # chunks from 64 to 6,144 tokens: both sides of the 1,913-token knee
    records = _records(truth, [(n, L) for n in (4, 16, 32, 64, 128) for L in (16, 32, 48)])
    start = TrainerModel(TINY, CPU)                                # priors: β_mem = 0
    fit = calibrate_trainer(records, start, fit_spill_cost=True)
    assert "beta_mem[actor_update]" in fit.fitted
    # noiseless records of the model's own form: each parameter comes back within 1e-4 relative, and a record's
    # time is a sum of non-negative terms each linear in one of them, so its relative error is below 1e-4 too
    assert fit.params.beta_mem["actor_update"] == pytest.approx(1e-9, rel=1e-4)
    for field in ("tau", "alpha"):
        assert getattr(fit.params, field)["actor_update"] == pytest.approx(
            getattr(truth.params, field)["actor_update"], rel=1e-4)
    assert fit.errors.max() < 1e-4
    without = calibrate_trainer(records, start)
    assert "beta_mem[actor_update]" not in without.fitted and without.errors.max() > 0.01


def test_fitting_the_spill_cost_needs_the_cache_size():
    no_cache = dataclasses.replace(CPU, cache_bytes=0.0)
    truth, _ = _spilling_model(1e-9)
    with pytest.raises(ValueError, match="cache_bytes"):
        calibrate_trainer(_records(truth, [(16, 32)]), TrainerModel(TINY, no_cache), fit_spill_cost=True)


def test_presets_validate_cache_bytes_and_beta_mem(tmp_path):
    src = (presets.data_dir() / "presets" / "hardware" / "cpu.yaml").read_text()
    bad = tmp_path / "cpu-bad.yaml"
    bad.write_text(src.replace("cache_bytes: 33554432", "cache_bytes: -1"))
    with pytest.raises(PresetError, match="cache_bytes"):
        presets.load_hardware_file(bad)
    with pytest.raises(ValueError, match="beta_mem.actor_update"):
        check_stage_params({"tiny": {"trainer": {"layout": 1, "beta_mem": {"actor_update": -1e-9}}}})
    with pytest.raises(ValueError, match="beta_mem"):
        TrainerParams(**{f: {s: 1.0 for s in STAGES} for f in ("tau", "alpha", "r", "alpha_comm", "beta_comm")},
                      beta_mem={s: -1.0 for s in STAGES})


def test_the_shipped_calibration_fits_the_spill_cost_on_the_fit_points_and_lowers_the_held_out_errors():
    """On data/profiles/cpu-tiny (seed 0) the fitted β_mem is positive, and the held-out trainer errors, which the
    fit never sees, fall: the largest update chunks were the ones the single FLOP rate under-predicted."""
    with_spill = calibrate_profile(shipped_profile(), holdout=0.25, seed=0)
    without = calibrate_profile(shipped_profile(), holdout=0.25, seed=0, spill_cost=False)
    assert with_spill.stage_params["trainer"]["beta_mem"]["actor_update"] > 0
    assert "beta_mem" not in without.stage_params["trainer"]
    a, b = with_spill.error("trainer"), without.error("trainer")
    assert a["median"] < b["median"] and a["p90"] < b["p90"]
    shipped = presets.hardware("cpu-calibrated")
    assert shipped.cache_bytes == CPU.cache_bytes
    assert shipped.stage_params["tiny"]["trainer"]["beta_mem"]["actor_update"] == pytest.approx(
        with_spill.stage_params["trainer"]["beta_mem"]["actor_update"], rel=1e-3)
    # the fit reads the fit points only: moving a held-out point's observation leaves β_mem where it was
    prof = shipped_profile()
    held = with_spill.table[(with_spill.table["split"] == "held-out")]["point"].unique()
    trainer = prof.trainer.copy()
    trainer.loc[trainer["point"].isin(held), "observed"] *= 3.0
    moved = calibrate_profile(dataclasses.replace(prof, trainer=trainer), holdout=0.25, seed=0)
    assert moved.stage_params["trainer"]["beta_mem"] == with_spill.stage_params["trainer"]["beta_mem"]



def test_the_spill_costs_fitting_unit_is_one_pass_at_the_datasheet_bandwidth():
    from types import SimpleNamespace

    from bidirl.perf.fit import OVERHEAD_SCALE, spill_cost_unit
    assert spill_cost_unit(CPU) == 1.0 / CPU.memory_bandwidth == 1 / 20e9
    # hardware that states no bandwidth: the overhead scale (what 1 / (1 / OVERHEAD_SCALE) gave, the same float)
    assert spill_cost_unit(SimpleNamespace()) == OVERHEAD_SCALE == 1.0 / (1.0 / OVERHEAD_SCALE)
